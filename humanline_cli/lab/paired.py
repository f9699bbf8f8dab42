"""a - b paired by seed between two arms of a study CSV that differ in one config key (e.g. backend.precision auto
against fp32): per metric, each seed's difference, the mean with its 95% t-interval, each arm's mean, and each arm's
mean wall-clock per phase over the same seeds. Complete runs only; a seed counts where both arms have it.

    python -m humanline_cli.lab.paired humanline_cli/docs/studies/smollm2_precision_check.csv \
        --by backend.precision --a auto --b fp32
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

from humanline_cli.errors import UserError
from humanline_cli.mdtable import md_table
from humanline_cli.report.stats import paired_by_seed
from humanline_cli.report.study_csv import read_table

METRICS = ("greedy_final", "sampled_final", "greedy_start", "sampled_start")
PHASES = ("setup", "sample", "train", "eval", "total")


def arms(csv: pd.DataFrame, by: str, a: str, b: str) -> dict[str, pd.DataFrame]:
    """Complete runs per arm (the config key's value as text), indexed by seed."""
    runs = csv[csv.status == "complete"]
    value = [str(json.loads(c).get(by)) if c else None for c in runs.config]
    return {name: runs[[v == name for v in value]].set_index("seed") for name in (a, b)}


def compare(csv: pd.DataFrame, by: str, a: str, b: str) -> dict:
    got = arms(csv, by, a, b)
    metrics = {m: paired_by_seed(pd.to_numeric(got[a][m]), pd.to_numeric(got[b][m])) for m in METRICS}
    seeds = (metrics["greedy_final"] or {}).get("seeds", [])
    clocks = {name: pd.DataFrame([json.loads(w) for w in g.loc[seeds].wall_clock_s]).reindex(columns=PHASES).mean()
              for name, g in got.items()}
    return {"metrics": metrics, "clocks": clocks, "n": {name: len(seeds) for name in got}}


def markdown(r: dict, a: str, b: str) -> list[str]:
    def ci(d):
        return "–" if d["lo"] is None else f"[{d['lo']:+.4f}, {d['hi']:+.4f}]"

    rows = [(m, ", ".join(map(str, d["seeds"])), ", ".join(f"{x:+.4f}" for x in d["diffs"]), f"{d['a_mean']:.4f}",
             f"{d['b_mean']:.4f}", f"{d['mean']:+.4f}", ci(d)) for m, d in r["metrics"].items() if d is not None]
    lines = md_table(["metric", "seeds", f"{a} - {b} per seed", a, b, "mean", "95% t-interval"], rows)
    lines += ["", *md_table(["arm", "runs", *(f"{p} s" for p in PHASES)],
                            [(name, r["n"][name], *(f"{v:.0f}" for v in c)) for name, c in r["clocks"].items()])]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m humanline_cli.lab.paired", description=__doc__.split("\n\n")[0])
    p.add_argument("csv", type=Path, help="a study CSV (humanline report DIR --export-csv FILE)")
    p.add_argument("--by", required=True, help="the config key the two arms differ in")
    p.add_argument("--a", required=True, help="its value in arm a")
    p.add_argument("--b", required=True, help="its value in arm b")
    args = p.parse_args(argv)
    try:
        csv = read_table(args.csv, ("status", "seed", "config", "wall_clock_s", *METRICS))
    except UserError as e:
        print(f"paired: error: {e}", file=sys.stderr)
        return 2
    r = compare(csv, args.by, args.a, args.b)
    if all(d is None for d in r["metrics"].values()):
        print(f"paired: error: no seed has a complete run with {args.by}={args.a} and one with {args.b}",
              file=sys.stderr)
        return 2
    print("\n".join(markdown(r, args.a, args.b)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
