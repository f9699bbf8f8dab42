"""The fair pilot's registered rule off a study CSV, on hand-made grids with hand-computed numbers."""
from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from humanline_cli.lab.pilot_check import main

LRS, SEEDS = (3e-6, 1e-5, 3e-5), (100, 101, 102)
ONLINE = {3e-6: (0.90, 0.92, 0.94), 1e-5: (0.95, 0.97, 0.99), 3e-5: (0.80, 0.85, 0.90)}  # means 0.92, 0.97, 0.85


def _csv(tmp_path, stale_at_1e5=(0.80, 0.85, 0.83), start=0.3075, drop=(), extra=()):
    rows = []
    for lr in LRS:
        for regime in ("online", "stale_once"):
            finals = ONLINE[lr] if regime == "online" else stale_at_1e5 if lr == 1e-5 else (0.5, 0.5, 0.5)
            for seed, final in zip(SEEDS, finals):
                if (lr, regime, seed) in drop:
                    continue
                rows.append({"run": f"lr{lr}/{regime}_seed{seed}", "status": "complete", "regime": regime,
                             "seed": seed, "config": json.dumps({"train.lr": lr, "seed": seed}),
                             "greedy_final": final, "sampled_final": final - 0.05, "greedy_start": start})
    rows += list(extra)
    path = tmp_path / "pilot.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


def test_a_passing_grid_tunes_the_lr_and_sizes_the_study(tmp_path, capsys):
    # a failed run of a cell does not count; its complete twin does
    failed = {"run": "x", "status": "failed", "regime": "online", "seed": 100,
              "config": json.dumps({"train.lr": 3e-5}), "greedy_final": 1.0, "sampled_final": 1.0, "greedy_start": 0.3}
    assert main([str(_csv(tmp_path, extra=[failed]))]) == 0
    out = capsys.readouterr().out
    # tuned lr 1e-5 (mean 0.97); online - stale_once = 0.15, 0.12, 0.16: mean 0.143333, SD sqrt(8.6667e-4 / 2) =
    # 0.0208167, half-width t(0.975, 2) x SD / sqrt 3 = 4.302653 x 0.0120185 = 0.0517111
    assert "tuned lr: 1e-05" in out
    sd = math.sqrt(((0.15 - 0.43 / 3) ** 2 + (0.12 - 0.43 / 3) ** 2 + (0.16 - 0.43 / 3) ** 2) / 2)
    assert sd == pytest.approx(0.0208167, abs=1e-7)
    half = 4.302653 * sd / math.sqrt(3)
    assert f"[{0.43 / 3 - half:.4f}, {0.43 / 3 + half:.4f}]" == "[0.0916, 0.1950]"
    assert "| greedy | 100, 101, 102 | +0.1500, +0.1200, +0.1600 | 0.1433 [0.0916, 0.1950] (n=3) |" in out
    # the SD is below the 0.06 floor, so the registered n at SD 0.06: 14
    assert "paired greedy SD 0.0208" in out and "margin 0.05: 14" in out
    assert out.strip().endswith("verdict: pass: tuned online - stale_once +0.1433 greedy, "
                                "95% t-interval [+0.0916, +0.1950] (needs >= 0.1 and above 0)")
    assert "| 1e-05 | 0.9700 [" in out and "(n=3)" in out
    # stale_once at an lr that was not tuned decides nothing: the same verdict without it
    assert main([str(_csv(tmp_path, drop=[(3e-6, "stale_once", s) for s in SEEDS]))]) == 0
    out = capsys.readouterr().out
    assert "missing: lr 3e-06 stale_once seed 100" in out and "verdict: pass: tuned online - stale_once +0.1433" in out


def test_a_small_gap_fails_and_a_missing_online_cell_decides_nothing(tmp_path, capsys):
    # 0.95 - 0.90, 0.97 - 0.85, 0.99 - 0.93 = 0.05, 0.12, 0.06: mean 0.0767 < 0.10
    assert main([str(_csv(tmp_path, stale_at_1e5=(0.90, 0.85, 0.93)))]) == 0
    assert "verdict: fail: tuned online - stale_once +0.0767 greedy" in capsys.readouterr().out
    assert main([str(_csv(tmp_path, drop=[(3e-5, "online", 101)]))]) == 0
    out = capsys.readouterr().out
    assert "missing: lr 3e-05 online seed 101" in out and out.strip().endswith("verdict: incomplete: 1 of 18 runs missing")
    assert "tuned lr" not in out
    # stale_once at the tuned lr short of a seed: the lr is known, the check is not
    assert main([str(_csv(tmp_path, drop=[(1e-5, "stale_once", 102)]))]) == 0
    out = capsys.readouterr().out
    assert "tuned lr: 1e-05" in out
    assert out.strip().endswith("verdict: incomplete: stale_once at the tuned lr 1e-05 lacks seeds")


def test_a_start_outside_the_range_fails_before_the_check(tmp_path, capsys):
    assert main([str(_csv(tmp_path, start=0.285))]) == 0
    out = capsys.readouterr().out
    assert out.strip().endswith("verdict: fail: the mean greedy start 0.2850 lies outside [0.3, 0.6]")


def test_not_a_study_csv_is_one_line_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "x.csv"
    bad.write_text("a,b\n1,2\n")
    assert main([str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a study CSV" in err[0]
    assert main([str(tmp_path / "none.csv")]) == 2
