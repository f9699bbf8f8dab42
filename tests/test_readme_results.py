"""Every estimate in the README's results table is one docs/results.md reports, mean and interval together (the
README summarises, never computes)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NUM = r"[+-]?\d+(?:\.\d+|%)"
ESTIMATE = re.compile(rf"{NUM}(?: \[{NUM}, {NUM}\])?")


def _results_rows() -> list[str]:
    section = (ROOT / "README.md").read_text().split("## Results\n", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| study")]


def test_every_estimate_in_the_readme_results_table_is_in_results_md():
    results = (ROOT / "humanline_cli" / "docs" / "results.md").read_text()
    results += "\n" + results.replace("**", "").replace(" | [", " [")  # tables there: bold, mean and interval in two columns
    rows = _results_rows()
    assert len(rows) >= 6
    for row in rows:
        cells = "|".join(row.split("|")[3:])  # the study and comparison cells name settings (lr 3e-5), not results
        estimates = ESTIMATE.findall(cells)
        assert estimates, row
        for est in estimates:
            # results.md may drop a leading + on a mean ("0.093" for "+0.093")
            assert est in results or est.lstrip("+") in results, f"{est!r} (README: {row[:50]!r}) is not in results.md"
