"""Every vLLM engine call (start, generate, push, sleep, wake) runs on the rank's CUDA device, although
each runs in its own worker thread (a new host thread starts on cuda:0). CPU-only: torch.cuda's
per-thread current device and the engine are fakes that record the device each call sees."""
from __future__ import annotations

import torch

from humanline_cli.core.interfaces import SamplingParams
from tests.helpers.fake_vllm import FakeCuda, fake_tokenizer, install_fake_vllm


def test_every_engine_call_runs_on_the_ranks_device(monkeypatch):
    from humanline_cli.sampling.vllm import VLLMSampler

    log: list = []
    cuda = FakeCuda(log).install(monkeypatch)
    install_fake_vllm(monkeypatch, log, cuda.current_device)
    cuda.set_device(3)  # what init_distributed does on local rank 3, in the rank's main thread
    s = VLLMSampler("unused", fake_tokenizer(), sleep=True, timeout_s=10)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=0)
    s.generate([[5, 6], [7]], params)
    s.sleep()
    s.push_weights(torch.nn.Linear(2, 2))  # wakes the weights, pushes, wakes the KV cache
    s.generate([[5]], params)
    s.sleep()
    s.close()
    kinds = {e.split(":")[0] for e, _ in log}
    assert {"start", "generate", "push", "sleep", "wake_up", "reset_prefix_cache"} <= kinds, log
    assert [d for _, d in log] == [3] * len(log), log  # the order of the calls: tests/sampling/test_wake_order.py
    assert cuda.current_device() == 3  # the caller's own device is left as it was


def test_without_cuda_no_device_is_selected(monkeypatch):
    """On a CPU engine the worker thread selects nothing (torch.cuda.set_device would fail there)."""
    from humanline_cli.sampling.vllm import VLLMSampler

    log: list = []
    install_fake_vllm(monkeypatch, log, lambda: "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def refuse(device):
        raise AssertionError("set_device called without CUDA")

    monkeypatch.setattr(torch.cuda, "set_device", refuse)
    s = VLLMSampler("unused", fake_tokenizer(), timeout_s=10)
    s.generate([[5]], SamplingParams(n=1, temperature=0.0, max_new_tokens=4, seed=0))
    assert [e for e, _ in log] == ["start", "generate"]
