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
STUDY_CSVS = ("report.csv", "gap_closed.csv", "cost.csv", "predicted.csv", "async.csv")
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
    assert main_report([str(root), "--out", str(out), "--target", str(root / "constants.json"),
                        "--target", "h100"]) == 0
    return out


@pytest.mark.parametrize("name", STUDY_CSVS)
def test_study_csvs_carry_the_golden_numbers(study, name):
    assert_same_table(GOLDEN / "expected" / "study" / name, study / name)


def test_regime_sweep_csvs_carry_the_golden_numbers(tmp_path):
    from humanline_cli.report.regime_map import main

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
