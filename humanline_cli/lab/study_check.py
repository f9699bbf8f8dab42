"""The fair SmolLM2 study's registered primary and secondary read off its study CSV (docs/results.md, "Registered:
the fair SmolLM2 pilot and study"), so the decision is mechanical and anyone can recompute it:

- primary: for each humanline-stale regime H, online - H at the last step, paired by seed: the TOST at margin 0.05
  (its p-value: the larger one-sided p; its 90% t-interval beside it), Holm's step-down over the three H on greedy;
  equivalence is declared only where Holm rejects;
- secondary: each H - stale_once, the mean with its 95% t-interval (helps if above 0);
- greedy decides; sampled is reported beside every comparison and decides nothing.

Only complete runs on the registered seeds count, each started on a clean checkout (git_dirty false) and, with
--registered, on a commit that descends from the registering one. Until every regime has every registered seed the
comparisons are reported on the seeds they have, labelled incomplete, and nothing is decided.

    python -m humanline_cli.lab.study_check humanline_cli/docs/studies/smollm2_fair_study.csv --registered 9ec4d9a
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

import pandas as pd

from humanline_cli.errors import UserError
from humanline_cli.lab.power import holm, tost_p
from humanline_cli.lab.study_progress import cpu_name
from humanline_cli.mdtable import md_table
from humanline_cli.report.stats import equivalence, paired_by_seed
from humanline_cli.report.study_csv import read_table

ONLINE, STALE = "online", "stale_once"
HUMANLINE = ("hl_stale_once_sync1_lo1", "hl_stale_once_sync16_lo15", "hl_stale_once_sync1_open")
REGIMES = (ONLINE, "hl_online", STALE, *HUMANLINE)
SEEDS = tuple(range(66))
MARGIN, ALPHA = 0.05, 0.05
METRICS = {"greedy": "greedy_final", "sampled": "sampled_final"}
NEEDED = ("status", "regime", "seed", "git_commit", "git_dirty", *METRICS.values())


def descends(commit: str, registered: str, repo: Path) -> str | None:
    """None where `commit` is `registered` or comes after it in `repo`'s history, else why not (a UserError where
    the registering commit itself is unknown there)."""
    try:
        known = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{registered}^{{commit}}"],
                               capture_output=True, text=True)
    except OSError as e:
        raise UserError(f"--registered needs git: {e}") from None
    if known.returncode != 0:
        raise UserError(f"--registered {registered}: not a commit of the repository at {repo}")
    check = subprocess.run(["git", "-C", str(repo), "merge-base", "--is-ancestor", registered, commit],
                           capture_output=True, text=True)
    if check.returncode == 0:
        return None
    if check.returncode == 1:
        return f"started on {commit[:7]}, not at or after the registering commit {registered}"
    return f"started on {commit[:7]}, a commit the repository at {repo} lacks"


def eligible(csv: pd.DataFrame, seeds, registered: str | None = None, repo: Path = Path(".")):
    """The runs that count (complete, a registered regime and seed, a clean start, after the registration) as a
    frame of regime, seed, commit and the metrics; and one line per excluded run saying why."""
    keep, excluded = [], []
    after: dict[str, str | None] = {}
    for r in csv.itertuples():
        if r.status != "complete" or r.regime not in REGIMES or not r.seed.isdigit() or int(r.seed) not in seeds:
            continue
        why = None
        if r.git_dirty.lower() != "false" or not r.git_commit:
            why = "not started on a clean checkout" if r.git_commit else "no commit recorded"
        elif registered is not None:
            if r.git_commit not in after:
                after[r.git_commit] = descends(r.git_commit, registered, repo)
            why = after[r.git_commit]
        if why:
            excluded.append(f"{r.regime} seed {r.seed}: {why}")
            continue
        keep.append({"regime": r.regime, "seed": int(r.seed), "commit": r.git_commit,
                     "cpu": cpu_name(getattr(r, "machine", "")),
                     **{m: float(getattr(r, col)) for m, col in METRICS.items()}})
    runs = pd.DataFrame(keep, columns=["regime", "seed", "commit", "cpu", *METRICS])
    dup = runs.duplicated(["regime", "seed"], keep=False)
    if dup.any():
        raise UserError("two complete runs of the same regime and seed: "
                        + ", ".join(f"{r.regime} seed {r.seed}" for r in runs[dup].drop_duplicates(["regime", "seed"])
                                    .itertuples()))
    return runs, excluded


def _series(runs: pd.DataFrame, regime: str, metric: str) -> pd.Series:
    part = runs[runs.regime == regime]
    return pd.Series(part[metric].to_numpy(), index=part.seed.to_numpy())


def decide(runs: pd.DataFrame, seeds) -> dict:
    """The primary (per H and metric: online - H's paired mean, SD, 90% interval, TOST p; Holm over greedy) and the
    secondary (per H and metric: H - stale_once with its 95% interval); `complete`: every regime has every seed."""
    have = {reg: set(runs[runs.regime == reg].seed) for reg in REGIMES}
    full = sorted(set(seeds).intersection(*have.values()))
    complete = len(full) == len(seeds)
    primary, secondary = {}, {}
    for h in HUMANLINE:
        for m in METRICS:
            d = paired_by_seed(_series(runs, ONLINE, m), _series(runs, h, m))
            if d is not None:
                d = {**d, "sd": statistics.stdev(d["diffs"]) if d["n"] > 1 else None,
                     "tost": equivalence(d["diffs"], MARGIN), "tost_p": tost_p(d["diffs"], MARGIN)}
            primary[h, m] = d
            secondary[h, m] = paired_by_seed(_series(runs, h, m), _series(runs, STALE, m))
    greedy_p = {h: primary[h, "greedy"]["tost_p"] for h in HUMANLINE
                if primary[h, "greedy"] is not None and primary[h, "greedy"]["tost_p"] is not None}
    order = sorted(greedy_p, key=greedy_p.get)
    threshold = {h: ALPHA / (len(HUMANLINE) - k) for k, h in enumerate(order)}
    # Holm's family is all three H: with one untested, none is declared
    held = holm(greedy_p, ALPHA) if len(greedy_p) == len(HUMANLINE) else {}
    rejected = {h: held.get(h, False) for h in HUMANLINE}
    return {"have": {reg: len(s) for reg, s in have.items()}, "full": full, "n_seeds": len(seeds),
            "complete": complete, "primary": primary, "secondary": secondary, "threshold": threshold,
            "rejected": rejected}


def _f(x, sign: bool = True) -> str:
    return "–" if x is None else (f"{x:+.4f}" if sign else f"{x:.4f}")


def _interval(lo, hi) -> str:
    return "–" if lo is None else f"[{lo:+.4f}, {hi:+.4f}]"


def ran_on(runs: pd.DataFrame) -> str:
    """The CPUs the counted runs ran on, and how many seeds have arms on more than one (the registration fixes the
    code, precision, threads and seeds, not the CPU: a seed's pairs may span machines)."""
    cpus = runs.cpu.value_counts()
    split = int((runs.groupby("seed").cpu.nunique() > 1).sum())
    return ("ran on: " + (", ".join(f"{c} ({k} runs)" for c, k in sorted(cpus.items())) or "–")
            + f"; seeds with arms on more than one CPU: {split}")


def markdown(r: dict, commits: dict, excluded: list[str], cpus: str | None = None) -> list[str]:
    n = r["n_seeds"]
    lines = ["runs counted per regime (of " + str(n) + " seeds): "
             + ", ".join(f"{reg} {k}" for reg, k in r["have"].items()),
             "started on: " + (", ".join(f"{c[:7]} ({k} runs, clean)" for c, k in commits.items()) or "–"),
             *([cpus] if cpus else [])]
    lines += [f"excluded: {e}" for e in excluded]
    lines += [f"seeds with all {len(REGIMES)} regimes: {len(r['full'])} of {n}"]
    if not r["complete"]:
        lines += ["INCOMPLETE: every comparison below is on the seeds it has and decides nothing"]
    lines += ["", f"Primary: online - H at the last step, paired by seed; TOST at margin {MARGIN} (90% t-interval), "
              f"Holm over the {len(HUMANLINE)} H on greedy:", ""]
    rows = []
    for (h, m), d in r["primary"].items():
        if d is None:
            rows.append((h, m, "0", "–", "–", "–", "–", "–", "no paired seeds"))
            continue
        if m != "greedy":
            holm_at, verdict = "–", "reported, decides nothing"
        else:
            holm_at = "–" if h not in r["threshold"] else f"{r['threshold'][h]:.4f}"
            verdict = ("incomplete: decides nothing" if not r["complete"] else
                       f"equivalent within +-{MARGIN:g} (Holm)" if r["rejected"][h] else "not shown equivalent (Holm)")
        rows.append((h, m, str(d["n"]), _f(d["mean"]), _f(d["sd"], False), _interval(d["tost"]["lo"], d["tost"]["hi"]),
                     _f(d["tost_p"], False), holm_at, verdict))
    lines += md_table(["H", "metric", "seeds", "online - H", "SD", "90% t-interval", "TOST p", "Holm: p must be <=",
                       "verdict"], rows)
    lines += ["", "Secondary: H - stale_once at the last step, paired by seed (95% t-interval; helps if above 0):", ""]
    rows = []
    for (h, m), d in r["secondary"].items():
        if d is None:
            rows.append((h, m, "0", "–", "–", "no paired seeds"))
            continue
        verdict = ("reported, decides nothing" if m != "greedy" else "incomplete: decides nothing"
                   if not r["complete"] else "above 0" if d["lo"] is not None and d["lo"] > 0 else "not above 0")
        rows.append((h, m, str(d["n"]), _f(d["mean"]), _interval(d["lo"], d["hi"]), verdict))
    lines += md_table(["H", "metric", "seeds", "H - stale_once", "95% t-interval", "verdict"], rows)
    return lines


def _seeds(text: str) -> tuple[int, ...]:
    """"0-65" or "0-2,5": comma-separated seeds and inclusive ranges."""
    seeds = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds += range(int(lo), int(hi or lo) + 1)
    return tuple(seeds)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m humanline_cli.lab.study_check", description=__doc__.split("\n\n")[0])
    p.add_argument("csv", type=Path, help="the study's CSV (humanline report DIR --export-csv FILE)")
    p.add_argument("--seeds", default=f"{SEEDS[0]}-{SEEDS[-1]}",
                   help="the registered seeds: seeds and inclusive ranges A-B, comma-separated")
    p.add_argument("--registered", default=None, metavar="COMMIT",
                   help="count only runs started at or after this commit (checked with git in --repo)")
    p.add_argument("--repo", type=Path, default=Path("."), help="the git repository --registered is checked in")
    a = p.parse_args(argv)
    try:
        seeds = _seeds(a.seeds)
    except ValueError:
        print(f"study_check: error: --seeds {a.seeds!r}: not comma-separated seeds and ranges A-B", file=sys.stderr)
        return 2
    try:
        runs, excluded = eligible(read_table(a.csv, NEEDED), seeds, a.registered, a.repo)
    except UserError as e:
        print(f"study_check: error: {e}", file=sys.stderr)
        return 2
    commits = runs.commit.value_counts().to_dict()
    print("\n".join(markdown(decide(runs, seeds), commits, excluded, ran_on(runs))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
