"""The staleness frontier: final accuracy against measured drift from the sampler, humanline off and on.

Each stale-K run (data.generate_every=K; online without it is K = its own round length) is placed at its
measured drift, the mean over its logged steps of `drift/kl` (the k3 estimate of KL(sampler || policy) on the
trained tokens, objectives.sampler_drift), so the axis does not depend on lr or steps per round and transfers
to other settings (the authors' K=64 at lr 1e-6 sits where its drift does). Runs are pooled over seeds per
(objective, K, humanline): mean and 95% t-interval of the greedy and sampled accuracy and of the drift.

    python -m humanline_cli.report.frontier runs/experiments/laptop_headroom_frontier --out frontier.png
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import pandas as pd

from humanline_cli.report.frame import ci_text, column, load, md_table
from humanline_cli.report.stats import mean_ci


def run_drift(metrics: list[dict], key: str = "drift/kl") -> float | None:
    """Mean of `key` over a run's logged train rows; None when the run logged none (offline data)."""
    vals = [float(r[key]) for r in metrics if key in r]
    return statistics.fmean(vals) if vals else None


def frontier_rows(runs: pd.DataFrame) -> list[dict]:
    """One row per (objective, K, humanline) over complete runs that logged drift."""
    runs = runs.assign(drift_kl=runs["metrics"].map(run_drift),
                       drift_logratio=runs["metrics"].map(lambda m: run_drift(m, "drift/logratio_mean")),
                       greedy=column(runs, "eval.greedy.accuracy"), sampled=column(runs, "eval.accuracy"),
                       K=column(runs, "cfg.data.generate_every").fillna(0).astype(int))
    runs = runs[(runs.status == "complete") & runs.drift_kl.notna()]
    return [{"objective": objective, "K": k, "humanline": bool(hl), "n": len(rs),
             **{c: mean_ci(rs[c].dropna().astype(float)) for c in ("drift_kl", "drift_logratio", "greedy", "sampled")}}
            for (objective, k, hl), rs in runs.groupby(["objective", "K", "humanline"], sort=True)]


def markdown(rows: list[dict]) -> list[str]:
    return md_table(["objective", "K", "humanline", "seeds", "drift KL (nats/token)", "drift log-ratio", "greedy",
                     "sampled"],
                    [(r["objective"], "online" if r["K"] == 0 else r["K"], "on" if r["humanline"] else "off", r["n"],
                      ci_text(r["drift_kl"], ".2e"), ci_text(r["drift_logratio"], "+.4f"), ci_text(r["greedy"]),
                      ci_text(r["sampled"])) for r in rows])


DRIFT_FLOOR = 1e-5  # on-policy drift is float round-off (|KL| < 1e-8): drawn at this floor, labelled "~0"


def plot(rows: list[dict], path: Path, metric: str = "greedy") -> None:
    """Two panels: accuracy against K as set (data.generate_every), and against the drift each run measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_k, by_drift) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for (objective, hl), color in zip(sorted({(r["objective"], r["humanline"]) for r in rows}),
                                      ("#c44e52", "#4c72b0", "#55a868", "#8172b2", "#ccb974", "#64b5cd")):
        label = f"{objective}, humanline {'on' if hl else 'off'}"
        mine = [r for r in rows if (r["objective"], r["humanline"]) == (objective, hl) and r[metric]]
        for ax, key in ((by_k, lambda r: r["K"] or 1), (by_drift, lambda r: max(r["drift_kl"]["mean"], DRIFT_FLOOR))):
            pts = sorted(mine, key=key)
            xs = [key(r) for r in pts]
            ys = [r[metric]["mean"] for r in pts]
            err = [[y - (r[metric]["lo"] if r[metric]["lo"] is not None else y) for y, r in zip(ys, pts)],
                   [(r[metric]["hi"] if r[metric]["hi"] is not None else y) - y for y, r in zip(ys, pts)]]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, color=color, label=label)
            if ax is by_drift:
                for x, y, r in zip(xs, ys, pts):
                    k = "online" if r["K"] == 0 else f"K={r['K']}"
                    ax.annotate(k + (" (~0)" if r["drift_kl"]["mean"] < DRIFT_FLOOR else ""), (x, y), fontsize=7,
                                xytext=(3, 3), textcoords="offset points")
    by_k.set_xscale("log", base=2)
    by_k.set_xlabel("K = optimizer steps per generation (1 = online)")
    by_k.set_ylabel(f"{metric} accuracy at the last step")
    by_drift.set_xscale("log")
    by_drift.set_xlabel("measured drift: KL(sampler || policy) per trained token (nats)")
    for ax in (by_k, by_drift):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle("staleness frontier (mean over seeds, 95% t-interval)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m humanline_cli.report.frontier", description=__doc__.split("\n\n")[0])
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
