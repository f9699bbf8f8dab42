"""The corrections frontier (docs/results.md, "Registered: humanline against the staleness corrections"): per
(objective, K = data.generate_every, correction) the last step's greedy and sampled accuracy with 95% t-intervals
over seeds; paired differences between corrections at each K (by seed: the mean, its 95% t-interval and the
two-sided paired-t p); the steps and the loop seconds (report/frame.loop_seconds: setup, evaluation and saving left
out) to a target per cell; and the frontier plot (accuracy at the last step against K, one line per correction).

The target is the report's matched-quality rule (report/gap_closed.gain_target) on the K=1 `none` runs (plain
online) of the same objective: start + 0.9 x (their mean final - start), from their learning curves (the start,
every evaluation, linear between); a seed that never reaches it is censored at its end (Kaplan-Meier median).

    python -m humanline_cli.lab.corrections_frontier runs/experiments/laptop_corrections_frontier --out corrections.png
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from humanline_cli.mdtable import md_table
from humanline_cli.report.frame import ci_text, column, curve, load, loop_seconds, run_points
from humanline_cli.report.gap_closed import gain_target, km_to
from humanline_cli.report.plots import save_figure
from humanline_cli.report.stats import mean_ci, paired_t

METRICS = {"greedy": "eval.greedy.accuracy", "sampled": "eval.sampled.accuracy"}
CURVES = {"greedy": "greedy accuracy", "sampled": "sampled accuracy"}  # report/frame.CURVE's names
ORDER = ("none", "humanline", "tis", "mis", "decoupled", "trdpo")
# the contrasts printed at every K: the registered primary's first, then each correction against none
CONTRASTS = (("humanline", "tis"), ("humanline", "none"), ("tis", "none"), ("decoupled", "none"),
             ("humanline", "decoupled"), ("trdpo", "none"), ("humanline", "trdpo"))


def cells(runs: pd.DataFrame) -> pd.DataFrame:
    """Complete runs with objective, K, correction (humanline=true counts as humanline), seed and the last step's
    greedy and sampled accuracy."""
    runs = runs[runs.status == "complete"]
    kind = runs["cfg.correction.kind"] if "cfg.correction.kind" in runs else pd.Series(None, index=runs.index)
    kind = [("humanline" if h else "none") if k is None or k != k else str(k) for k, h in zip(kind, runs.humanline)]
    return runs.assign(K=column(runs, "cfg.data.generate_every").fillna(1).astype(int), correction=kind,
                       **{m: column(runs, key) for m, key in METRICS.items()})


def _ordered(values) -> list[str]:
    return sorted(set(values), key=lambda c: (ORDER.index(c) if c in ORDER else len(ORDER), c))


def frontier_rows(c: pd.DataFrame) -> list[dict]:
    """One row per (objective, K, correction): seeds and each metric's mean and 95% t-interval."""
    out = []
    for (obj, k), g in c.groupby(["objective", "K"], sort=True):
        for corr in _ordered(g.correction):
            rs = g[g.correction == corr]
            out.append({"objective": obj, "K": k, "correction": corr, "n": len(rs),
                        **{m: mean_ci(rs[m].dropna().astype(float)) for m in METRICS}})
    return out


def paired(c: pd.DataFrame, objective: str, k: int, a: str, b: str, metric: str) -> dict | None:
    """a - b at K, paired by seed (the seeds both have): paired_t's mean, interval and differences, and the
    two-sided p of the paired t-test (None with fewer than 2 pairs or all differences equal)."""
    from scipy import stats

    g = c[(c.objective == objective) & (k == c.K)]
    x, y = (g[g.correction == name].set_index("seed")[metric].dropna() for name in (a, b))
    seeds = sorted(set(x.index) & set(y.index), key=str)
    if not seeds:
        return None
    t = paired_t([x[s] for s in seeds], [y[s] for s in seeds])
    diffs = pd.Series(t["diffs"])
    p = float(stats.ttest_1samp(diffs, 0.0).pvalue) if len(diffs) > 1 and diffs.std() > 0 else None
    return {**t, "p": p, "seeds": seeds}


def paired_rows(c: pd.DataFrame) -> list[dict]:
    rows = []
    for (obj, k), g in c.groupby(["objective", "K"], sort=True):
        have = set(g.correction)
        for a, b in CONTRASTS:
            for m in METRICS:
                d = paired(c, obj, k, a, b, m) if {a, b} <= have else None
                if d is not None:
                    rows.append({"objective": obj, "K": k, "contrast": f"{a} - {b}", "metric": m, **d})
    return rows


def time_rows(c: pd.DataFrame, metric: str = "greedy") -> list[dict]:
    """Per (objective, K, correction): the target, how many seeds reached it, the Kaplan-Meier medians of steps
    and of loop seconds to it, and the mean loop seconds of the whole run."""
    rows = []
    for obj, g in c.groupby("objective", sort=True):
        pts = {i: run_points(r["summary"], r["metrics"]) for i, r in g.iterrows()}
        steps = {i: curve(p, CURVES[metric], "step") for i, p in pts.items()}
        secs = {i: curve(p, CURVES[metric], "loop_s") for i, p in pts.items()}
        online = [steps[i] for i in g[(g.K == 1) & (g.correction == "none")].index if steps[i]]
        if not online:
            continue
        target = gain_target(online)[2]
        for (k, corr), rs in sorted(g.groupby(["K", "correction"]), key=lambda kv: (kv[0][0], _ordered(
                g.correction).index(kv[0][1]))):
            st, se = km_to([steps[i] for i in rs.index], target), km_to([secs[i] for i in rs.index], target)
            rows.append({"objective": obj, "K": k, "correction": corr, "target": target, "reached": st["reached"],
                         "n": st["n"], "steps": st["median"], "seconds": se["median"],
                         "loop_s": float(rs["summary"].map(loop_seconds).mean())})
    return rows


def _p(p: float | None) -> str:
    return "–" if p is None else f"{p:.2g}" if p >= 1e-4 else f"{p:.1e}"


def markdown(front: list[dict], pairs: list[dict], times: list[dict]) -> list[str]:
    lines = ["Last step, mean [95% t-interval over seeds]:", ""]
    lines += md_table(["objective", "K", "correction", "seeds", "greedy", "sampled"],
                      [(r["objective"], r["K"], r["correction"], r["n"], ci_text(r["greedy"]), ci_text(r["sampled"]))
                       for r in front])
    lines += ["", "Paired by seed, a - b, mean [95% t-interval], two-sided paired-t p:", ""]
    lines += md_table(["objective", "K", "contrast", "metric", "seeds", "difference", "p"],
                      [(r["objective"], r["K"], r["contrast"], r["metric"], len(r["seeds"]), ci_text(r, "+.3f"),
                        _p(r["p"])) for r in pairs])
    if times:
        lines += ["", f"Time to the target (greedy {times[0]['target']:.4g}: start + 0.9 x plain online's mean gain), "
                      "Kaplan-Meier median over seeds (–: fewer than half reached it):", ""]
        lines += md_table(["objective", "K", "correction", "reached", "median steps", "median loop s",
                           "mean loop s of the run"],
                          [(r["objective"], r["K"], r["correction"], f"{r['reached']} of {r['n']}",
                            "–" if r["steps"] is None else f"{r['steps']:.1f}",
                            "–" if r["seconds"] is None else f"{r['seconds']:.0f}", f"{r['loop_s']:.0f}")
                           for r in times])
    return lines


def plot(front: list[dict], path: Path, title: str) -> None:
    """Accuracy at the last step against K, one line per (objective,) correction, greedy and sampled panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    objectives = sorted({r["objective"] for r in front})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=False)
    for ax, metric in zip(axes, METRICS):
        for i, (obj, corr) in enumerate(dict.fromkeys((r["objective"], r["correction"]) for r in front)):
            rs = [r for r in front if (r["objective"], r["correction"]) == (obj, corr) and r[metric]]
            ys = [r[metric] for r in rs]
            err = [[y["mean"] - (y["lo"] if y["lo"] is not None else y["mean"]) for y in ys],
                   [(y["hi"] if y["hi"] is not None else y["mean"]) - y["mean"] for y in ys]]
            # a small horizontal offset per line keeps overlapping intervals readable
            xs = [r["K"] * 1.06 ** (i - 1.5) for r in rs]
            ax.errorbar(xs, [y["mean"] for y in ys], yerr=err, marker="o", capsize=3, color=f"C{i}",
                        label=corr if len(objectives) == 1 else f"{obj}, {corr}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("K = optimizer steps per generation (1 = online)")
        ax.set_ylabel(f"{metric} accuracy at the last step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{title} (mean over seeds, 95% t-interval)")
    save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m humanline_cli.lab.corrections_frontier",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path, help="a sweep over data.generate_every x correction")
    p.add_argument("--out", type=Path, default=Path("corrections.png"), help="the PNG to write")
    p.add_argument("--title", default="the corrections frontier", help="the plot's title")
    a = p.parse_args(argv)
    if not a.dir.is_dir():
        print(f"corrections_frontier: error: {a.dir}: no such directory", file=sys.stderr)
        return 2
    runs = load(a.dir)
    c = cells(runs) if not runs.empty else runs
    if c.empty:
        print(f"corrections_frontier: error: {a.dir}: no complete run", file=sys.stderr)
        return 2
    front = frontier_rows(c)
    print("\n".join(markdown(front, paired_rows(c), time_rows(c))))
    plot(front, a.out, a.title)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
