"""Two arms of a study CSV paired by seed (lab/paired.py), on a hand-made CSV with hand-computed numbers."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from humanline_cli.lab.paired import main


def _row(prec, seed, greedy, sampled, total, status="complete"):
    return {"run": f"{prec}_seed{seed}", "status": status, "seed": seed,
            "config": json.dumps({"backend.precision": prec, "seed": seed}),
            "greedy_final": greedy, "sampled_final": sampled, "greedy_start": 0.3, "sampled_start": 0.2,
            "wall_clock_s": json.dumps({"setup": 10.0, "sample": 20.0, "train": total / 2, "eval": 5.0,
                                        "total": total})}


def test_the_arms_pair_by_seed_with_a_t_interval_and_mean_clocks(tmp_path, capsys):
    rows = [_row("auto", 100, 0.95, 0.89, 1000.0), _row("auto", 101, 0.96, 0.90, 1100.0),
            _row("auto", 102, 0.90, 0.85, 1200.0), _row("fp32", 100, 0.96, 0.88, 2000.0),
            _row("fp32", 101, 0.92, 0.87, 2200.0), _row("fp32", 102, 0.90, 0.86, 2400.0),
            # not complete, and a seed the other arm lacks: neither counts in the pairs
            _row("fp32", 103, 0.10, 0.10, 9.0, status="failed"), _row("auto", 104, 0.5, 0.5, 500.0)]
    path = tmp_path / "study.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    assert main([str(path), "--by", "backend.precision", "--a", "auto", "--b", "fp32"]) == 0
    out = capsys.readouterr().out
    # greedy: -0.01, +0.04, 0.00; mean 0.01, SD sqrt((0.0004 + 0.0009 + 0.0001) / 2) = 0.0264575,
    # half-width 4.302653 x 0.0264575 / sqrt 3 = 0.0657246
    assert "| greedy_final | 100, 101, 102 | -0.0100, +0.0400, +0.0000 | 0.9367 | 0.9267 | +0.0100 | " \
           "[-0.0557, +0.0757] |" in out
    # sampled: +0.01, +0.03, -0.01: mean 0.01, SD 0.02, half-width 4.302653 x 0.02 / sqrt 3 = 0.0496828
    assert "| sampled_final | 100, 101, 102 | +0.0100, +0.0300, -0.0100 | 0.8800 | 0.8700 | +0.0100 | " \
           "[-0.0397, +0.0597] |" in out
    assert pytest.approx(0.0496828, abs=1e-7) == 4.302653 * 0.02 / 3 ** 0.5
    # mean clocks over the paired seeds 100-102 (auto's seed 104 has no pair): auto 1000, 1100, 1200
    assert "| auto | 3 | 10 | 20 | 550 | 5 | 1100 |" in out and "| fp32 | 3 | 10 | 20 | 1100 | 5 | 2200 |" in out


def test_arms_without_a_common_seed_or_a_bad_file_are_one_line_and_exit_2(tmp_path, capsys):
    path = tmp_path / "study.csv"
    pd.DataFrame([_row("auto", 1, 0.5, 0.5, 1.0), _row("fp32", 2, 0.5, 0.5, 1.0)]).to_csv(path, index=False)
    assert main([str(path), "--by", "backend.precision", "--a", "auto", "--b", "fp32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no seed has a complete run with backend.precision=auto and one with fp32" in err[0]
    (tmp_path / "bad.csv").write_text("x\n1\n")
    assert main([str(tmp_path / "bad.csv"), "--by", "k", "--a", "1", "--b", "2"]) == 2
    assert "not a study CSV" in capsys.readouterr().err
