"""One source of truth for every default: the schema dataclasses (humanline_cli/schema.py).

- Option files (conf/<group>/*.yaml) and conf/train.yaml say only what differs from the schema: a key
  restating the schema's default is a second declaration that silently wins when the schema changes.
- The bundled world's knobs are typed in the schema (None = the world kind's default) and valued in one
  place, humanline_cli/world/defaults.py: the task files name the kind only.
- The specs derived from the config (TrainSpec, RunSpec, HumanlineSpec, LLMJudgeSpec, AlpacaEvalSpec) take their
  defaults from the schema classes (TrainSpec, HumanlineSpec and the judge specs extend them), never from a literal
  of their own.
"""
from __future__ import annotations

import ast
import dataclasses
import enum
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_module
from omegaconf import MISSING

from humanline_cli import schema as S
from humanline_cli.config import resolve
from humanline_cli.world.defaults import DEFAULTS
from humanline_cli.world.defaults import resolve as resolve_world

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "humanline_cli"


def _defaults(cls) -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default.value if isinstance(f.default, enum.Enum) else f.default
        elif f.default_factory is not dataclasses.MISSING:
            v = f.default_factory()
            out[f.name] = ("node", type(v)) if dataclasses.is_dataclass(v) else v
    return out


def _restated(node: dict, cls, path: list[str]) -> list[str]:
    found = []
    d = _defaults(cls)
    for k, v in (node or {}).items():
        if k == "defaults" or k not in d:
            continue
        if isinstance(d[k], tuple) and d[k][:1] == ("node",):
            if isinstance(v, dict):
                found += _restated(v, d[k][1], path + [k])
        elif d[k] is not MISSING and v == d[k]:
            found.append(".".join(path + [k]) + f"={v!r}")
    return found


def _option_files():
    for f in sorted((ROOT / "conf").glob("*/*.yaml")):
        group = f.parent.name
        if group in S.GROUP_SCHEMAS:
            options = S.GROUP_SCHEMAS[group]
            yield f, options.get(f.stem) or next(iter(options.values())), [group]
    yield ROOT / "conf" / "train.yaml", S.RootConfig, []


def test_the_restatement_finder_finds_one():
    assert _restated({"beta": 0.1, "batch_size": 64, "lora": {"r": 0}}, S.DPOConfig, ["objective"]) == [
        "objective.beta=0.1"]
    assert _restated({"lora": {"r": 0, "alpha": 8.0}}, S.ModelConfig, ["model"]) == ["model.lora.r=0"]


def test_no_option_file_restates_a_schema_default():
    restated = [f"{f.relative_to(ROOT)}: {k}" for f, cls, path in _option_files()
                for k in _restated(yaml.safe_load(f.read_text()), cls, path)]
    assert restated == []


@pytest.mark.parametrize("kind", sorted(DEFAULTS))
def test_world_knobs_live_in_the_world_defaults_only(kind):
    """The task file names the kind; the composed world resolves to exactly the kind's defaults."""
    assert yaml.safe_load((ROOT / "conf" / "task" / f"{kind}.yaml").read_text())["world"] == {"kind": kind}
    with initialize_config_module(config_module="conf", version_base="1.3"):
        spec = resolve(compose("train", overrides=[f"task={kind}"]))
    assert resolve_world(spec.task_cfg.world) == resolve_world({"kind": kind}) == DEFAULTS[kind]

    def leaves(node, path=""):
        return [p for k, v in node.items() for p in
                (leaves(v, f"{path}{k}.") if isinstance(v, dict) else [f"{path}{k}"])]

    assert leaves(spec.task_cfg.world) == ["kind"]  # only the knobs someone set travel on


def test_world_knobs_are_typed_at_composition():
    from hydra.errors import HydraException

    with initialize_config_module(config_module="conf", version_base="1.3"):
        spec = resolve(compose("train", overrides=["task.world.sft.steps=40"]))
        assert spec.task_cfg.world["sft"] == {"steps": 40}
        with pytest.raises(HydraException):
            compose("train", overrides=["task.world.sft.stepz=40"])   # a typo is an unknown key
        with pytest.raises(HydraException):
            compose("train", overrides=["task.world.sft.steps=abc"])  # and a wrong type is refused


SPECS = {  # derived spec class (module) -> the schema class holding its defaults
    ("config.py", "TrainSpec"): S.TrainConfig,
    ("config.py", "RunSpec"): S.RootConfig,
    ("core/humanline.py", "HumanlineSpec"): S.HumanlineConfig,
    ("rewards/llm_judge.py", "LLMJudgeSpec"): S.JudgeConfig,
    ("rewards/alpaca.py", "AlpacaEvalSpec"): S.JudgeConfig,
}
# Fields whose meaning differs from the schema key of the same name (so a default of their own is right):
# HumanlineSpec.clamp/sync are "on in this run" (+humanline=true and hl.clamp), false unless validate says so.
OWN_MEANING = {("HumanlineSpec", "clamp"), ("HumanlineSpec", "sync")}


def _is_literal(node) -> bool:
    """A number, string, bool or None written out (the schema's value would be `SchemaClass.key`)."""
    if isinstance(node, ast.UnaryOp):
        node = node.operand
    return isinstance(node, ast.Constant)


@pytest.mark.parametrize("where", sorted(SPECS), ids=lambda w: w[1])
def test_derived_specs_take_their_defaults_from_the_schema(where):
    module, name = where
    schema_fields = {f.name for f in dataclasses.fields(SPECS[where])}
    tree = ast.parse((PKG / module).read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)
    literal = [st.target.id for st in cls.body
               if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.value is not None
               and st.target.id in schema_fields and (name, st.target.id) not in OWN_MEANING
               and _is_literal(st.value)]
    assert literal == [], f"{name}: defaults declared again instead of taken from {SPECS[where].__name__}"
