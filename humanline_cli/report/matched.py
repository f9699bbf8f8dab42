"""Matched-quality speedup: per regime, the training loop's wall-clock to reach a target score, from its runs'
learning curves, as time to an event that some seeds never reach: "k of n seeds reached" beside the
Kaplan-Meier median over seeds, a seed that never reaches the target censored at its run's end.

The target is fixed before any time is read: `--accuracy` names it (the way a pre-registered study does), else
the rule start + TARGET_GAIN x (online's mean final score - start). The rule reads means only, so it does not
move with the number of seeds. A run's learning curve is its evaluations: the starting policy at step 0, every
mid-run evaluation, the final one; each point is placed at the loop's wall-clock when its step ended
(metrics.jsonl `wall_s` less setup, evaluation, saving, checkpoints and the sampler's start-up: what `loop`
counts in report/speed.py) and at its step. Between points the curve is linear; the first crossing counts.

Why the Kaplan-Meier median and not a ratio of restricted mean times: regimes end at different loop seconds (a
stale regime's run is shorter), so a restricted mean needs one horizon no later than the shortest run, and
would cut online's times off there; the median takes each seed's own end as its censoring time and is defined
whenever at least half the seeds reached the target. Averaging the seeds that reached it (as a mean of raw
times or ratios does) drops exactly the slow seeds.

Per regime: median seconds to the target (measured), median steps to it, and, given predictions, the predicted
loop seconds prorated by median steps to it (machine-independent steps times a target's predicted seconds per
step). Speedup over online = online's median seconds over the regime's. The equal-step speedup (online's whole
loop over the regime's, the same number of steps, not the same quality) is given beside it and labelled so.
"""
from __future__ import annotations

import statistics

import pandas as pd

from humanline_cli.report.frame import LEFT_OUT, md_table, metric_of, run_points
from humanline_cli.report.gap_closed import time_to
from humanline_cli.report.stats import km_median

TARGET_GAIN = 0.9  # the default target: this share of online's mean gain over the start


def curve(summary: dict, metrics: list[dict], metric: str) -> list[tuple[int, float, float]]:
    """[(step, loop seconds, score)]: start at (0, 0), mid-run evaluations, the final evaluation."""
    got = run_points(summary, metrics)[["step", "loop_s", metric]].dropna()
    return [(int(st), float(t), float(v)) for st, t, v in got.itertuples(index=False)]


def _loop(summary: dict) -> float:
    w = summary.get("wall_clock_s") or {}
    return float(w.get("total", 0.0)) - sum(float(w.get(k, 0.0) or 0.0) for k in LEFT_OUT)


def reach(points: list[tuple[int, float, float]], target: float) -> tuple[float, float] | None:
    """(steps, loop seconds) at which the curve first reaches `target`, None if never."""
    steps = time_to([(p[0], p[2]) for p in points], target)
    if steps is None:
        return None
    return steps, time_to([(p[1], p[2]) for p in points], target)


def km_medians(points_by_seed: dict, target: float) -> dict:
    """Per seed, (steps, seconds) to `target`, or, where the curve never reaches it, at its last point
    (censored); the Kaplan-Meier medians of steps and of seconds over the seeds (stats.km_median)."""
    reached, ended = {}, {}
    for seed, points in points_by_seed.items():
        x = reach(points, target)
        if x is not None:
            reached[seed] = x
        elif points:
            ended[seed] = (float(points[-1][0]), points[-1][1])
    both = [*reached.values(), *ended.values()]
    hit = [True] * len(reached) + [False] * len(ended)
    return {"reached": reached, "ended": ended, "steps": km_median([st for st, _ in both], hit),
            "seconds": km_median([s for _, s in both], hit)}


# A regime's row: the target and how it was set, its seeds, those that reached it ({seed: (steps, seconds)}) and
# those that ended short ({seed: (steps, seconds) at the end}), the runs' steps and mean loop seconds, the
# Kaplan-Meier medians of steps and seconds to the target (None: fewer than half reached it), online's median
# seconds over this regime's, and online's whole loop over this regime's (equal steps, not equal quality).
ROW = ("task", "objective", "regime", "metric", "target", "target_note", "seeds", "reached", "ended", "steps",
       "loop_s", "steps_to", "seconds", "speedup", "equal_step_speedup")


def target_of(online_curves: list, accuracy: float | None) -> tuple[float, str]:
    """The target score and how it was set: `accuracy` where named in advance (--accuracy), else the rule
    start + TARGET_GAIN x (online's mean final score - start), start = online's mean starting score. The rule
    reads only means, so the target does not move with the number of seeds (a mean minus a half-width would)."""
    if accuracy is not None:
        return accuracy, "named (--accuracy)"
    start = statistics.fmean(c[0][2] for c in online_curves)
    final = statistics.fmean(c[-1][2] for c in online_curves)
    return start + TARGET_GAIN * (final - start), (f"start {start:.4g} + {TARGET_GAIN:g} x (online's mean final "
                                                    f"{final:.4g} - start)")


def matched_rows(runs: pd.DataFrame, accuracy: float | None = None) -> pd.DataFrame:
    """Per (task, objective) with online runs, one row per regime (the runs' `regime` column), in first-seen order."""
    rows = []
    for (task, obj), tr in runs.groupby(["task", "objective"], sort=False):
        if "online" not in set(tr.regime):
            continue
        metric = metric_of(tr[tr.regime == "online"].iloc[0]["summary"])
        if metric == "none":
            continue
        # per regime: seed -> (summary, curve), a seed's last run
        curves = {name: {r.seed: (r.summary, curve(r.summary, r.metrics, metric)) for r in rs.itertuples()}
                  for name, rs in tr.groupby("regime", sort=False)}
        on_curves = [c for _, c in curves["online"].values() if c]
        if not on_curves:
            continue
        target, note = target_of(on_curves, accuracy)
        on_med = km_medians({s: c for s, (_, c) in curves["online"].items()}, target)["seconds"]
        on_loop = statistics.fmean(tr[tr.regime == "online"]["summary"].map(_loop))
        for name, seeds in curves.items():
            med = km_medians({s: c for s, (_, c) in seeds.items()}, target)
            loop = statistics.fmean(_loop(summary) for summary, _ in seeds.values())
            steps = int(next(iter(seeds.values()))[0].get("steps") or 0)
            speedup = on_med / med["seconds"] if on_med is not None and med["seconds"] else None
            rows.append((task, obj, name, metric, target, note, len(seeds), med["reached"], med["ended"], steps, loop,
                         med["steps"], med["seconds"], speedup, on_loop / loop if loop else None))
    return pd.DataFrame(rows, columns=ROW, dtype=object)


def _num(x: float | None, fmt: str, unit: str = "") -> str:
    return "–" if x is None else format(x, fmt) + unit


def markdown(rows: pd.DataFrame, predicted: dict | None = None) -> list[str]:
    """`predicted`: target name -> {(task, objective, regime): predicted loop seconds of the whole run}."""
    if rows.empty:
        return ["No online runs with learning curves to match."]
    rows = list(rows.itertuples())
    targets = dict.fromkeys(f"{r.task} / {r.objective}: {r.metric} {r.target:.4g} ({r.target_note})" for r in rows)
    out = [f"Target: {'; '.join(targets)}. Per seed, the loop wall-clock (and steps) to first reach it; a seed that "
           "never reaches it is censored at its run's end. Each regime: how many of its seeds reached it, and the "
           "Kaplan-Meier median over seeds (the smallest time by which at least half its seeds are estimated to "
           "have reached it; `–`: fewer than half did). Speedup at matched quality = online's median seconds / the "
           "regime's (no interval: a ratio of medians of a few censored seeds has none worth printing). The "
           "equal-step column compares whole runs of the same steps (not the same quality).", ""]
    extra = list(predicted or {})

    def predicted_s(r, t: str) -> str:
        loop = predicted[t].get((r.task, r.objective, r.regime))
        return "–" if loop is None or r.steps_to is None or not r.steps else f"{loop * r.steps_to / r.steps:.4g}"

    return out + md_table(["task", "objective", "regime", "reached", "median steps to target",
                           "median seconds to target (measured)", *(f"predicted s on {t}" for t in extra),
                           "speedup at matched quality", "speedup at equal steps (not matched quality)"],
                          [(r.task, r.objective, r.regime, f"{len(r.reached)} of {r.seeds}"
                            + ("" if not r.ended else f" (not reached: {len(r.ended)})"), _num(r.steps_to, ".1f"),
                            _num(r.seconds, ".1f"), *(predicted_s(r, t) for t in extra), _num(r.speedup, ".2f", "x"),
                            _num(r.equal_step_speedup, ".2f", "x")) for r in rows])
