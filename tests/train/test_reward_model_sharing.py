"""Reward models on a rank: a labeller and a judge naming the same model share one loaded copy (an 8B ArmoRM is
~16 GB), and the memory estimate counts the reward models each rank loads (the labeller everywhere online, a
reward-model judge on rank 0 only)."""
from __future__ import annotations

import json

import torch

from tests.helpers.models import build_tiny_reward_model, two_layer_llama

# the tiny reward model's parameters (conftest.build_tiny_reward_model: vocab 52, hidden 64, intermediate 128,
# 2 layers, 2 heads of 32, 2 kv heads, one label, untied, no biases), counted by hand:
#   embeddings 52*64 = 3,328; per layer q,k,v,o 4*64*64 = 16,384 + gate,up,down 3*64*128 = 24,576 + two norms 128
#   = 41,088, x2 = 82,176; final norm 64; score head 64*1 = 64  -> 85,632 parameters, float32: 342,528 bytes
RM_BYTES = 85_632 * 4


def _spec(tmp_path, *extra):
    from hydra import compose, initialize_config_module

    from humanline_cli.config import resolve

    with initialize_config_module(config_module="conf", version_base="1.3"):
        return resolve(compose("train", overrides=[
            "task=custom", f"model.name_or_path={tmp_path / 'policy'}", "chat_template=false", "data=online",
            f"task.prompts.train={tmp_path / 'prompts.jsonl'}", f"task.prompts.eval={tmp_path / 'prompts.jsonl'}",
            "task.labeller.kind=model", f"task.labeller.name_or_path={tmp_path / 'rm'}", "task.labeller.batch_size=3",
            "task.judge.kind=model", f"task.judge.name_or_path={tmp_path / 'rm'}", "train.max_length=64",
            "train.max_prompt_length=32", "eval.max_new_tokens=8", "data.max_new_tokens=8", "threads=1", *extra]))


def _world(tmp_path):
    _, tok = build_tiny_reward_model(tmp_path / "rm")
    two_layer_llama(tok, 64).save_pretrained(tmp_path / "policy")
    tok.save_pretrained(tmp_path / "policy")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["1+2=", "3+4="]))


def test_a_labeller_and_a_judge_naming_one_reward_model_load_it_once(tmp_path, monkeypatch):
    import humanline_cli.rewards.reward_model as rm_mod
    from humanline_cli.train.build import build_parts
    from humanline_cli.train.timing import PhaseTimer

    _world(tmp_path)
    built = []
    real = rm_mod.RewardModel

    class Counted(real):
        def __init__(self, *a, **k):
            built.append(a[0])
            super().__init__(*a, **k)

    monkeypatch.setattr(rm_mod, "RewardModel", Counted)
    parts = build_parts(_spec(tmp_path), PhaseTimer(), tmp_path)
    try:
        labeller, judge = parts.source.labeller, parts.evaluator.judge
        assert built == [str(tmp_path / "rm")]  # one load for both roles
        assert labeller.model is judge.model and labeller.tok is judge.tok
        assert (labeller.batch_size, judge.batch_size) == (3, 16)  # each role keeps its own batch size
        assert parts.memory.reward == RM_BYTES  # one copy counted, not two
        assert labeller(["1+2="], ["3"]) == judge(["1+2="], ["3"])
    finally:
        parts.close()


def test_the_estimate_counts_the_reward_models_each_rank_loads(tmp_path):
    from humanline_cli.memory import GB, check_fits
    from humanline_cli.train.fit import memory_estimate

    _world(tmp_path)
    policy = str(tmp_path / "policy")
    cpu = torch.device("cpu")
    both = _spec(tmp_path)
    none = _spec(tmp_path, "task.labeller.kind=verifier", "task.judge.kind=verifier")
    base = memory_estimate(none, policy, cpu)
    assert base.reward == 0.0
    est = memory_estimate(both, policy, cpu, rank=0)
    assert est.reward == RM_BYTES and est.steady == base.steady + RM_BYTES
    assert est.total == base.total + RM_BYTES and f"reward models {RM_BYTES / GB:.2f}" in est.describe()
    assert memory_estimate(both, policy, cpu, rank=1).reward == RM_BYTES  # the labeller: every rank labels
    # a judge alone loads on rank 0 only; a second model (the labeller elsewhere) is a second copy
    judge_only = _spec(tmp_path, "task.labeller.kind=verifier")
    assert memory_estimate(judge_only, policy, cpu, rank=0).reward == RM_BYTES
    assert memory_estimate(judge_only, policy, cpu, rank=1).reward == 0.0
    # the check refuses a device that holds the run without its reward model but not with it
    device = (base.total + RM_BYTES / 2) / 0.9
    assert check_fits(base, device) is None
    assert "reward models 0.0" in check_fits(est, device)
