"""The regime map: gap closed by humanline-offline across several studies, one figure and one table.

Each study is a `humanline report` output dir (its gap_closed.csv); a label names the regime:

    python -m humanline_cli.regime_map --out map.png "pairs (rule)=runs/pairs" "groups of 8=runs/g8" ...

Prints a markdown table (regime, objective, offline / online / humanline-offline, gap closed with its
interval, seeds, speedups) and writes a bar chart of gap closed per regime and objective (PNG).
"""
from __future__ import annotations

import argparse
import csv
import sys
import textwrap
from pathlib import Path


def load(studies: list[tuple[str, Path]]) -> list[dict]:
    rows = []
    for label, path in studies:
        f = path / "gap_closed.csv" if path.is_dir() else path
        if not f.is_file():
            raise FileNotFoundError(f"{f}: no gap_closed.csv (run `humanline report {path}` first)")
        with open(f, newline="") as fh:
            rows += [{**r, "regime": label} for r in csv.DictReader(fh)]
    return rows


def _num(x: str) -> float | None:
    return float(x) if x not in ("", None) else None


def markdown(rows: list[dict]) -> list[str]:
    out = ["| regime | objective | metric | offline | online | humanline-offline | gap closed | seeds "
           "| speedup (equal steps) | at equal quality |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g, lo, hi = _num(r["gap_closed"]), _num(r["gap_closed_lo"]), _num(r["gap_closed_hi"])
        gap = "–" if g is None else f"{g:.0%}" + (f" [{lo:.0%}, {hi:.0%}]" if lo is not None else "")
        eq = _num(r.get("speedup_equal_quality", ""))
        sp = _num(r["speedup"])
        out.append(f"| {r['regime']} | {r['objective']} | {r['metric']} | {float(r['offline']):.3f} | "
                   f"{float(r['online']):.3f} | {float(r['humanline_offline']):.3f} | {gap} | {r['n_seeds']} | "
                   f"{'n/a' if sp is None else f'{sp:.2f}x'} | {'n/a' if eq is None else f'{eq:.2f}x'} |")
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if _num(r["gap_closed"]) is not None]
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(rows) + 2), 4.2))
    means = [_num(r["gap_closed"]) for r in rows]
    lo = [m - (_num(r["gap_closed_lo"]) if _num(r["gap_closed_lo"]) is not None else m) for m, r in zip(means, rows)]
    hi = [(_num(r["gap_closed_hi"]) if _num(r["gap_closed_hi"]) is not None else m) - m for m, r in zip(means, rows)]
    colors = {"dpo": "#4c72b0", "kto": "#55a868", "grpo": "#c44e52"}
    ax.bar(range(len(rows)), means, yerr=[lo, hi], capsize=4, color=[colors.get(r["objective"], "grey") for r in rows])
    ax.axhline(0, color="black", lw=0.8)
    ax.axhline(1, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r['objective']}\n" + "\n".join(textwrap.wrap(r["regime"], 16)) for r in rows], fontsize=7)
    ax.set_ylabel("gap closed by humanline-offline")
    ax.set_title("(humanline-offline - offline) / (online - offline), 95% CI over seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m humanline_cli.regime_map", description=__doc__.split("\n\n")[0])
    p.add_argument("studies", nargs="+", help="LABEL=DIR: a regime's label and its `humanline report` dir")
    p.add_argument("--out", default="regime_map.png", help="the PNG to write")
    a = p.parse_args(argv)
    studies = []
    for s in a.studies:
        label, eq, path = s.partition("=")
        if not eq:
            print(f"regime_map: error: {s!r} is not LABEL=DIR", file=sys.stderr)
            return 2
        studies.append((label, Path(path)))
    try:
        rows = load(studies)
    except FileNotFoundError as e:
        print(f"regime_map: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(markdown(rows)))
    plot(rows, Path(a.out))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
