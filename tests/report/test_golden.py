"""The report's numbers, pinned: `humanline report` over the committed run dirs in tests/report/golden (made by
golden/make_runs.py) writes CSVs that carry the numbers of golden/expected, written by the report as it stood
before it moved onto a data frame. Column order, row order and number formatting may change; a number may not
(within the precision the expected file printed it to), nor may a row or a column go missing or appear."""
from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from humanline_cli.report.aggregate import main_report

GOLDEN = Path(__file__).resolve().parent / "golden"
STUDY_CSVS = ("report.csv", "gap_closed.csv", "cost.csv", "async.csv")
# The expected files round some columns: gap_closed.csv (and regime_map.csv, its rows) prints speeds and shares
# to 4 significant digits and its other numbers to 6; a rounded number matches within half its last digit.
GAP_FILES = ("gap_closed.csv", "regime_map.csv")
FOUR_DIGITS = ("speedup", "speedup_equal_quality", "online_sampling_share", "speedup_bound_matched")


def rel_tol(name: str, column: str) -> float:
    if name in GAP_FILES:
        return 5e-4 if column in FOUR_DIGITS else 5e-6
    return 1e-6


def _read(path: Path) -> tuple[list[str], list[dict]]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
        return list(rows[0]) if rows else [], rows


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _same(expected: str, got: str, tol: float) -> bool:
    if expected.lower() in ("", "nan") or got.lower() in ("", "nan"):
        return expected.lower() in ("", "nan") and got.lower() in ("", "nan")
    a, b = _number(expected), _number(got)
    if a is None or b is None:
        return expected == got
    return math.isclose(a, b, rel_tol=tol, abs_tol=1e-9)


def assert_same_table(expected_path: Path, got_path: Path) -> None:
    """Every expected row has one actual row whose cells all match (numbers within tolerance), and no more rows."""
    columns, expected = _read(expected_path)
    got_columns, got = _read(got_path)
    assert sorted(got_columns) == sorted(columns), (expected_path.name, got_columns)
    assert len(got) == len(expected), (expected_path.name, len(got), len(expected))
    left = list(got)
    for row in expected:
        match = next((g for g in left if all(_same(row[c], g[c], rel_tol(expected_path.name, c))
                                            for c in columns)), None)
        assert match is not None, f"{expected_path.name}: no row carries {row}"
        left.remove(match)


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("study")
    root = GOLDEN / "study"
    assert main_report([str(root), "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("name", STUDY_CSVS)
def test_study_csvs_carry_the_golden_numbers(study, name):
    assert_same_table(GOLDEN / "expected" / "study" / name, study / name)


def test_the_lab_prediction_carries_the_golden_numbers(tmp_path):
    """predicted.csv, once written by `humanline report --target`, now by the lab's cost model over the same runs."""
    from humanline_cli.lab.speed import main

    root = GOLDEN / "study"
    assert main([str(root), "--out", str(tmp_path), "--target", str(root / "constants.json"), "--target", "h100"]) == 0
    assert_same_table(GOLDEN / "expected" / "study" / "predicted.csv", tmp_path / "predicted.csv")


def test_regime_sweep_csvs_carry_the_golden_numbers(tmp_path):
    from humanline_cli.lab.regime_map import main

    assert main_report([str(GOLDEN / "regimes"), "--out", str(tmp_path)]) == 0
    for name in ("report.csv", "gap_closed.csv", "cost.csv"):
        assert_same_table(GOLDEN / "expected" / "regimes" / name, tmp_path / name)
    assert main(["--sweep", str(GOLDEN / "regimes"), "--out", str(tmp_path / "regime_map.png")]) == 0
    assert_same_table(GOLDEN / "expected" / "regimes" / "regime_map.csv", tmp_path / "regime_map.csv")


def test_the_comparison_notices_a_changed_number(tmp_path):
    expected = GOLDEN / "expected" / "study" / "gap_closed.csv"
    columns, rows = _read(expected)
    rows[0]["offline"] = str(float(rows[0]["offline"]) * (1 + 1e-4))  # beyond its 6 printed digits
    with open(tmp_path / "gap_closed.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)
    with pytest.raises(AssertionError, match="no row carries"):
        assert_same_table(expected, tmp_path / "gap_closed.csv")


# `humanline report --margin M`: every paired difference gains its 90% t-interval across seeds and the verdict
# of two one-sided t-tests at alpha 0.05 (equivalent within +-M when the interval lies inside [-M, +M]).
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
    with pytest.raises(SystemExit) as e:  # argparse's refusal, one line (test_report.py)
        main_report([str(GOLDEN / "study"), "--out", str(tmp_path), "--margin", "0"])
    assert e.value.code == 2
