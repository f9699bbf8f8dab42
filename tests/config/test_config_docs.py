"""The config reference (humanline_cli/docs/config.md) lists exactly the options conf/ has, for every group, and its
key tables are the ones generated from the schema (every key with its default and help)."""
from __future__ import annotations

import re
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path

from humanline_cli import docs_gen
from humanline_cli import schema as S
from humanline_cli.schema import knob

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


# ------------------------------------------------------------------ the key tables, generated from the schema
@dataclass
class _Inner:
    k: float = knob(0.5, "inner help")


@dataclass
class _A:
    x: int = knob(1, "x help")
    inner: _Inner = knob(factory=_Inner, help="a node")


@dataclass
class _B(_A):
    x: int = 2  # a changed default keeps the base's help
    y: str | None = knob(None, "y | z")


def test_the_generator_writes_each_key_with_its_default_and_help():
    assert docs_gen.rows("g", {"a": _A, "b": _B}) == [
        ("`g.x`", "a: `1`; b: `2`", "x help"),
        ("`g.inner.*`", "", "a node"),
        ("`g.inner.k`", "`0.5`", "inner help"),
        ("`g.y`", "`null`", "(b only) y | z"),
    ]
    assert docs_gen.table("t", [("`g.y`", "`null`", "y | z")]).splitlines()[-1] == "| `g.y` | `null` | y \\| z |"


def test_every_schema_key_has_its_help():
    missing = [f"{name}.{f.name}" for name, cls in vars(S).items() if isinstance(cls, type) and is_dataclass(cls)
               for f in fields(cls) if not docs_gen.help_of(cls, f.name)]
    assert missing == []


def test_the_committed_key_tables_are_the_generated_ones():
    text = DOC.read_text()
    assert docs_gen.render(text) == text, "docs/config.md is out of date: run python -m humanline_cli.docs_gen"
    assert "| `hl.sync_every` | `1` | optimizer steps between reference syncs" in text


def test_the_generator_rewrites_a_stale_doc_and_check_says_so(tmp_path, monkeypatch):
    stale = tmp_path / "config.md"
    stale.write_text(f"intro\n{docs_gen.BEGIN}\n| `hl.clamp` | `false` | stale help |\n{docs_gen.END}\noutro\n")
    monkeypatch.setattr(docs_gen, "DOC", stale)
    assert docs_gen.main(["--check"]) == 1
    assert docs_gen.main([]) == 0 and docs_gen.main(["--check"]) == 0
    text = stale.read_text()
    assert text.startswith(f"intro\n{docs_gen.BEGIN}\n\n#### `objective.*`") and text.endswith(f"{docs_gen.END}\noutro\n")
    assert "| `hl.clamp` | `true` | clamp each token's log-ratio" in text and "stale help" not in text
