"""Every default docs/config.md states is the value the config composes: for each option of each group
(objective=kto gives objective.batch_size 64, data=online data.min_gap 0.01, task=math its lengths), and the root's
sections as `humanline train` composes them. The values are compared as written (interpolations kept): the table
cell names the option's value, or the common one that every option it does not name has."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from humanline_cli import schema as S
from humanline_cli.config import compose_train
from humanline_cli.docs_gen import ROOT_SECTIONS, fmt

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "humanline_cli" / "docs" / "config.md"


def documented() -> dict[str, str]:
    """key -> its default cell, over every key table."""
    out = {}
    for line in DOC.read_text().splitlines():
        m = re.fullmatch(r"\| `([\w.]+)` \| (.*?) \| .*\|", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def for_option(cell: str, option: str) -> str:
    """The default a cell states for `option`: its own `option: value`, else the cell's bare (common) value."""
    if cell == "the option's name":
        return fmt(option)
    entries = cell.split("; ")
    own = [e.split(": ", 1)[1] for e in entries if e.startswith(f"{option}: ")]
    bare = [e for e in entries if not re.match(r"[\w-]+: `", e)]
    assert own or bare, (cell, option)
    return (own or bare)[0]


def test_the_cell_reader_reads_each_form():
    assert for_option("`32`; kto: `64`", "kto") == "`64`" and for_option("`32`; kto: `64`", "dpo") == "`32`"
    assert for_option("offline: `0.0`; online: `0.01`", "online") == "`0.01`"
    assert for_option("the option's name", "math") == "`math`"


def _flat(node, prefix: str) -> dict:
    out = {}
    for k, v in node.items():
        if isinstance(v, dict) and v and k != "columns":
            out.update(_flat(v, f"{prefix}.{k}"))
        else:
            out[f"{prefix}.{k}"] = v
    return out


def _composed(overrides: list[str], key: str) -> dict:
    cfg = compose_train(overrides)
    return _flat(OmegaConf.to_container(cfg[key], resolve=False, enum_to_str=True), key)


GROUP_OPTIONS = [(g, f.stem) for g in S.GROUP_SCHEMAS for f in sorted((ROOT / "conf" / g).glob("*.yaml"))]


@pytest.mark.parametrize("group,option", GROUP_OPTIONS)
def test_each_documented_group_default_is_what_the_option_composes(group, option):
    doc = {k: v for k, v in documented().items() if k.startswith(f"{group}.")}
    composed = _composed([f"{group}={option}"], group)
    checked = {k: (for_option(cell, option), fmt(composed[k])) for k, cell in doc.items() if k in composed}
    assert {k: got for k, (want, got) in checked.items() if want != got} == \
        {k: want for k, (want, got) in checked.items() if want != got}
    assert len(checked) >= 3  # name and at least two keys of every group


def test_kto_batch_size_and_online_min_gap_are_documented_as_composed():
    doc = documented()
    assert for_option(doc["objective.batch_size"], "kto") == "`64`"
    assert for_option(doc["objective.batch_size"], "dpo") == "`32`"
    assert for_option(doc["data.min_gap"], "online") == "`0.01`"
    assert for_option(doc["data.min_gap"], "offline") == "`0.0`"


def test_each_documented_root_default_is_what_train_composes():
    doc = documented()
    cfg = OmegaConf.to_container(compose_train([]), resolve=False, enum_to_str=True)
    cfg.pop("hydra", None)
    plain = {k: v for k, v in cfg.items() if k not in S.GROUP_SCHEMAS and k not in ROOT_SECTIONS}
    composed = {f"{k}": v for k, v in plain.items()}
    for section in ROOT_SECTIONS:
        if isinstance(cfg.get(section), dict):
            composed.update(_flat(cfg[section], section))
    checked = {k: (doc[k], fmt(v)) for k, v in composed.items() if k in doc}
    assert {k: w for k, (w, g) in checked.items() if w != g} == {k: g for k, (w, g) in checked.items() if w != g}
    assert {"train.batch_size", "train.max_length", "eval.max_new_tokens", "wandb.mode", "world_cache"} <= set(checked)
    assert doc["train.batch_size"] == "`${objective.batch_size}`"
