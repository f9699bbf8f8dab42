"""What the vLLM engine is started with beyond the model: the scheduler's token budget per step (TRL's 4096, not
vLLM's 16,384 on an H100/H200, whose start-up memory profile then leaves less KV cache), and its warnings kept
(a KV cache too small for a round's batch says so), less the two lines every weight push would print."""
from __future__ import annotations

import logging

import pytest
import torch
from hydra import compose, initialize_config_module

from humanline_cli.config import resolve
from humanline_cli.errors import UserError
from humanline_cli.sampling import vllm as vllm_mod
from humanline_cli.train.samplers import vllm_options
from tests.helpers.fake_vllm import fake_tokenizer, install_fake_vllm


def _spec(*overrides: str):
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return resolve(compose("train", overrides=["data=online", "sampler=vllm", *overrides]))


def test_the_engine_gets_the_runs_token_budget(monkeypatch):
    install_fake_vllm(monkeypatch, [], lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert vllm_mod.VLLMSampler("unused", fake_tokenizer(), timeout_s=10).llm.kwargs["max_num_batched_tokens"] == 4096
    options = vllm_options(_spec("sampler.max_num_batched_tokens=2048"))
    assert options["max_num_batched_tokens"] == 2048
    engine = vllm_mod.VLLMSampler("unused", fake_tokenizer(), **{**options, "timeout_s": 10})
    assert engine.llm.kwargs["max_num_batched_tokens"] == 2048


def test_a_budget_below_one_token_is_refused():
    with pytest.raises(UserError) as e:
        _spec("sampler.max_num_batched_tokens=0")
    assert str(e.value) == "config key 'sampler.max_num_batched_tokens' must be >= 1, got 0"


def test_vllm_warnings_are_kept(monkeypatch):
    install_fake_vllm(monkeypatch, [], lambda: 0)
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    vllm_mod._import_vllm()
    assert vllm_mod.os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")  # the user's own choice wins
    vllm_mod._import_vllm()
    assert vllm_mod.os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"


def test_only_the_expected_per_push_reload_lines_are_dropped(monkeypatch):
    """The reload warns at every push for the rotary tables (buffers) and a tied lm_head (pushed as the
    embedding): those two lines go; a layer that really got no weights still warns."""
    vllm_mod.quiet_expected_push_warnings()
    vllm_mod.quiet_expected_push_warnings()  # once per process, however many engines start
    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    assert sum(type(f).__name__ == "_ExpectedPushWarnings" for f in log.filters) == 1
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    log.addHandler(handler)
    monkeypatch.setattr(log, "level", logging.WARNING)
    try:
        for layer in ("RotaryEmbedding", "ParallelLMHead", "QKVParallelLinear"):
            log.warning("%s: Failed to load weights", layer)
        log.warning("something else")
    finally:
        log.removeHandler(handler)
    assert seen == ["QKVParallelLinear: Failed to load weights", "something else"]
