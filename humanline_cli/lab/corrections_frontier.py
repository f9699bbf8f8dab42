"""The corrections frontier (docs/results.md, "Registered: humanline against the staleness corrections"): per
(objective, K = data.generate_every, correction) the last step's greedy and sampled accuracy with 95% t-intervals
over seeds; paired differences between corrections at each K (by seed: the mean, its 95% t-interval and the
two-sided paired-t p); the steps and the loop wall-clock seconds (report/frame.loop_seconds: setup, evaluation and
saving left out; a seed's step to the target read on its loop clock, linear between logged train rows:
report/frame.clocks) to a target per cell, greedy and sampled; and the frontier plot (accuracy at the last step
against K, one line per correction, a row of greedy and sampled panels per objective). The GRPO grid and the DPO/KTO pairs
study (objective x K x correction) read alike.

The target is the report's matched-quality rule (report/gap_closed.gain_target) on the K=1 `none` runs (plain
online) of the same objective: start + 0.9 x (their mean final - start), from their learning curves (the start,
every evaluation, linear between); no compared cell at K > 1 sets its own bar. A seed that never reaches it is
censored at its end (Kaplan-Meier median). With evaluations every E steps a crossing is placed by linear
interpolation inside the E-step interval it falls in: the output states E, the resolution of every time to target.

    python -m humanline_cli.lab.corrections_frontier runs/experiments/laptop_corrections_frontier --out corrections.png
    python -m humanline_cli.lab.corrections_frontier humanline_cli/docs/studies/laptop_corrections_frontier.csv

A study CSV (`humanline report DIR --export-csv FILE`) stands in for the run dirs: its runs are rebuilt in a
temporary folder (report/study_csv.materialise), learning curves and loop clocks included.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from humanline_cli.errors import UserError
from humanline_cli.mdtable import md_table
from humanline_cli.report.frame import ci_text, clocks, column, curve, load, loop_seconds, run_points
from humanline_cli.report.gap_closed import gain_target, km_to, time_to
from humanline_cli.report.plots import save_figure
from humanline_cli.report.stats import km_median, mean_ci, paired_by_seed
from humanline_cli.report.study_csv import materialise

METRICS = {"greedy": "eval.greedy.accuracy", "sampled": "eval.sampled.accuracy"}
CURVES = {"greedy": "greedy accuracy", "sampled": "sampled accuracy"}  # report/frame.CURVE's names
ORDER = ("none", "humanline", "tis", "mis", "decoupled", "trdpo")
# the contrasts printed at every K: the registered primary's first, then each correction against none
CONTRASTS = (("humanline", "tis"), ("humanline", "none"), ("tis", "none"), ("decoupled", "none"),
             ("humanline", "decoupled"), ("trdpo", "none"), ("humanline", "trdpo"))


def cells(runs: pd.DataFrame) -> pd.DataFrame:
    """Complete runs with objective, K, L (data.async_lag: rounds sampled ahead, 0 synchronous), correction
    (humanline=true counts as humanline), seed and the last step's greedy and sampled accuracy."""
    runs = runs[runs.status == "complete"]
    kind = runs["cfg.correction.kind"] if "cfg.correction.kind" in runs else pd.Series(None, index=runs.index)
    kind = [("humanline" if h else "none") if k is None or k != k else str(k) for k, h in zip(kind, runs.humanline)]
    return runs.assign(K=column(runs, "cfg.data.generate_every").fillna(1).astype(int),
                       L=column(runs, "cfg.data.async_lag").fillna(0).astype(int), correction=kind,
                       **{m: column(runs, key) for m, key in METRICS.items()})


def _ordered(values) -> list[str]:
    return sorted(set(values), key=lambda c: (ORDER.index(c) if c in ORDER else len(ORDER), c))


def frontier_rows(c: pd.DataFrame) -> list[dict]:
    """One row per (objective, K, correction): seeds and each metric's mean and 95% t-interval."""
    out = []
    for (obj, k, lag), g in c.groupby(["objective", "K", "L"], sort=True):
        for corr in _ordered(g.correction):
            rs = g[g.correction == corr]
            out.append({"objective": obj, "K": k, "L": lag, "correction": corr, "n": len(rs),
                        **{m: mean_ci(rs[m].dropna().astype(float)) for m in METRICS}})
    return out


def paired(c: pd.DataFrame, objective: str, k: int, a: str, b: str, metric: str, lag: int = 0) -> dict | None:
    """a - b at K and lag, paired by seed (report/stats.paired_by_seed)."""
    g = c[(c.objective == objective) & (k == c.K) & (lag == c.L)]
    return paired_by_seed(*(g[g.correction == name].set_index("seed")[metric] for name in (a, b)))


def paired_rows(c: pd.DataFrame) -> list[dict]:
    rows = []
    for (obj, k, lag), g in c.groupby(["objective", "K", "L"], sort=True):
        have = set(g.correction)
        for a, b in CONTRASTS:
            for m in METRICS:
                d = paired(c, obj, k, a, b, m, lag) if {a, b} <= have else None
                if d is not None:
                    rows.append({"objective": obj, "K": k, "L": lag, "contrast": f"{a} - {b}", "metric": m, **d})
    return rows


def time_rows(c: pd.DataFrame, metric: str = "greedy") -> list[dict]:
    """Per (objective, K, correction): the target (start, online's mean final, the target), how many seeds reached
    it, the Kaplan-Meier medians of steps and of loop seconds to it, the mean loop seconds of the whole run and
    the evaluation grid (`evals`: the steps evaluated, start and end included; `every`: the widest interval
    between two of them, the resolution of a time to target)."""
    rows = []
    for obj, g in c.groupby("objective", sort=True):
        pts = {i: run_points(r["summary"], r["metrics"]) for i, r in g.iterrows()}
        steps = {i: curve(p, CURVES[metric], "step") for i, p in pts.items()}
        loops = {i: clocks(g.at[i, "summary"], g.at[i, "metrics"])["loop_s"] for i in pts}
        online = [steps[i] for i in g[(g.K == 1) & (g.L == 0) & (g.correction == "none")].index if steps[i]]
        if not online:
            continue
        start, final, target = gain_target(online)
        grid = sorted({int(t) for cv in steps.values() for t, _ in cv})
        every = max((b - a for a, b in zip(grid, grid[1:])), default=None)
        for (k, lag, corr), rs in sorted(g.groupby(["K", "L", "correction"]), key=lambda kv: (
                kv[0][0], kv[0][1], _ordered(g.correction).index(kv[0][2]))):
            runs = [i for i in rs.index if steps[i]]
            st, secs = km_to([steps[i] for i in runs], target), km_seconds([steps[i] for i in runs],
                                                                             [loops[i] for i in runs], target)
            # fewer than half reached it: no median in either unit (seconds' censoring times vary with the
            # machine's load, so their Kaplan-Meier median can exist where the steps' cannot)
            half = 2 * st["reached"] >= st["n"]
            rows.append({"objective": obj, "K": k, "L": lag, "correction": corr, "metric": metric, "start": start,
                         "final": final, "target": target, "reached": st["reached"], "n": st["n"],
                         "steps": st["median"] if half else None, "seconds": secs if half else None,
                         "loop_s": float(rs["summary"].map(loop_seconds).mean()), "evals": grid, "every": every})
    return rows


def km_seconds(curves: list, clocks: list, target: float) -> float | None:
    """The Kaplan-Meier median loop seconds to `target`: each seed's step at which its curve first reaches it
    (its last step where it never does, censored) read on its loop clock."""
    times = [time_to(c, target) for c in curves]
    at = [float(np.interp(c[-1][0] if t is None else t, *clock)) for c, t, clock in zip(curves, times, clocks)]
    return km_median(at, [t is not None for t in times])


def target_note(times: list[dict]) -> list[str]:
    """The target rule and each (objective, metric)'s target, evaluation grid and resolution, in words."""
    seen = {(r["objective"], r["metric"]): r for r in times}
    out = ["Target per objective and metric: start + 0.9 x (plain online's mean final - start), plain online being "
           "K=1 with correction=none (report/matched.py's rule): it reads none of the compared cells beyond K=1, "
           "so it favours no correction at K > 1. Per seed the steps and the loop wall-clock seconds (setup, "
           "evaluation and saving left out) at which its learning curve (the start, every evaluation, linear "
           "between) first reaches it; a seed that never does is censored at its end; per cell the Kaplan-Meier "
           "median over seeds (–: fewer than half reached it)."]
    for (obj, metric), r in seen.items():
        res = ("" if r["every"] is None else
               f"; evaluated at steps {', '.join(map(str, r['evals']))}, so a crossing is only placed by "
               f"interpolation inside the {r['every']}-step interval it falls in: times to target differing by "
               f"less than {r['every']} steps (or the seconds those steps take) are not resolved")
        out.append(f"- {obj}, {metric}: start {r['start']:.4g}, plain online's mean final {r['final']:.4g}, "
                   f"target {r['target']:.4g}{res}.")
    return out


def _p(p: float | None) -> str:
    return "–" if p is None else f"{p:.2g}" if p >= 1e-4 else f"{p:.1e}"


def _k(r: dict) -> str:
    """The K column: K, and the lag of asynchronous rounds where there is one."""
    return str(r["K"]) if not r.get("L") else f"{r['K']}, lag {r['L']}"


def markdown(front: list[dict], pairs: list[dict], times: list[dict]) -> list[str]:
    lines = ["Last step, mean [95% t-interval over seeds]:", ""]
    lines += md_table(["objective", "K", "correction", "seeds", "greedy", "sampled"],
                      [(r["objective"], _k(r), r["correction"], r["n"], ci_text(r["greedy"]), ci_text(r["sampled"]))
                       for r in front])
    lines += ["", "Paired by seed, a - b, mean [95% t-interval], two-sided paired-t p:", ""]
    lines += md_table(["objective", "K", "contrast", "metric", "seeds", "difference", "p"],
                      [(r["objective"], _k(r), r["contrast"], r["metric"], len(r["seeds"]), ci_text(r, "+.3f"),
                        _p(r["p"])) for r in pairs])
    if times:
        lines += ["", *target_note(times), ""]
        lines += md_table(["objective", "metric", "K", "correction", "target", "reached", "median steps",
                           "median loop s", "mean loop s of the run"],
                          [(r["objective"], r["metric"], _k(r), r["correction"], f"{r['target']:.4g}",
                            f"{r['reached']} of {r['n']}", "–" if r["steps"] is None else f"{r['steps']:.1f}",
                            "–" if r["seconds"] is None else f"{r['seconds']:.0f}", f"{r['loop_s']:.0f}")
                           for r in times])
    return lines


def series(front: list[dict]) -> dict:
    """What the frontier plot draws: (objective, metric) -> line -> [(K, mean, lo, hi)] in K order, lo and hi the
    mean where a cell has one seed (no interval); a line per correction, and one per correction of asynchronous
    rounds (`tis, async`) whose x is the lag L."""
    out: dict = {}
    for r in front:
        for metric in METRICS:
            y = r[metric]
            if y is None:
                continue
            lo, hi = (y["mean"], y["mean"]) if y["lo"] is None else (y["lo"], y["hi"])
            line, x = (r["correction"], r["K"]) if not r.get("L") else (f"{r['correction']}, async", r["L"])
            out.setdefault((r["objective"], metric), {}).setdefault(line, []).append((x, y["mean"], lo, hi))
    return {key: {corr: sorted(pts) for corr, pts in lines.items()} for key, lines in out.items()}


def plot(front: list[dict], path: Path, title: str) -> None:
    """Accuracy at the last step against K (log axis), one line per correction with its 95% t-interval, a row of
    greedy and sampled panels per objective."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = series(front)
    objectives = sorted({obj for obj, _ in drawn})
    fig, axes = plt.subplots(len(objectives), 2, figsize=(11, 4.2 * len(objectives)), squeeze=False)
    for row, obj in zip(axes, objectives):
        for ax, metric in zip(row, METRICS):
            lines = drawn.get((obj, metric), {})
            for i, corr in enumerate(_ordered(lines)):
                ks, mean, lo, hi = zip(*lines[corr])
                # a small horizontal offset per line keeps overlapping intervals readable
                xs = [k * 1.06 ** (i - (len(lines) - 1) / 2) for k in ks]
                ax.errorbar(xs, mean, yerr=[[m - x for m, x in zip(mean, lo)], [x - m for m, x in zip(mean, hi)]],
                            marker="o" if ", async" not in corr else "s", capsize=3, label=corr,
                            color=f"C{ORDER.index(corr.split(',')[0]) if corr.split(',')[0] in ORDER else i}")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("K = optimizer steps per generation (1 = online)" + (
                "; async lines: L = rounds of lag" if any(", async" in line for line in lines) else ""))
            ax.set_ylabel(f"{metric} accuracy at the last step")
            ax.set_title(f"{obj}, {metric}" if len(objectives) > 1 else metric, fontsize=9)
            ax.grid(alpha=0.3)
            if lines:
                ax.legend(fontsize=7)
    fig.suptitle(f"{title} (mean over seeds, 95% t-interval)")
    save_figure(fig, path, dpi=120)


def _load(source: Path) -> pd.DataFrame:
    """A sweep dir's runs, or a study CSV's rebuilt in a temporary folder."""
    if source.is_dir():
        return load(source)
    with tempfile.TemporaryDirectory(prefix="corrections-csv-") as tmp:
        return load(materialise(source, Path(tmp) / source.stem))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m humanline_cli.lab.corrections_frontier",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path, help="a sweep over data.generate_every x correction, or its study CSV "
                                          "(humanline report DIR --export-csv FILE)")
    p.add_argument("--out", type=Path, default=Path("corrections.png"), help="the PNG to write")
    p.add_argument("--title", default="the corrections frontier", help="the plot's title")
    a = p.parse_args(argv)
    if not a.dir.exists():
        print(f"corrections_frontier: error: {a.dir}: no such directory or study CSV", file=sys.stderr)
        return 2
    try:
        runs = _load(a.dir)
    except UserError as e:
        print(f"corrections_frontier: error: {e}", file=sys.stderr)
        return 2
    c = cells(runs) if not runs.empty else runs
    if c.empty:
        print(f"corrections_frontier: error: {a.dir}: no complete run", file=sys.stderr)
        return 2
    front = frontier_rows(c)
    print("\n".join(markdown(front, paired_rows(c), [*time_rows(c, "greedy"), *time_rows(c, "sampled")])))
    plot(front, a.out, a.title)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
