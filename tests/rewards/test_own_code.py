"""A checkpoint that names its own code (config.json `auto_map`) while remote code is off. ArmoRM, the paper's
labeller and judge, says `model_type: llama`, so transformers would quietly build its own
LlamaForSequenceClassification instead (random `score` head, ArmoRM's heads dropped): such a reward model is refused
before any weight loads, in one line naming the key to set; and every documented command of the experiment that
uses ArmoRM carries both keys, since remote code runs only where the user opts in."""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from humanline_cli.errors import UserError
from humanline_cli.rewards import reward_model
from humanline_cli.rewards.scorers import make_scorer
from tests.helpers.models import tiny_llama

ROOT = Path(__file__).resolve().parents[2]
TRUST = ("task.labeller.trust_remote_code=true", "task.judge.trust_remote_code=true")


def _own_code_checkpoint(path: Path, head, auto_class: str, **overrides) -> Path:
    """A tiny Llama (and a tokenizer) saved with ArmoRM's config layout: model_type llama, plus an auto_map naming its
    own class."""
    from humanline_cli.world.tokenizer import build_tokenizer

    tiny_llama(0, head, **overrides).save_pretrained(path, safe_serialization=True)
    build_tokenizer().save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["LlamaForRewardModelWithGating"],
                  auto_map={auto_class: "modeling_custom.LlamaForRewardModelWithGating"})
    (path / "config.json").write_text(json.dumps(config))
    assert config["model_type"] == "llama"
    return path


@pytest.fixture
def armorm_like(tmp_path) -> Path:
    from transformers import LlamaModel

    return _own_code_checkpoint(tmp_path / "armorm", LlamaModel, "AutoModelForSequenceClassification")


def test_a_reward_model_naming_its_own_code_is_refused_before_its_weights_load(armorm_like, monkeypatch):
    def loaded(*a, **k):
        raise AssertionError("the weights were read")

    monkeypatch.setattr(reward_model.AutoModelForSequenceClassification, "from_pretrained", loaded)
    with pytest.raises(UserError) as e:
        make_scorer({"kind": "model", "name_or_path": str(armorm_like)}, key="task.judge")
    assert str(e.value) == (f"reward model {armorm_like} needs its own code to load (config.json auto_map); if you "
                            f"trust it, set task.judge.trust_remote_code=true")


def test_the_estimate_refuses_it_first_naming_every_key_that_loads_it(armorm_like):
    """The memory estimate reads each reward model's config before any weight loads: the run stops there."""
    from humanline_cli.train import fit

    armorm = dict(kind="model", name_or_path=str(armorm_like), trust_remote_code=False)
    spec = SimpleNamespace(regime="online", reward_cfg=SimpleNamespace(kind="task"), judge_cfg=SimpleNamespace(kind="task"),
                           task_cfg=SimpleNamespace(labeller=SimpleNamespace(**armorm), judge=SimpleNamespace(**armorm)))
    assert fit.reward_models_on_rank(spec, 0) == {(str(armorm_like), False): ["task.labeller", "task.judge"]}
    assert fit.reward_models_on_rank(spec, 1) == {(str(armorm_like), False): ["task.labeller"]}
    with pytest.raises(UserError) as e:
        fit._reward_bytes(spec, 0)
    assert str(e.value) == (f"reward model {armorm_like} needs its own code to load (config.json auto_map); if you "
                            f"trust it, set {TRUST[0]} and {TRUST[1]}")


def test_a_policy_the_library_class_cannot_fill_names_the_trust_key(tmp_path):
    """A causal LM with its own code is loaded by the library's class where transformers knows its model_type (as
    for checkpoints that later moved into transformers); where weights are then missing, the line says which key
    would run its own code instead."""
    from transformers import LlamaModel

    from humanline_cli.models import load_policy

    path = _own_code_checkpoint(tmp_path / "own", LlamaModel, "AutoModelForCausalLM", tie_word_embeddings=False)
    with pytest.raises(UserError) as e:
        load_policy(str(path), torch.device("cpu"))
    line = str(e.value)
    assert "lm_head.weight" in line and "\n" not in line
    assert line.endswith("; its config.json auto_map names its own code: if you trust it, set "
                         "model.trust_remote_code=true")


def _train_commands(text: str) -> list[str]:
    """The inline `humanline train ...` commands, line by line (a fenced block's backticks pair up on no line)."""
    return [c for line in text.splitlines() for c in re.findall(r"`([^`]+)`", line)
            if re.search(r"(^humanline train\b)|(-m humanline_cli train\b)", c)]


def test_every_documented_armorm_command_opts_in_to_its_code():
    docs = [ROOT / "README.md", *sorted((ROOT / "humanline_cli" / "docs").glob("*.md"))]
    cmds = [c for p in docs for c in _train_commands(p.read_text())
            if "experiment=paper_instruction_following" in c or "task=ultrafeedback" in c]
    assert len(cmds) >= 4  # README's and scaling.md's rows, scaling.md's paper-scale line
    assert [c for c in cmds if not all(k in c.split() for k in TRUST)] == []
    # the experiment file keeps remote code off: a command without the keys is refused before any weight loads
    exp = (ROOT / "conf" / "experiment" / "paper_instruction_following.yaml").read_text()
    assert "trust_remote_code: false" in exp and "trust_remote_code: true" not in exp
