"""A running study's progress, read off its kept CSV: per regime, the complete runs, their seeds and their mean
finals and run time. These are counts, not comparisons; the registered comparisons wait for every seed
(lab/study_check). `--write` puts the table and the run count where docs/results.md and the README show them, so
the docs say what the CSV holds (a test checks they agree).

    python -m humanline_cli.lab.study_progress humanline_cli/docs/studies/smollm2_fair_study.csv --write
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import Counter
from pathlib import Path

from humanline_cli.errors import UserError
from humanline_cli.mdtable import md_table
from humanline_cli.report.study_csv import read_table

NEEDED = ("status", "regime", "seed", "greedy_final", "sampled_final", "wall_clock_s", "machine")
DOCS = Path(__file__).resolve().parents[1] / "docs" / "results.md"
README = Path(__file__).resolve().parents[2] / "README.md"
TABLE_HEAD = ("| regime | runs finished | seeds | mean greedy final | mean sampled final | mean seconds a run | "
              "runs by CPU |")
# where the count appears: results.md's index row and two sentences of the study's section, and the README
COUNTS = {DOCS: (r"study running, (\d+) of {total} runs \|", r"has started \((\d+) of {total} runs\)",
                 r"\*\*(\d+) of {total} runs finished\*\*"),
          README: (r"the study has started \((\d+) of {total} runs\)",)}


def seed_ranges(seeds: list[int]) -> str:
    """Sorted seeds as inclusive ranges: 0-6, 8, 10-11."""
    parts, seeds = [], sorted(seeds)
    i = 0
    while i < len(seeds):
        j = i
        while j + 1 < len(seeds) and seeds[j + 1] == seeds[j] + 1:
            j += 1
        parts.append(str(seeds[i]) if i == j else f"{seeds[i]}-{seeds[j]}")
        i = j + 1
    return ", ".join(parts)


def cpu_name(machine: str) -> str:
    """The CPU a run's `machine` cell names, without trademark marks: "Intel Xeon", "AMD EPYC"; "?" if none."""
    cpu = (json.loads(machine) if machine else {}).get("cpu") or "?"
    return re.sub(r"\s+", " ", re.sub(r"\((R|TM)\)|\bProcessor\b|\bCPU\b", "", cpu)).strip() or "?"


def _mean(runs, column: str) -> float:
    return statistics.fmean(float(x) for x in runs[column])


def progress(csv_path: Path, regimes: list[str] | None = None) -> tuple[int, list[str]]:
    """(complete runs, the table's lines) in the CSV's regime order (or `regimes`')."""
    table = read_table(csv_path, NEEDED)
    done = table[table.status == "complete"]
    order = regimes or list(dict.fromkeys(table.regime))
    rows = []
    for regime in order:
        runs = done[done.regime == regime]
        if runs.empty:
            rows.append((regime, "0", "–", "–", "–", "–", "–"))
            continue
        seconds = statistics.fmean(json.loads(w)["total"] for w in runs.wall_clock_s)
        cpus = Counter(cpu_name(m) for m in runs.machine)
        rows.append((regime, str(len(runs)), seed_ranges([int(s) for s in runs.seed]), f"{_mean(runs, 'greedy_final'):.4f}",
                     f"{_mean(runs, 'sampled_final'):.4f}", f"{seconds:,.0f}",
                     ", ".join(f"{cpu} {k}" for cpu, k in sorted(cpus.items()))))
    lines = md_table(TABLE_HEAD.strip("| ").split(" | "), rows)
    return len(done), lines


def write(csv_path: Path, total: int, docs: Path = DOCS, readme: Path = README) -> int:
    """The docs' progress table and counts set from the CSV; the complete runs."""
    n, lines = progress(csv_path)
    for path, patterns in ((docs, COUNTS[DOCS]), (readme, COUNTS[README])):
        text = path.read_text()
        for pattern in patterns:
            rx = re.compile(pattern.format(total=total))
            if not rx.search(text):
                raise UserError(f"{path}: no '{pattern.format(total=total)}' to update")
            text = rx.sub(lambda m: m.group(0).replace(m.group(1), str(n), 1), text)
        if path == docs:
            start = text.find(TABLE_HEAD[:TABLE_HEAD.index(" runs by CPU")])
            if start < 0:
                raise UserError(f"{path}: no progress table to update")
            end = text.index("\n\n", start)
            text = text[:start] + "\n".join(lines) + text[end:]
        path.write_text(text)
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m humanline_cli.lab.study_progress", description=__doc__.split("\n\n")[0])
    p.add_argument("csv", type=Path, help="the study's kept CSV (humanline report DIR --export-csv FILE)")
    p.add_argument("--total", type=int, default=396, help="the registered number of runs (default 396)")
    p.add_argument("--write", action="store_true", help="update docs/results.md and the README from the CSV")
    a = p.parse_args(argv)
    try:
        if a.write:
            n = write(a.csv, a.total)
            print(f"study_progress: {n} of {a.total} runs in {DOCS.name} and {README.name}")
            return 0
        n, lines = progress(a.csv)
    except UserError as e:
        print(f"study_progress: error: {e}", file=sys.stderr)
        return 2
    print(f"{n} of {a.total} runs complete\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
