"""The config reference (humanline_cli/docs/config.md) lists exactly the options conf/ has, for every group."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "humanline_cli" / "docs" / "config.md"
NOT_GROUPS = ("hydra",)  # Hydra's own launcher presets (docs/scaling.md), not a group of humanline's


def documented_options(text: str) -> dict[str, set[str]]:
    """group -> the backticked names in its row's options cell (rows `| \\`group\\` | options | meaning |`)."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"`\w+`", cells[0]) and cells[1]:
            rows[cells[0].strip("`")] = set(re.findall(r"`([^`]+)`", cells[1]))
    return rows


def conf_options() -> dict[str, set[str]]:
    return {d.name: {f.stem for f in d.glob("*.yaml")} for d in sorted((ROOT / "conf").iterdir())
            if d.is_dir() and not d.name.startswith("_") and d.name not in NOT_GROUPS}


def test_the_row_parser_reads_a_row():
    row = "| `regime` | `offline`, `hl` (humanline), `stale16` | named regimes (`conf/regime/`) |"
    assert documented_options(row) == {"regime": {"offline", "hl", "stale16"}}


def test_docs_list_every_option_of_every_group():
    documented, actual = documented_options(DOC.read_text()), conf_options()
    assert {g: documented.get(g) for g in actual} == actual
