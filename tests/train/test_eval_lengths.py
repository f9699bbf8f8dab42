"""Evaluation only samples, so its budget (train.max_prompt_length + eval.max_new_tokens, and eval.math500's) is
bounded by the model's positions and, online, by vLLM's max_model_len, not by train.max_length: the paper's
AlpacaEval generation (prompt 1024 + up to 2048 new tokens, T 0.7, top_p 0.95) is experiment=
paper_instruction_following's default while it trains at 2048 tokens."""
from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module

from humanline_cli.config import resolve
from humanline_cli.errors import UserError


def _spec(overrides):
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return resolve(compose("train", overrides=overrides))


@pytest.mark.parametrize("regime", ["offline", "online"])
def test_paper_instruction_following_evaluates_as_the_paper(regime):
    s = _spec(["experiment=paper_instruction_following", f"data={regime}"])
    e = s.eval_cfg
    assert (e.n_prompts, e.temperature, e.top_p, e.max_new_tokens) == (805, 0.7, 0.95, 2048)
    assert (s.train.max_length, s.train.max_prompt_length) == (2048, 1024)
    assert s.backend_cfg.device.value == "cuda"
    if regime == "online":  # unset max_model_len: the longest sequence vLLM samples, 1024 + 2048
        assert s.sampler_cfg.max_model_len == 3072


def test_eval_budget_past_train_max_length_is_bounded_by_the_models_positions(tmp_path):
    from transformers import LlamaConfig

    from humanline_cli.train.lengths import check_model_lengths

    LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=1,
                max_position_embeddings=256).save_pretrained(tmp_path)
    base = ["task=custom", f"model.name_or_path={tmp_path}", "data.path=x.jsonl", "task.prompts.eval=e.jsonl",
            "task.judge.kind=verifier", "train.max_length=128", "train.max_prompt_length=64"]
    check_model_lengths(_spec([*base, "eval.max_new_tokens=192"]), str(tmp_path))  # 64 + 192 = 256 fits
    with pytest.raises(UserError) as e:
        check_model_lengths(_spec([*base, "eval.max_new_tokens=193"]), str(tmp_path))
    assert str(e.value).startswith("train.max_prompt_length (64) + eval.max_new_tokens (193) > the model's "
                                   "max_position_embeddings (256, ")
    # eval.math500's own budget too, with no judge at all
    with pytest.raises(UserError) as e:
        check_model_lengths(_spec([*base, "task.judge.kind=none", "eval.math500.prompts=m.jsonl",
                                   "eval.math500.max_new_tokens=300"]), str(tmp_path))
    assert str(e.value).startswith("train.max_prompt_length (64) + eval.math500.max_new_tokens (300) > the model's")


def test_vllm_max_model_len_follows_the_sampling_budgets():
    base = ["task=custom", "model.name_or_path=m", "data=online", "task.prompts.train=p.jsonl",
            "task.labeller.kind=verifier", "sampler=vllm", "train.max_length=256", "train.max_prompt_length=128",
            "data.max_new_tokens=64"]
    assert _spec(base).sampler_cfg.max_model_len == 256  # training lengths are the longest
    s = _spec([*base, "task.prompts.eval=e.jsonl", "task.judge.kind=verifier", "eval.max_new_tokens=300"])
    assert s.sampler_cfg.max_model_len == 428
    s = _spec([*base, "eval.math500.prompts=m.jsonl", "eval.math500.max_new_tokens=500"])
    assert s.sampler_cfg.max_model_len == 628
    with pytest.raises(UserError) as e:
        _spec([*base, "eval.math500.prompts=m.jsonl", "eval.math500.max_new_tokens=500", "sampler.max_model_len=600"])
    assert str(e.value).startswith("sampler.max_model_len (600) < train.max_prompt_length (128) + "
                                   "eval.math500.max_new_tokens (500)")
