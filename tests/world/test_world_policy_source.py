"""Self-sampled offline data in the bundled world (`task.world.offline.source=policy`): the
starting policy's own T=1 samples, scored by the labeller, best vs worst (the paper's instruction-following
offline set, llama3-ultrafeedback-armorm, is Llama-3-8B-Instruct's own samples scored by ArmoRM)."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from humanline_cli.world import make as world_build
from humanline_cli.world.cache import materialise
from humanline_cli.world.defaults import resolve
from humanline_cli.world.naming import hash_view
from humanline_cli.world.rewards import score
from humanline_cli.world.tokenizer import build_tokenizer

N_TRAIN, N_PER = 64, 4
TINY = {"kind": "arithmetic", "n_train_prompts": N_TRAIN, "n_eval_prompts": 32, "sft": {"steps": 40},
        "offline": {"source": "policy", "n_per_prompt": N_PER}}


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_policy_sourced_offline_data_are_the_starting_policys_samples(tmp_path):
    torch.set_num_threads(1)
    world = materialise(TINY, tmp_path / "worlds", progress=False)
    train = [r["prompt"][0]["content"] for r in _jsonl(world / "prompts_train.jsonl")]
    groups, pairs = _jsonl(world / "offline_groups.jsonl"), _jsonl(world / "offline_pairs.jsonl")
    replies = [[c[0]["content"] for c in g["completions"]] for g in groups]
    # exactly the saved starting policy's samples (n independent draws, duplicates kept), seeded by the world
    model = AutoModelForCausalLM.from_pretrained(world / "policy").eval()
    full = resolve(TINY)
    again = world_build.sample_iid("arithmetic", model, build_tokenizer(full["format"]), train, N_PER,
                                   world_build._int_seed(f"{full['seed']}:policy:sample"))
    assert replies == again and len(replies) == N_TRAIN and all(len(r) == N_PER for r in replies)
    for prompt, reps, g, p in zip(train, replies, groups, pairs):
        assert g["rewards"] == score("arithmetic", "labeller", [prompt] * N_PER, reps)
        assert (p["score_chosen"], p["score_rejected"]) == (max(g["rewards"]), min(g["rewards"]))
    # a starting policy at ~0.5-0.7 accuracy: both right and wrong replies among its own samples
    rewards = [x for g in groups for x in g["rewards"]]
    assert 0.0 < sum(rewards) / len(rewards) < 1.0
    info = json.loads((world / "world.json").read_text())
    assert info["offline_source"] == "policy" and "other_model" not in info
    # other_sft does nothing here: left out of the world's name; the source is in it
    assert "other_sft" not in hash_view(full)["offline"] and hash_view(full)["offline"]["source"] == "policy"
    with pytest.raises(ValueError, match="source=rule"):
        resolve({"kind": "arithmetic", "offline": {"source": "policy", "style": "padded"}})
