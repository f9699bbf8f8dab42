"""The regime map: gap closed by humanline-offline across several studies, one figure and one table.

Studies are `humanline report` dirs (LABEL=DIR), or one sweep over named regimes (`--sweep DIR`, conf/regime/)
where each humanline regime is compared with the `baseline` and `target` its regime_meta declares (report/regimes.py).

    python -m humanline_cli.lab.regime_map --sweep runs/experiments/laptop_regimes --out map.png
"""
from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

import pandas as pd

from humanline_cli.core.objectives import PROPERTIES
from humanline_cli.mdtable import md_table
from humanline_cli.report.frame import load, write_csv
from humanline_cli.report.gap_closed import DIGITS, GAP_HEAD, bar, bar_chart, gap_cells, gap_frame, gap_rows
from humanline_cli.report.groups import collapse_duplicates, label
from humanline_cli.report.regimes import regime_gap_rows, with_regimes


def load_studies(studies: list[tuple[str, Path]]) -> pd.DataFrame:
    frames = []
    for name, path in studies:
        f = path / "gap_closed.csv" if path.is_dir() else path
        if not f.is_file():
            raise FileNotFoundError(f"{f}: no gap_closed.csv (run `humanline report {path}` first)")
        frames.append(pd.read_csv(f, dtype=str, keep_default_na=False).assign(regime=name))
    return pd.concat(frames, ignore_index=True)


def sweep_rows(root: Path) -> pd.DataFrame:
    """Gap-closed rows (`regime`, `compared_with`, then gap_closed.csv's columns) of one regime sweep."""
    runs = load(root)
    complete = collapse_duplicates(runs[runs.status == "complete"])[0] if len(runs) else runs  # a copy is no seed
    rows = regime_gap_rows(with_regimes(label(complete)[0])) if len(complete) else gap_rows(complete)
    return pd.concat([rows[["regime", "compared_with"]], gap_frame(rows)], axis=1)


def markdown(rows) -> list[str]:
    rows = rows.to_dict("records") if isinstance(rows, pd.DataFrame) else rows
    return md_table(["regime", "objective", *GAP_HEAD, "speedup (equal steps)", "at equal quality",
                     "online sampling (bound)"],
                    [(r["regime"] + (f" (vs {v})" if (v := r.get("compared_with")) and v != "offline, online" else ""),
                      r["objective"], *gap_cells(r)) for r in rows])


def plot(table: pd.DataFrame, path: Path) -> None:
    """One bar per regime, grouped and coloured by objective in PROPERTIES order."""
    rank = {o: i for i, o in enumerate(PROPERTIES)}
    rows = sorted((r for r in table.to_dict("records") if bar(r)[0] is not None),
                  key=lambda r: rank.get(r["objective"], len(rank)))
    bar_chart([f"{r['objective']}\n" + "\n".join(textwrap.wrap(r["regime"], 16)) for r in rows], [bar(r) for r in rows],
              path, [f"C{rank[r['objective']]}" if r["objective"] in rank else "grey" for r in rows])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m humanline_cli.lab.regime_map", description=__doc__.split("\n\n")[0])
    p.add_argument("studies", nargs="*", help="LABEL=DIR: a regime's label and its `humanline report` dir")
    p.add_argument("--sweep", help="one sweep over named regimes (regime=...), e.g. runs/experiments/laptop_regimes")
    p.add_argument("--out", default="regime_map.png", help="the PNG to write (and, with --sweep, a CSV next to it)")
    a = p.parse_args(argv)
    out = Path(a.out)
    try:
        if a.sweep:
            if not Path(a.sweep).is_dir():
                raise ValueError(f"{Path(a.sweep)}: no such directory")
            rows = sweep_rows(Path(a.sweep))
            if rows.empty:
                raise ValueError(f"{Path(a.sweep)}: no humanline-offline regime with its offline and online runs complete")
        elif not a.studies:
            raise ValueError("give LABEL=DIR studies or --sweep DIR")
        else:
            bad = [s for s in a.studies if "=" not in s]
            if bad:
                raise ValueError(f"{bad[0]!r} is not LABEL=DIR")
            rows = load_studies([(lab, Path(d)) for lab, _, d in (s.partition("=") for s in a.studies)])
    except (ValueError, FileNotFoundError) as e:
        print(f"regime_map: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(markdown(rows)))
    plot(rows, out)
    if a.sweep:  # a sweep's rows are new: written beside the figure
        write_csv(rows, out.with_suffix(".csv"), DIGITS)
    print(f"wrote {out}" + (f" and {out.with_suffix('.csv')}" if a.sweep else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
