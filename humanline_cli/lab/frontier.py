"""The staleness frontier: final accuracy against measured drift from the sampler, humanline off and on.

Each run sits at its mean logged `drift/kl` (KL(sampler || policy) per trained token), an axis that does not
depend on lr or steps per round; runs pool over seeds per (objective, K = data.generate_every, humanline).

    python -m humanline_cli.lab.frontier runs/experiments/laptop_headroom_frontier --out frontier.png
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from humanline_cli.mdtable import md_table
from humanline_cli.report.frame import ci_text, column, load
from humanline_cli.report.plots import save_figure
from humanline_cli.report.stats import mean_ci

DRIFT_FLOOR = 1e-5  # on-policy drift is float round-off: drawn at this floor, labelled "~0"
STATS = ("drift_kl", "drift_logratio", "greedy", "sampled")


def run_drift(metrics: list[dict], key: str = "drift/kl") -> float | None:
    """Mean of `key` over a run's logged rows; None when it logged none (offline data)."""
    vals = pd.to_numeric(pd.Series([r.get(key) for r in metrics], dtype=object), errors="coerce").dropna()
    return float(vals.mean()) if len(vals) else None


def frontier_rows(runs: pd.DataFrame) -> list[dict]:
    """One row per (objective, K, humanline) over complete runs that logged drift."""
    runs = runs.assign(drift_kl=runs["metrics"].map(run_drift),
                       drift_logratio=runs["metrics"].map(lambda m: run_drift(m, "drift/logratio_mean")),
                       greedy=column(runs, "eval.greedy.accuracy"), sampled=column(runs, "eval.accuracy"),
                       K=column(runs, "cfg.data.generate_every").fillna(0).astype(int))
    runs = runs[(runs.status == "complete") & runs.drift_kl.notna()]
    return [{"objective": o, "K": k, "humanline": bool(hl), "n": len(rs),
             **{c: mean_ci(rs[c].dropna().astype(float)) for c in STATS}}
            for (o, k, hl), rs in runs.groupby(["objective", "K", "humanline"], sort=True)]


def markdown(rows: list[dict]) -> list[str]:
    return md_table(["objective", "K", "humanline", "seeds", "drift KL (nats/token)", "drift log-ratio", "greedy",
                     "sampled"],
                    [(r["objective"], r["K"] or "online", "on" if r["humanline"] else "off", r["n"],
                      *(ci_text(r[c], f) for c, f in zip(STATS, (".2e", "+.4f", ".3f", ".3f")))) for r in rows])


def plot(rows: list[dict], path: Path, metric: str = "greedy") -> None:
    """Accuracy against K as set, and against the drift each run measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_k, by_drift) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    df = pd.DataFrame([r for r in rows if r[metric]])
    df = df.assign(k=df.K.replace(0, 1), drift=[max(d["mean"], DRIFT_FLOOR) for d in df.drift_kl],
                   y=[m["mean"] for m in df[metric]],
                   lo=[m["mean"] - (m["lo"] if m["lo"] is not None else m["mean"]) for m in df[metric]],
                   hi=[(m["hi"] if m["hi"] is not None else m["mean"]) - m["mean"] for m in df[metric]])
    for i, ((objective, hl), g) in enumerate(df.groupby(["objective", "humanline"])):
        for ax, x in ((by_k, "k"), (by_drift, "drift")):
            g = g.sort_values(x)
            ax.errorbar(g[x], g.y, yerr=[g.lo, g.hi], marker="o", capsize=3, color=f"C{i}",
                        label=f"{objective}, humanline {'on' if hl else 'off'}")
        for r in g.itertuples():
            ax.annotate(("online" if r.K == 0 else f"K={r.K}") + (" (~0)" if r.drift_kl["mean"] < DRIFT_FLOOR else ""),
                        (r.drift, r.y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    by_k.set_xscale("log", base=2)
    by_k.set_xlabel("K = optimizer steps per generation (1 = online)")
    by_k.set_ylabel(f"{metric} accuracy at the last step")
    by_drift.set_xscale("log")
    by_drift.set_xlabel("measured drift: KL(sampler || policy) per trained token (nats)")
    for ax in (by_k, by_drift):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle("staleness frontier (mean over seeds, 95% t-interval)")
    save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m humanline_cli.lab.frontier", description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path, help="a sweep over data.generate_every (and humanline)")
    p.add_argument("--out", type=Path, default=Path("frontier.png"), help="the PNG to write")
    a = p.parse_args(argv)
    if not a.dir.is_dir():
        print(f"frontier: error: {a.dir}: no such directory", file=sys.stderr)
        return 2
    runs = load(a.dir)
    rows = frontier_rows(runs) if not runs.empty else []
    if not rows:
        print(f"frontier: error: {a.dir}: no complete run logged drift/kl (online data only)", file=sys.stderr)
        return 2
    print("\n".join(markdown(rows)))
    plot(rows, a.out)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
