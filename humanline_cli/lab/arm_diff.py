"""Two runs of one seed compared step by step: which logged training numbers differ (clocks and throughput aside),
at which steps, and where the humanline band clamped tokens (`humanline/unclamped_fraction` below 1). It is how
results.md's sync-1 observation is read off each new seed: the default arm (band [-1, 1.5]) against the sync-only
arm (band open) of the fair study.

    python -m humanline_cli.lab.arm_diff runs/experiments/smollm2_fair_study/hl_stale_once_sync1_lo1_seed6 \\
        runs/experiments/smollm2_fair_study/hl_stale_once_sync1_open_seed6
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from humanline_cli.errors import UserError

CLOCKS = ("time/", "wall", "tokens_per_s")  # how long a step took, never what it computed
UNCLAMPED = "humanline/unclamped_fraction"


def train_rows(run: Path) -> dict[int, dict]:
    """The run's logged training steps (rows with a loss), by step."""
    path = Path(run) / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{run}: no metrics.jsonl (not a run dir)")
    rows = {}
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            row = json.loads(line)
        except ValueError:
            raise UserError(f"{path}:{n}: not a JSON line") from None
        if "loss" in row and "step" in row:
            rows[row["step"]] = row
    return rows


def compare(a: dict[int, dict], b: dict[int, dict]) -> dict:
    """{"steps": steps both logged, "only_a"/"only_b": steps one lacks, "differ": {key: [steps]} where both log a
    number and it differs, "logged_by_a"/"logged_by_b": keys only that run logs (the open band logs no clamped
    share), "clamped_a"/"clamped_b": {step: share of tokens clamped}}."""
    differ: dict[str, list[int]] = {}
    both = sorted(a.keys() & b.keys())
    keys_a = {k for s in both for k in a[s] if not k.startswith(CLOCKS)}
    keys_b = {k for s in both for k in b[s] if not k.startswith(CLOCKS)}
    for step in both:
        for key in sorted(keys_a & keys_b):
            if a[step].get(key, "<absent>") != b[step].get(key, "<absent>"):
                differ.setdefault(key, []).append(step)

    def clamped(rows):
        return {s: 1 - r[UNCLAMPED] for s, r in sorted(rows.items()) if r.get(UNCLAMPED, 1) < 1}

    return {"steps": len(both), "only_a": sorted(a.keys() - b.keys()), "only_b": sorted(b.keys() - a.keys()),
            "differ": differ, "logged_by_a": sorted(keys_a - keys_b), "logged_by_b": sorted(keys_b - keys_a),
            "clamped_a": clamped(a), "clamped_b": clamped(b)}


def _clamped(shares: dict[int, float]) -> str:
    return ", ".join(f"{100 * x:.2f}% at step {s}" for s, x in shares.items()) or "none"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m humanline_cli.lab.arm_diff", description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path, help="a run dir")
    p.add_argument("b", type=Path, help="another run dir (the same seed)")
    args = p.parse_args(argv)
    try:
        r = compare(train_rows(args.a), train_rows(args.b))
    except UserError as e:
        print(f"arm_diff: error: {e}", file=sys.stderr)
        return 2
    print(f"{r['steps']} steps logged by both" + (f"; only {args.a.name}: {r['only_a']}" if r["only_a"] else "")
          + (f"; only {args.b.name}: {r['only_b']}" if r["only_b"] else ""))
    print("differ (clocks aside): " + ("; ".join(f"{k} at steps {', '.join(map(str, s))}"
                                                  for k, s in r["differ"].items()) or "nothing"))
    for side, run in (("a", args.a), ("b", args.b)):
        if r[f"logged_by_{side}"]:
            print(f"logged by {run.name} only: {', '.join(r[f'logged_by_{side}'])}")
    print(f"tokens the band clamped, {args.a.name}: {_clamped(r['clamped_a'])}")
    print(f"tokens the band clamped, {args.b.name}: {_clamped(r['clamped_b'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
