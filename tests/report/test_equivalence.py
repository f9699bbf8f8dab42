"""`humanline report --margin M`: every paired difference gains its 90% t-interval across seeds and the verdict of
two one-sided t-tests at alpha 0.05 (equivalent within +-M when the interval lies inside [-M, +M])."""
from __future__ import annotations

import csv

import pytest

from humanline_cli.report.aggregate import main_report
from humanline_cli.report.stats import equivalence
from tests.report.test_golden import GOLDEN, _read, assert_same_table

# per-seed differences [0.01, -0.02, 0.03, 0.00, 0.02]: mean 0.04 / 5 = 0.008; deviations 0.002, -0.028, 0.022,
# -0.008, 0.012, squares summing to 1480e-6, so sd^2 = 1480e-6 / 4 = 370e-6 and se = sqrt(370e-6 / 5) =
# sqrt(74e-6) = 0.0086023253; t(0.95, 4) = 2.131847, half-width 2.131847 * 0.0086023253 = 0.0183388413;
# the 90% interval [0.008 - 0.0183388, 0.008 + 0.0183388] = [-0.0103388, +0.0263388]
DIFFS = [0.01, -0.02, 0.03, 0.00, 0.02]
LO, HI = -0.0103388413, 0.0263388413


def test_the_90_percent_interval_and_verdicts_by_hand():
    wide = equivalence(DIFFS, 0.05)
    assert (wide["lo"], wide["hi"]) == pytest.approx((LO, HI), abs=5e-9)  # t to 6 decimals: +-4.3e-9
    assert wide["verdict"] == "equivalent within +-0.05"  # -0.05 <= -0.0103 and +0.0263 <= 0.05
    assert equivalence(DIFFS, 0.02)["verdict"] == "not shown equivalent"  # +0.0263 > 0.02
    assert equivalence([0.01], 0.05) == {"lo": None, "hi": None, "verdict": "n/a"}


EXTRA = ["equivalence_margin", *(f"{mode}_{c}_{k}" for mode in ("greedy", "sampled")
                                 for c in ("humanline_offline_minus_offline", "online_minus_humanline_offline",
                                           "online_minus_offline") for k in ("lo90", "hi90", "equivalence"))]


def _only(columns: list[str], src, dst) -> None:
    _, rows = _read(src)
    with open(dst, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def test_margin_adds_columns_and_leaves_the_golden_numbers(tmp_path):
    expected = GOLDEN / "expected" / "regimes" / "gap_closed.csv"
    golden_columns, _ = _read(expected)
    assert main_report([str(GOLDEN / "regimes"), "--out", str(tmp_path / "off")]) == 0
    assert _read(tmp_path / "off" / "gap_closed.csv")[0] == golden_columns
    assert "90% t-interval" not in (tmp_path / "off" / "report.md").read_text()

    assert main_report([str(GOLDEN / "regimes"), "--out", str(tmp_path / "on"), "--margin", "0.05"]) == 0
    columns, (row,) = _read(tmp_path / "on" / "gap_closed.csv")
    assert columns == golden_columns + EXTRA
    _only(golden_columns, tmp_path / "on" / "gap_closed.csv", tmp_path / "golden_part.csv")
    assert_same_table(expected, tmp_path / "golden_part.csv")
    # two seeds; the greedy gap online - offline is 0.255 with 95% interval [0.0644069, 0.445593], half-width
    # 0.190593 = t(0.975, 1) se = 12.706205 se, so the 90% half-width is t(0.95, 1) se = 6.313752 / 12.706205 *
    # 0.190593 = 0.0947062: [0.160294, 0.349706]
    assert row["metric"] == "greedy accuracy" and row["equivalence_margin"] == "0.05"
    assert float(row["greedy_online_minus_offline_lo90"]) == pytest.approx(0.160294, abs=2e-6)
    assert float(row["greedy_online_minus_offline_hi90"]) == pytest.approx(0.349706, abs=2e-6)
    assert row["greedy_online_minus_offline_equivalence"] == "not shown equivalent"
    md = (tmp_path / "on" / "report.md").read_text()
    assert ("| arithmetic | grpo | hl | greedy | online - offline | +0.255 | [+0.064, +0.446] | [+0.042, +0.375] | 2 "
            "| [+0.160, +0.350] | not shown equivalent |") in md


def test_margin_verdicts_on_the_study(tmp_path):
    assert main_report([str(GOLDEN / "study"), "--out", str(tmp_path), "--margin", "0.05"]) == 0
    _, rows = _read(tmp_path / "gap_closed.csv")
    by_set = {(r["objective"], r["set"]): r for r in rows}
    # async-1: online - humanline-offline per seed has mean 0 and 90% interval [-0.045, +0.045]
    async1 = by_set[("grpo", "async-1")]
    assert async1["greedy_online_minus_humanline_offline_equivalence"] == "equivalent within +-0.05"
    assert async1["greedy_online_minus_offline_equivalence"] == "not shown equivalent"  # [-0.015, +0.075]
    assert by_set[("dpo", "")]["sampled_online_minus_offline_equivalence"] == "n/a"  # one seed
    assert main_report([str(GOLDEN / "study"), "--out", str(tmp_path), "--margin", "0"]) == 2
