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
           "| speedup (equal steps) | at equal quality | online sampling (bound) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g, lo, hi = _num(r["gap_closed"]), _num(r["gap_closed_lo"]), _num(r["gap_closed_hi"])
        gap = "–" if g is None else f"{g:.0%}" + (f" [{lo:.0%}, {hi:.0%}]" if lo is not None else "")
        eq = _num(r.get("speedup_equal_quality", ""))
        sp = _num(r["speedup"])
        share, bound = _num(r.get("online_sampling_share", "")), _num(r.get("speedup_bound_matched", ""))
        sampling = "n/a" if share is None or bound is None else f"{share:.0%} ({bound:.2f}x)"
        out.append(f"| {r['regime']} | {r['objective']} | {r['metric']} | {float(r['offline']):.3f} | "
                   f"{float(r['online']):.3f} | {float(r['humanline_offline']):.3f} | {gap} | {r['n_seeds']} | "
                   f"{'n/a' if sp is None else f'{sp:.2f}x'} | {'n/a' if eq is None else f'{eq:.2f}x'} | {sampling} |")
    return out


def plot(rows: list[dict], path: Path) -> None:
    from .science import bar_chart

    rows = [r for r in rows if _num(r["gap_closed"]) is not None]
    colors = {"dpo": "#4c72b0", "kto": "#55a868", "grpo": "#c44e52"}
    bar_chart([f"{r['objective']}\n" + "\n".join(textwrap.wrap(r["regime"], 16)) for r in rows],
              [(_num(r["gap_closed"]), _num(r["gap_closed_lo"]), _num(r["gap_closed_hi"])) for r in rows], path,
              [colors.get(r["objective"], "grey") for r in rows])


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
