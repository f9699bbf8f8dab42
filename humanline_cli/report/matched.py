"""Matched-quality speedup: per regime, the training loop's wall-clock to reach a named score, from its runs'
learning curves, with a 95% interval over seeds; "not reached" where a seed's curve never gets there.

The target score defaults to online's final score (mean over its seeds) minus its interval's half-width (the
lowest final score online's seeds support; with one seed, online's final score itself). A run's learning curve
is its evaluations: the starting policy at step 0, every mid-run evaluation, the final one; each point is placed
at the loop's wall-clock when its step ended (metrics.jsonl `wall_s` less setup, evaluation, saving,
checkpoints and the sampler's start-up: what `loop` counts in report/speed.py) and at its step. Between points
the curve is linear; the first crossing counts.

Per regime: seconds to the target (measured), steps to it, and, given predictions, the predicted loop seconds
prorated by steps to it (machine-independent steps times a target's predicted seconds per step). Speedup over
online = online's seconds to the target over the regime's, per seed where both reached it (paired by seed). The
equal-step speedup (online's whole loop over the regime's, the same number of steps, not the same quality) is
given beside it and labelled so.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from humanline_cli.report.gap_closed import CURVE_KEYS, mean_ci, metric_of, metric_value, time_to
from humanline_cli.report.regime_map import regime_label

LEFT_OUT = ("setup", "eval", "save", "checkpoint", "sampler_start")


def curve(summary: dict, metrics: list[dict], metric: str) -> list[tuple[int, float, float]]:
    """[(step, loop seconds, score)]: start at (0, 0), mid-run evaluations, the final evaluation."""
    key, start = CURVE_KEYS[metric]
    ev = summary.get("eval") or {}
    points = []
    if start is None:
        points.append((0, 0.0, 0.5))
    else:
        mode, field_ = start
        value = (ev.get(mode) or {}).get(field_) if mode else ev.get(field_)
        if value is not None:
            points.append((0, 0.0, float(value)))
    train_rows = {r["step"]: r for r in metrics if "wall_s" in r and "time/train" in r}
    for r in metrics:
        if key in r and r.get("step") in train_rows:
            t = train_rows[r["step"]]
            points.append((int(r["step"]), _loop_at(t["wall_s"], {k[5:]: v for k, v in t.items() if k.startswith("time/")}),
                           float(r[key])))
    final = metric_value(summary, metric)
    w = summary.get("wall_clock_s") or {}
    if final is not None and w:
        points.append((int(summary.get("steps") or 0), _loop_at(w.get("total", 0.0), w), final))
    return points


def _loop_at(wall: float, phases: dict) -> float:
    return float(wall) - sum(float(phases.get(k, 0.0) or 0.0) for k in LEFT_OUT)


def reach(points: list[tuple[int, float, float]], target: float) -> tuple[float, float] | None:
    """(steps, loop seconds) at which the curve first reaches `target`, None if never."""
    steps = time_to([(p[0], p[2]) for p in points], target)
    if steps is None:
        return None
    return steps, time_to([(p[1], p[2]) for p in points], target)


@dataclass(frozen=True)
class MatchedRow:
    task: str
    objective: str
    regime: str
    metric: str
    target: float
    target_note: str
    seeds: int
    reached: dict        # seed -> (steps, seconds)
    steps: int           # steps of the runs (the equal-step comparison)
    loop_s: float        # mean measured loop seconds of the whole run
    speedup: dict | None  # mean_ci over paired seeds of online seconds / this regime's seconds
    equal_step_speedup: float | None

    @property
    def seconds(self) -> dict | None:
        return mean_ci([s for _, s in self.reached.values()])

    @property
    def steps_to(self) -> dict | None:
        return mean_ci([st for st, _ in self.reached.values()])


def matched_rows(runs: list, accuracy: float | None = None) -> list[MatchedRow]:
    by: dict[tuple, dict] = {}
    for r in runs:
        if r.status == "complete":
            by.setdefault((r.task, r.objective), {}).setdefault(regime_label(r), []).append(r)
    rows = []
    for (task, obj), regimes in by.items():
        online = regimes.get("online")
        if not online:
            continue
        metric = metric_of(online[0].summary)[0]
        if metric == "none":
            continue
        finals = [v for v in (metric_value(r.summary, metric) for r in online) if v is not None]
        if accuracy is not None:
            target, note = accuracy, "named (--accuracy)"
        else:
            ci = mean_ci(finals)
            half = (ci["hi"] - ci["mean"]) if ci and ci["hi"] is not None else 0.0
            target = ci["mean"] - half
            note = (f"online's final {ci['mean']:.4g} minus its half-width {half:.3g}" if len(finals) > 1
                    else f"online's final {ci['mean']:.4g} (one seed: no interval)")
        curves = {name: {r.seed: (r, curve(r.summary, r.metrics, metric)) for r in rs} for name, rs in regimes.items()}
        on_reached = {s: reach(c, target) for s, (_, c) in curves["online"].items()}
        on_loop = statistics.fmean(_loop_at((r.summary.get("wall_clock_s") or {}).get("total", 0.0),
                                            r.summary.get("wall_clock_s") or {}) for r in online)
        for name, seeds in curves.items():
            reached = {s: x for s, x in ((s, reach(c, target)) for s, (_, c) in seeds.items()) if x is not None}
            ratios = [on_reached[s][1] / reached[s][1] for s in reached
                      if on_reached.get(s) is not None and reached[s][1] > 0]
            loop = statistics.fmean(_loop_at((r.summary.get("wall_clock_s") or {}).get("total", 0.0),
                                             r.summary.get("wall_clock_s") or {}) for r, _ in seeds.values())
            steps = int(next(iter(seeds.values()))[0].summary.get("steps") or 0)
            rows.append(MatchedRow(task, obj, name, metric, target, note, len(seeds), reached, steps, loop,
                                   mean_ci(ratios), on_loop / loop if loop else None))
    return rows


def _ci(ci: dict | None, fmt: str) -> str:
    if ci is None:
        return "–"
    s = format(ci["mean"], fmt)
    return s + (f" [{format(ci['lo'], fmt)}, {format(ci['hi'], fmt)}]" if ci["lo"] is not None else "")


def markdown(rows: list[MatchedRow], predicted: dict | None = None) -> list[str]:
    """`predicted`: target name -> {(task, objective, regime): predicted loop seconds of the whole run}."""
    if not rows:
        return ["No online runs with learning curves to match."]
    r0 = rows[0]
    out = [f"Target: {r0.metric} {r0.target:.4g} ({r0.target_note}). Loop wall-clock to reach it, mean [95% interval] "
           "over the seeds that did; speedup over online paired by seed. The equal-step column compares whole runs "
           "of the same steps (not the same quality).", ""]
    extra = list(predicted or {})
    out += ["| task | objective | regime | reached | steps to target | seconds to target (measured) | "
            + "".join(f"predicted s on {t} | " for t in extra)
            + "speedup at matched quality | speedup at equal steps (not matched quality) |",
            "|---|---|---|---|---|---|" + "---|" * len(extra) + "---|---|"]
    for r in rows:
        reached = f"{len(r.reached)}/{r.seeds}" + ("" if len(r.reached) == r.seeds else " (not reached: "
                                                  f"{r.seeds - len(r.reached)})")
        preds = []
        for t in extra:
            loop = predicted[t].get((r.task, r.objective, r.regime))
            st = r.steps_to
            preds.append("–" if loop is None or st is None or not r.steps else f"{loop * st['mean'] / r.steps:.4g}")
        out.append(f"| {r.task} | {r.objective} | {r.regime} | {reached} | {_ci(r.steps_to, '.1f')} | "
                   f"{_ci(r.seconds, '.1f')} | " + "".join(p + " | " for p in preds)
                   + f"{_ci(r.speedup, '.2f')}{'x' if r.speedup else ''} | "
                   + ("–" if r.equal_step_speedup is None else f"{r.equal_step_speedup:.2f}x") + " |")
    return out
