"""An objective is one module under humanline_cli/core/objectives/ and one conf/objective/NAME.yaml: nothing outside
core/ names an objective to branch on, and an objective the package has never seen (defined here, registered, with
its option file in a config dir of its own) trains through `humanline train`."""
from __future__ import annotations

import ast
import json
import math
import subprocess
import sys
from pathlib import Path

from humanline_cli.core import objectives
from tests.helpers.cli import FAST, TINY_WORLD

PKG = Path(__file__).resolve().parents[2] / "humanline_cli"

# modules outside core/ that may name objectives: none (TRL's peers live with each objective: Objective.trl_peer)
NAMED_ON_PURPOSE: set[str] = set()


def _names_in(node: ast.AST, names: set[str]) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in names
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_in(e, names) for e in node.elts)
    return False


def _names_objective(node: ast.AST, names: set[str]) -> bool:
    match node:
        case ast.Compare():
            return any(_names_in(n, names) for n in [node.left, *node.comparators])
        case ast.MatchValue():
            return _names_in(node.value, names)
        case ast.Dict():
            return any(k is not None and _names_in(k, names) for k in node.keys)
        case ast.Tuple() | ast.List() | ast.Set():
            return _names_in(node, names)
    return False


def objective_literals(source: str, names: set[str]) -> list[int]:
    """Lines where a string naming an objective is compared with, matched on, keys a dict or sits in a literal
    tuple / list / set: the ways code branches on or enumerates objectives by name."""
    return sorted({node.lineno for node in ast.walk(ast.parse(source)) if _names_objective(node, names)})


def test_the_scan_sees_each_way_of_naming_an_objective():
    names = {"dpo", "kto"}
    src = ('if cfg.name == "kto": pass\nmatch o:\n    case "dpo": pass\nd = {"dpo": 1}\nfor o in ("dpo", "kto"): pass\n'
           'x = "objective=kto needs more"\nif o in ("kto",): pass\n')
    assert objective_literals(src, names) == [1, 3, 4, 5, 7]


def test_nothing_outside_core_branches_on_an_objective_name():
    names = set(objectives.OBJECTIVES)
    found = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel.startswith("core/") or rel in NAMED_ON_PURPOSE:
            continue
        lines = objective_literals(path.read_text(), names)
        if lines:
            found[rel] = lines
    assert found == {}, "look the objective up in humanline_cli.core.objectives.OBJECTIVES instead"


def test_every_registered_objective_has_its_option_file_and_schema():
    from humanline_cli import schema as S

    conf = PKG.parent / "conf" / "objective"
    assert sorted(p.stem for p in conf.glob("*.yaml")) == sorted(objectives.OBJECTIVES)
    for name, objective in objectives.OBJECTIVES.items():
        assert S.GROUP_SCHEMAS["objective"][name] is objective.config and objective.config().name == name
        assert objectives.PROPERTIES[name] is objective.properties
        assert f"/schema/objective/{name}@_here_" in (conf / f"{name}.yaml").read_text()


# A hinge on the DPO margin (SLiC's calibration loss) with a key of its own, written as a core module would be
TOY = r'''
import sys
from dataclasses import dataclass

import torch

from humanline_cli.core import objectives
from humanline_cli.core.knobs import knob
from humanline_cli.core.logprobs import masked_sum
from humanline_cli.core.objectives.dpo import PairObjective


@dataclass
class HingeConfig(objectives.ObjectiveConfig):
    name: str = "toy_hinge"
    margin: float = knob(1.0, "the hinge's margin")


class Hinge(PairObjective):
    name = "toy_hinge"
    config = HingeConfig

    def pair_loss(self, cfg, tl_chosen, mask_chosen, tl_rejected, mask_rejected):
        d = cfg.beta * (masked_sum(tl_chosen, mask_chosen) - masked_sum(tl_rejected, mask_rejected))
        return torch.relu(cfg.margin - d).mean(), {"toy_hinge/margin": float(d.detach().mean())}


objectives.register(Hinge())

import humanline_cli
from humanline_cli.cli.main import main

sys.argv = [humanline_cli.__file__, *sys.argv[1:]]
main()
'''


def test_an_objective_defined_outside_the_package_trains(tmp_path, cache_dir):
    conf = tmp_path / "my_conf" / "objective"  # not "conf": the run's cwd is on sys.path and would shadow the package's
    conf.mkdir(parents=True)
    (conf / "toy_hinge.yaml").write_text("defaults:\n  - /schema/objective/toy_hinge@_here_\n  - _self_\nmargin: 2.0\n")
    run = tmp_path / "run"
    args = ["train", *TINY_WORLD, *FAST, "train.steps=2", "eval.n_prompts=4", "backend=cpu", "wandb.mode=disabled",
            "objective=toy_hinge", f"hydra.searchpath=[file://{tmp_path / 'my_conf'}]", f"hydra.run.dir={run}"]
    r = subprocess.run([sys.executable, "-c", TOY, *args], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(math.isfinite(row["loss"]) and "toy_hinge/margin" in row for row in rows)
    # the option file's key reached the loss: at step 1 the policy is the reference, so d = 0 and loss = margin
    assert abs(rows[0]["loss"] - 2.0) < 1e-4
    summary = json.loads((run / "summary.json").read_text())
    assert summary["objective"] == "toy_hinge" and summary["batch_unit"] == "pairs"


# DPO under another name, as a new objective module would define it: PairObjective with DPO's loss, no TRL peer
TOY_DPO = r"""
import sys
from dataclasses import dataclass

from humanline_cli.core import objectives
from humanline_cli.core.objectives.dpo import PairObjective, dpo_loss


@dataclass
class ToyConfig(objectives.ObjectiveConfig):
    name: str = "toy_dpo"


class ToyDPO(PairObjective):
    name = "toy_dpo"
    config = ToyConfig
    pair_fn = dpo_loss


objectives.register(ToyDPO())

import humanline_cli
from humanline_cli.cli.main import main

sys.argv = [humanline_cli.__file__, *sys.argv[1:]]
main()
"""


def test_a_copy_of_dpo_under_another_name_trains_benches_and_reports(tmp_path, cache_dir):
    """Nothing outside core/ and conf/ names the new objective, yet `humanline train`, `bench` (its TRL rows skipped
    with a note: it has no TRL peer) and `report` all take it."""
    assert not [p for p in PKG.rglob("*.py") if "toy_dpo" in p.read_text()]
    conf = tmp_path / "my_conf" / "objective"
    conf.mkdir(parents=True)
    (conf / "toy_dpo.yaml").write_text("defaults:\n  - /schema/objective/toy_dpo@_here_\n  - _self_\n")
    common = ["objective=toy_dpo", f"hydra.searchpath=[file://{tmp_path / 'my_conf'}]", *TINY_WORLD]

    def cli(*args):
        r = subprocess.run([sys.executable, "-c", TOY_DPO, *args], cwd=tmp_path, capture_output=True, text=True,
                           timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        return r

    run = tmp_path / "runs" / "toy"
    cli("train", *common, *FAST, "train.steps=2", "eval.n_prompts=4", "backend=cpu", "wandb.mode=disabled",
        f"hydra.run.dir={run}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows and "dpo/margin" in rows[0]
    assert abs(rows[0]["loss"] - math.log(2)) < 1e-4  # step 1: policy == reference, DPO's ln 2
    out = tmp_path / "bench.json"
    cli("bench", *common, "steps=1", "warmup=1", "repeats=1", "batch_size=8", "threads=1", "trl=auto", f"out={out}")
    res = json.loads(out.read_text())
    assert res["objective"] == "toy_dpo" and res["unit"] == "pairs"
    assert set(res["rows"]) == {"project", "project_humanline", "project_cached"}
    assert res["trl_note"] == "objective=toy_dpo has no counterpart in TRL: its TRL rows are skipped"
    cli("report", str(tmp_path / "runs"))
    report = (tmp_path / "runs" / "report.csv").read_text().splitlines()
    assert len(report) == 2 and ",toy_dpo," in report[1]
