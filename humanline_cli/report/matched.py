"""Matched-quality speedup: per regime, the training loop's seconds (setup, evaluation, saving, checkpoints and
the sampler's start-up left out) and steps to a target score, from learning curves (the start at 0, every
evaluation, linear between them). A seed that never reaches it is censored at its end; each regime reports
"k of n reached" and the Kaplan-Meier median over seeds, which, unlike a restricted mean, needs no common horizon
(regimes end at different loop seconds) and, unlike a mean over the seeds that reached it, keeps the slow ones.

The target is fixed before any time is read: `--accuracy`, else start + TARGET_GAIN x (online's mean final score
- start), which reads means only and so does not move with the number of seeds.
"""
from __future__ import annotations

import pandas as pd

from humanline_cli.mdtable import md_frame
from humanline_cli.report.frame import curve, loop_seconds, metric_of, run_points
from humanline_cli.report.gap_closed import TARGET_GAIN, gain_target, km_to
from humanline_cli.report.groups import plain


def km_medians(curves: list, target: float) -> dict:
    """How many of the seeds' curves reach `target` (n: every seed, one without evaluations never reaching it),
    and the Kaplan-Meier medians of steps and of seconds to it over the curves that have points."""
    steps, secs = (km_to([[(p[i], p[2]) for p in c] for c in curves if c], target) for i in (0, 1))
    return {"reached": steps["reached"], "n": len(curves), "steps": steps["median"], "seconds": secs["median"]}


def baseline(runs: pd.DataFrame) -> str | None:
    """The regime the others are matched against: `online`, else the plain one (groups.plain: correction=none
    where they differ in it) of the online family's regimes, where that is one regime."""
    if (runs.regime == "online").any():
        return "online"
    online = runs[runs.family == "online"]
    names = set(online.regime[plain(online.config)])
    return names.pop() if len(names) == 1 else None


ROW = ("task", "objective", "regime", "metric", "target", "target_note", "seeds", "reached", "ended", "steps", "loop_s",
       "steps_to", "seconds", "speedup", "equal_step_speedup")


def matched_rows(runs: pd.DataFrame, accuracy: float | None = None) -> pd.DataFrame:
    """Per (task, objective) with online runs (the baseline regime), one row per regime (`regime`), in first-seen
    order; `seeds` counts a seed's last run."""
    rows = []
    runs = runs.assign(loop=runs["summary"].map(loop_seconds))
    for (task, obj), tr in runs.groupby(["task", "objective"], sort=False):
        base = baseline(tr)
        online = tr[tr.regime == base]
        metric = metric_of(online.iloc[0]["summary"]) if len(online) else "none"
        if metric == "none":
            continue
        tr = tr[~tr.duplicated(["regime", "seed"], keep="last")]
        curves = {name: [curve(run_points(r.summary, r.metrics), metric, "step", "loop_s") for r in rs.itertuples()]
                  for name, rs in tr.groupby("regime", sort=False)}
        if not any(curves[base]):
            continue
        start, final, gained = gain_target(curves[base])
        target, note = (accuracy, "named (--accuracy)") if accuracy is not None else (
            gained, f"start {start:.4g} + {TARGET_GAIN:g} x (online's mean final "
                                                   f"{final:.4g} - start)")
        on_med = km_medians(curves[base], target)["seconds"]
        on_loop = online["loop"].mean()
        for name, rs in tr.groupby("regime", sort=False):
            med, loop = km_medians(curves[name], target), rs["loop"].mean()
            rows.append((task, obj, name, metric, target, note, len(rs), med["reached"], med["n"] - med["reached"],
                         int(rs.iloc[0]["summary"].get("steps") or 0), loop, med["steps"], med["seconds"],
                         on_med / med["seconds"] if on_med is not None and med["seconds"] else None,
                         on_loop / loop if loop else None))
    return pd.DataFrame(rows, columns=ROW, dtype=object)


def markdown(rows: pd.DataFrame, extra: pd.DataFrame | None = None) -> list[str]:
    """`extra`: more columns, aligned with `rows` (text, or None for "–"), shown before the speedups."""
    if rows.empty:
        return ["No online runs with learning curves to match."]
    targets = dict.fromkeys(f"{r.task} / {r.objective}: {r.metric} {r.target:.4g} ({r.target_note})"
                            for r in rows.itertuples())
    out = [f"Target: {'; '.join(targets)}. Per seed, the loop wall-clock (and steps) to first reach it; a seed that "
           "never reaches it is censored at its run's end. Each regime: how many of its seeds reached it, and the "
           "Kaplan-Meier median over seeds (the smallest time by which at least half its seeds are estimated to "
           "have reached it; `–`: fewer than half did). Speedup at matched quality = online's median seconds / the "
           "regime's (no interval: a ratio of medians of a few censored seeds has none worth printing). The "
           "equal-step column compares whole runs of the same steps (not the same quality).", ""]
    view = pd.DataFrame({"task": rows.task, "objective": rows.objective, "regime": rows.regime,
                         "reached": [f"{r.reached} of {r.seeds}" + (f" (not reached: {r.ended})" if r.ended else "")
                                     for r in rows.itertuples()],
                         "median steps to target": rows.steps_to, "median seconds to target (measured)": rows.seconds})
    view = view.join(extra) if extra is not None else view
    view["speedup at matched quality"] = rows.speedup
    view["speedup at equal steps (not matched quality)"] = rows.equal_step_speedup
    x = "{:.2f}x".format
    return out + md_frame(view, {"median steps to target": "{:.1f}", "median seconds to target (measured)": "{:.1f}",
                                 "speedup at matched quality": x, "speedup at equal steps (not matched quality)": x})
