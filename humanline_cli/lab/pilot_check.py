"""The registered fair-pilot rule read off its study CSV (docs/results.md, "Registered: the fair SmolLM2 pilot and
study"), so the decision is mechanical and anyone can recompute it:

1. the start: the mean greedy start over the pilot seeds must lie in [0.3, 0.6];
2. the tuned lr: the grid lr with the highest mean greedy accuracy of plain online at the last step over the seeds
   (a tie goes to the lr listed first, the smallest);
3. the manipulation check: tuned online - stale_once, greedy at the last step, paired by seed, passes when its mean
   is at least 0.10 and its 95% t-interval lies above 0 (sampled beside it, deciding nothing);
4. the study's seed count: the fewest (at least 10) with 80% power for the paired TOST at margin 0.05, at the larger
   of the check's paired SD and 0.06.

The rule decides once the cells it reads have complete runs: plain online at every lr and seed (the tuned lr), then
stale_once at the tuned lr on every seed; until then each step says what it lacks. stale_once at the other lrs is
reported and decides nothing.

    python -m humanline_cli.lab.pilot_check humanline_cli/docs/studies/smollm2_fair_pilot.csv
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

from humanline_cli.errors import UserError
from humanline_cli.lab.power import tost_seeds
from humanline_cli.mdtable import md_table
from humanline_cli.report.stats import mean_ci, paired_by_seed
from humanline_cli.report.study_csv import read_table

START = (0.3, 0.6)
MIN_GAP = 0.10
MARGIN, SD_FLOOR = 0.05, 0.06
METRICS = ("greedy", "sampled")
NEEDED = ("status", "regime", "seed", "config", "greedy_final", "sampled_final", "greedy_start")


def cells(csv: pd.DataFrame) -> pd.DataFrame:
    """Complete runs: lr (the config's train.lr), regime, seed and the start and final accuracies."""
    runs = csv[csv.status == "complete"]
    lr = [json.loads(c).get("train.lr") if c else None for c in runs.config]
    number = {k: pd.to_numeric(runs[col]).to_numpy() for k, col in
              (("greedy_start", "greedy_start"), ("greedy", "greedy_final"), ("sampled", "sampled_final"))}
    return pd.DataFrame({"lr": lr, "regime": runs.regime.to_numpy(), "seed": runs.seed.astype(int).to_numpy(),
                         **number})


def decide(c: pd.DataFrame, lrs: list[float], seeds: list[int]) -> dict:
    """The rule's four steps on complete runs `c` over the registered grid; each step's numbers, and `verdict`:
    pass, fail, or incomplete (with what is missing)."""
    have = {(r.lr, r.regime, r.seed) for r in c.itertuples()}
    missing = [(lr, reg, s) for lr in lrs for reg in ("online", "stale_once") for s in seeds
               if (lr, reg, s) not in have]
    starts = c.drop_duplicates("seed").set_index("seed").greedy_start
    start = mean_ci(starts[starts.index.isin(seeds)])
    online = {lr: {m: mean_ci(c[(c.lr == lr) & (c.regime == "online") & c.seed.isin(seeds)][m]) for m in METRICS}
              for lr in lrs}
    out = {"start": start, "online": online, "missing": missing, "tuned_lr": None, "check": None, "seeds_needed": None}
    if start is not None and not START[0] <= start["mean"] <= START[1] and start["n"] == len(seeds):
        return {**out, "verdict": f"fail: the mean greedy start {start['mean']:.4f} lies outside {list(START)}"}
    if any(reg == "online" for _, reg, _ in missing):  # the tuned lr needs every online cell
        return {**out, "verdict": f"incomplete: {len(missing)} of {len(lrs) * 2 * len(seeds)} runs missing"}
    tuned = max(lrs, key=lambda lr: online[lr]["greedy"]["mean"])
    at = c[(c.lr == tuned) & c.seed.isin(seeds)]
    check = {m: paired_by_seed(*(at[at.regime == reg].set_index("seed")[m] for reg in ("online", "stale_once")))
             for m in METRICS}
    out = {**out, "tuned_lr": tuned, "check": check}
    g = check["greedy"]
    if g is None or g["n"] < len(seeds):
        return {**out, "verdict": f"incomplete: stale_once at the tuned lr {tuned:g} lacks seeds"}
    sd = float(pd.Series(g["diffs"]).std(ddof=1))
    out["sd"], out["seeds_needed"] = sd, tost_seeds(max(sd, SD_FLOOR), MARGIN)
    passed = g["mean"] >= MIN_GAP and g["lo"] > 0
    return {**out, "verdict": ("pass" if passed else "fail") + f": tuned online - stale_once {g['mean']:+.4f} greedy, "
            f"95% t-interval [{g['lo']:+.4f}, {g['hi']:+.4f}] (needs >= {MIN_GAP} and above 0)"}


def _ci(d: dict | None) -> str:
    if d is None:
        return "–"
    return f"{d['mean']:.4f}" + ("" if d["lo"] is None else f" [{d['lo']:.4f}, {d['hi']:.4f}]") + f" (n={d['n']})"


def markdown(r: dict) -> list[str]:
    lines = [f"start (greedy, mean over the pilot seeds): {_ci(r['start'])}, registered range {list(START)}", ""]
    lines += md_table(["lr", "online greedy at the last step", "online sampled"],
                      [(f"{lr:g}", _ci(v["greedy"]), _ci(v["sampled"])) for lr, v in r["online"].items()])
    if r["check"]:
        lines += ["", f"tuned lr: {r['tuned_lr']:g}; online - stale_once paired by seed at it:", ""]
        lines += md_table(["metric", "seeds", "differences", "mean [95% t-interval]"],
                          [(m, ", ".join(map(str, d["seeds"])), ", ".join(f"{x:+.4f}" for x in d["diffs"]), _ci(d))
                           for m, d in r["check"].items() if d is not None])
    if r["seeds_needed"]:
        lines += ["", f"paired greedy SD {r['sd']:.4f}; the study's seeds at SD max({r['sd']:.4f}, {SD_FLOOR}) and "
                  f"margin {MARGIN}: {r['seeds_needed']}"]
    if r["missing"]:
        lines += ["", "missing: " + ", ".join(f"lr {lr:g} {reg} seed {s}" for lr, reg, s in r["missing"])]
    return [*lines, "", f"verdict: {r['verdict']}"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m humanline_cli.lab.pilot_check", description=__doc__.split("\n\n")[0])
    p.add_argument("csv", type=Path, help="the pilot's study CSV (humanline report DIR --export-csv FILE)")
    p.add_argument("--lrs", default="3e-6,1e-5,3e-5", help="the registered lr grid")
    p.add_argument("--seeds", default="100,101,102", help="the pilot seeds")
    a = p.parse_args(argv)
    try:
        lrs, seeds = [float(x) for x in a.lrs.split(",")], [int(x) for x in a.seeds.split(",")]
    except ValueError as e:
        print(f"pilot_check: error: --lrs/--seeds: {e}", file=sys.stderr)
        return 2
    try:
        csv = read_table(a.csv, NEEDED)
    except UserError as e:
        print(f"pilot_check: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(markdown(decide(cells(csv), lrs, seeds))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
