"""A reward-model judge loads only on the rank that judges (rank 0: Evaluator.sample), not on every rank:
at 8B an ArmoRM judge is ~16 GB per rank that never runs there."""
from __future__ import annotations

import json

from tests.helpers.models import build_tiny_reward_model


def test_a_reward_model_judge_loads_on_rank0_only(tmp_path, monkeypatch):
    from hydra import compose, initialize_config_module

    import humanline_cli.rewards.reward_model as rm_mod
    from humanline_cli.config import resolve
    from humanline_cli.models import load_tokenizer
    from humanline_cli.sources.source import Shard
    from humanline_cli.train.build import build_evaluator, make_encoder

    build_tiny_reward_model(tmp_path / "rm")
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["1+2=", "3+4=", "5+6="]))
    with initialize_config_module(config_module="conf", version_base="1.3"):
        spec = resolve(compose("train", overrides=[
            "task=custom", f"model.name_or_path={tmp_path / 'rm'}", "data.path=unused.jsonl", "chat_template=false",
            f"task.prompts.eval={tmp_path / 'eval.jsonl'}", "task.judge.kind=model",
            f"task.judge.name_or_path={tmp_path / 'rm'}", "train.max_length=64", "train.max_prompt_length=32",
            "eval.max_new_tokens=8"]))
    built = []
    real = rm_mod.RewardModel
    monkeypatch.setattr(rm_mod, "RewardModel", lambda *a, **k: (built.append(a[0]), real(*a, **k))[1])
    encoder = make_encoder(spec, load_tokenizer(str(tmp_path / "rm")))
    other = build_evaluator(spec, encoder, "cpu", shard=Shard(1, 2))
    assert built == [] and other.judge is None and other.judge_name == f"model:{tmp_path / 'rm'}"
    main = build_evaluator(spec, encoder, "cpu", shard=Shard(0, 2))
    assert built == [str(tmp_path / "rm")] and main.judge_name == other.judge_name
    scores = main.judge(["1+2="], ["3"])
    assert len(scores) == 1 and isinstance(scores[0], float)
