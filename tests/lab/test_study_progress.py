"""A running study's progress off its kept CSV: hand-made runs with hand-computed means, and the committed docs
(results.md's progress table and the four counts, the README's count) agree with the committed CSV."""
from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest

from humanline_cli.errors import UserError
from humanline_cli.lab.study_progress import DOCS, README, cpu_name, progress, seed_ranges, write

CSV = DOCS.parent / "studies" / "smollm2_fair_study.csv"
XEON = json.dumps({"cpu": "Intel(R) Xeon(R) Processor", "cpu_kernels": "AVX512"})
EPYC = json.dumps({"cpu": "AMD EPYC", "cpu_kernels": "AVX512"})


def test_seed_ranges_and_cpu_names():
    assert seed_ranges([6, 0, 1, 2, 3, 4, 5]) == "0-6"
    assert seed_ranges([0, 2, 3, 4, 7, 9, 10]) == "0, 2-4, 7, 9-10"
    assert seed_ranges([5]) == "5"
    assert cpu_name(XEON) == "Intel Xeon" and cpu_name(EPYC) == "AMD EPYC" and cpu_name("") == "?"


def test_progress_counts_complete_runs_only_with_hand_computed_means(tmp_path):
    rows = [("online", 0, 0.97, 0.96, 1000.0, XEON, "complete"), ("online", 1, 0.95, 0.90, 1200.0, EPYC, "complete"),
            ("online", 2, 0.10, 0.10, 10.0, EPYC, "incomplete"), ("stale", 0, 0.50, 0.25, 1500.0, EPYC, "complete")]
    path = tmp_path / "s.csv"
    pd.DataFrame([{"run": f"{r}_seed{s}", "status": st, "regime": r, "seed": s, "greedy_final": g, "sampled_final": x,
                   "wall_clock_s": json.dumps({"total": w}), "machine": m} for r, s, g, x, w, m, st in rows]
                 ).to_csv(path, index=False)
    n, lines = progress(path, ["online", "stale", "hl"])
    assert n == 3
    assert lines[2:] == ["| online | 2 | 0-1 | 0.9600 | 0.9300 | 1,100 | AMD EPYC 1, Intel Xeon 1 |",
                         "| stale | 1 | 0 | 0.5000 | 0.2500 | 1,500 | AMD EPYC 1 |",
                         "| hl | 0 | – | – | – | – | – |"]


def test_the_docs_say_what_the_committed_csv_holds(tmp_path):
    docs, readme = tmp_path / "results.md", tmp_path / "README.md"
    shutil.copy(DOCS, docs)
    shutil.copy(README, readme)
    n = write(CSV, 396, docs, readme)
    assert n == len(pd.read_csv(CSV).query("status == 'complete'"))
    assert docs.read_text() == DOCS.read_text(), "results.md's progress: python -m humanline_cli.lab.study_progress"
    assert readme.read_text() == README.read_text(), "the README's count: python -m humanline_cli.lab.study_progress"


def test_docs_without_a_count_are_refused(tmp_path):
    docs, readme = tmp_path / "results.md", tmp_path / "README.md"
    docs.write_text("no study here\n")
    readme.write_text("nor here\n")
    with pytest.raises(UserError, match="no 'study running"):
        write(CSV, 396, docs, readme)
