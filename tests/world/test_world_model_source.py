"""The bundled world's model-sourced offline data (`task.world.offline.source=model`) on a tiny build."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from humanline_cli.core.batches import Seqs
from humanline_cli.core.interfaces import SamplingParams
from humanline_cli.core.logprobs import token_logps
from humanline_cli.sampling.hf import HFSampler
from humanline_cli.world import make as world_build
from humanline_cli.world import policy
from humanline_cli.world.cache import materialise
from humanline_cli.world.defaults import resolve
from humanline_cli.world.naming import WORLD_FILES, world_dir
from humanline_cli.world.rewards import score

N_TRAIN, N_EVAL, N_PER = 96, 32, 3
TINY_MODEL = {
    "kind": "arithmetic",
    "n_train_prompts": N_TRAIN,
    "n_eval_prompts": N_EVAL,
    "sft": {"steps": 40},
    "offline": {"source": "model", "n_per_prompt": N_PER, "other_sft": {"steps": 30}},
}


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _text(msgs):
    assert len(msgs) == 1 and msgs[0]["role"] == "assistant"
    return msgs[0]["content"]


@pytest.fixture(scope="session")
def model_world(tmp_path_factory):
    torch.set_num_threads(1)  # the test suite shares a small machine
    return materialise(TINY_MODEL, tmp_path_factory.mktemp("model-source-worlds"), progress=False)


def test_files_schema_and_labels(model_world):
    for name in WORLD_FILES:
        assert (model_world / name).exists(), name
    train = [r["prompt"][0]["content"] for r in _jsonl(model_world / "prompts_train.jsonl")]
    pairs = _jsonl(model_world / "offline_pairs.jsonl")
    groups = _jsonl(model_world / "offline_groups.jsonl")
    unpaired = _jsonl(model_world / "offline_unpaired.jsonl")
    assert len(train) == len(pairs) == len(groups) == N_TRAIN and len(unpaired) == N_TRAIN * N_PER
    assert all(set(p) == {"prompt", "chosen", "rejected", "score_chosen", "score_rejected"} for p in pairs)
    assert all(set(g) == {"prompt", "completions", "rewards"} for g in groups)
    assert all(set(u) == {"prompt", "completion", "label"} for u in unpaired)
    distinct = 0
    for i, (prompt, pair, group) in enumerate(zip(train, pairs, groups)):
        assert pair["prompt"] == group["prompt"] == [{"role": "user", "content": prompt}]
        replies = [_text(c) for c in group["completions"]]
        assert len(replies) == len(group["rewards"]) == N_PER
        distinct += len(set(replies)) == N_PER
        # labels are the task labeller's (arithmetic: the strict verifier) on the written replies
        assert group["rewards"] == score("arithmetic", "labeller", [prompt] * N_PER, replies)
        chosen, rejected = _text(pair["chosen"]), _text(pair["rejected"])
        assert chosen in replies and rejected in replies
        assert pair["score_chosen"] == score("arithmetic", "labeller", [prompt], [chosen])[0] == max(group["rewards"])
        assert pair["score_rejected"] == score("arithmetic", "labeller", [prompt], [rejected])[0] == min(group["rewards"])
        rows = unpaired[i * N_PER : (i + 1) * N_PER]
        assert [_text(u["completion"]) for u in rows] == replies and all(u["prompt"] == pair["prompt"] for u in rows)
        mean, tied = sum(group["rewards"]) / N_PER, len(set(group["rewards"])) == 1
        assert [u["label"] for u in rows] == [s >= 0.5 if tied else s > mean for s in group["rewards"]]
    assert distinct > N_TRAIN // 2  # distinct where the other model's samples allow
    info = json.loads((model_world / "world.json").read_text())
    assert info["offline_source"] == "model" and info["cfg"]["offline"]["source"] == "model"
    other = info["other_model"]
    assert other["sft_steps_run"] <= 30 and 0.0 <= other["base_metrics"]["sampled_accuracy"] <= 1.0
    assert {"greedy_accuracy", "sampled_accuracy", "greedy_eos_rate"} <= set(other["base_metrics"])
    assert info["offline_stats"]["groups_distinct"] == distinct / N_TRAIN


@torch.no_grad()
def _seq_logps(model, enc, prompts, replies) -> torch.Tensor:
    """Per-sequence log p(reply + EOS | prompt) under `model`."""
    rows = [(enc.prompt(p), enc.reply(r)) for p, r in zip(prompts, replies)]
    width = max(len(a) + len(b) for a, b in rows)
    ids = torch.tensor([a + b + [enc.pad] * (width - len(a) - len(b)) for a, b in rows])
    mask = torch.tensor([[1] * (len(a) + len(b)) + [0] * (width - len(a) - len(b)) for a, b in rows])
    comp = torch.tensor([[0] * len(a) + [1] * len(b) + [0] * (width - len(a) - len(b)) for a, b in rows]).bool()
    return token_logps(model, Seqs(ids, mask, comp)).sum(-1)


def test_offline_data_is_off_policy(model_world):
    """The written completions are less likely under the STARTING policy than its own T=1 samples."""
    tok = AutoTokenizer.from_pretrained(model_world / "policy")
    start = AutoModelForCausalLM.from_pretrained(model_world / "policy").eval()
    enc = policy.WorldCodec(tok)
    groups = _jsonl(model_world / "offline_groups.jsonl")
    prompts = [g["prompt"][0]["content"] for g in groups]
    offline_p = [p for p, g in zip(prompts, groups) for _ in g["completions"]]
    offline_r = [_text(c) for g in groups for c in g["completions"]]
    params = SamplingParams(n=N_PER, temperature=1.0, max_new_tokens=world_build.MAX_NEW["arithmetic"], seed=7)
    own_r = HFSampler(start, tok, batch_size=512).generate([enc.prompt(p) for p in prompts], params).texts
    own_p = [p for p in prompts for _ in range(N_PER)]
    offline_lp = _seq_logps(start, enc, offline_p, offline_r).mean().item()
    own_lp = _seq_logps(start, enc, own_p, own_r).mean().item()
    assert offline_lp < own_lp - 0.5, (offline_lp, own_lp)


def test_same_cfg_builds_identical_files(model_world, tmp_path):
    again = materialise(TINY_MODEL, tmp_path, progress=False)
    assert again.name == model_world.name
    for name in ("offline_pairs.jsonl", "offline_groups.jsonl", "offline_unpaired.jsonl", "policy/model.safetensors"):
        assert (again / name).read_bytes() == (model_world / name).read_bytes(), name


def test_sampling_is_seeded(model_world):
    tok = AutoTokenizer.from_pretrained(model_world / "policy")
    model = AutoModelForCausalLM.from_pretrained(model_world / "policy").eval()
    prompts = ["12+34=", "59+67=", "00+08=", "91+19="]
    first = world_build.sample_distinct("arithmetic", model, tok, prompts, 4, seed=3)
    assert first == world_build.sample_distinct("arithmetic", model, tok, prompts, 4, seed=3)
    assert [len(r) for r in first] == [4] * 4
    assert first != world_build.sample_distinct("arithmetic", model, tok, prompts, 4, seed=4)


def test_source_is_validated_and_rule_names_are_kept(tmp_path):
    with pytest.raises(ValueError, match="world.offline.source must be 'rule', 'model' or 'policy', not 'bogus'"):
        resolve({"kind": "arithmetic", "offline": {"source": "bogus"}})
    with pytest.raises(ValueError, match="source=rule"):
        resolve({"kind": "preference", "offline": {"source": "model", "style": "padded"}})
    with pytest.raises(ValueError, match="unknown key"):
        resolve({"kind": "arithmetic", "offline": {"other_sft": {"stpes": 3}}})
    # the rule world keeps the name it had before `source` existed (no rebuild of cached worlds),
    # and knobs only a model source reads do not rename it
    assert world_dir({"kind": "arithmetic"}, tmp_path).name == "arithmetic-5fd5f9a1fcb6"
    assert world_dir({"kind": "preference"}, tmp_path).name == "preference-a36a43a0847a"
    rule = world_dir({"kind": "arithmetic", "offline": {"source": "rule", "other_sft": {"steps": 9}}}, tmp_path)
    assert rule.name == "arithmetic-5fd5f9a1fcb6"
    model = world_dir({"kind": "arithmetic", "offline": {"source": "model"}}, tmp_path)
    assert model != rule and model != world_dir(
        {"kind": "arithmetic", "offline": {"source": "model", "other_sft": {"steps": 9}}}, tmp_path
    )
