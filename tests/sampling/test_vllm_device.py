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
    _ranks(monkeypatch, 4)
    s = VLLMSampler("unused", fake_tokenizer(), sleep=True, timeout_s=10)
    assert s.llm.kwargs["distributed_executor_backend"] == "external_launcher"  # its device: LOCAL_RANK's
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


def _ranks(monkeypatch, world: int) -> None:
    """torch.distributed as a rank of a `world`-rank job sees it."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: world)


def test_one_process_on_another_gpu_than_the_first_is_refused(monkeypatch):
    """vLLM's one-process executor puts its engine on cuda:0 whatever device is current, so a one-process run whose
    device is another would share GPU 0 with whatever runs there: one line, before the engine starts."""
    import pytest

    from humanline_cli.errors import UserError
    from humanline_cli.sampling.vllm import VLLMSampler

    log: list = []
    cuda = FakeCuda(log).install(monkeypatch)
    install_fake_vllm(monkeypatch, log, cuda.current_device)
    cuda.set_device(1)
    with pytest.raises(UserError) as e:
        VLLMSampler("unused", fake_tokenizer(), timeout_s=10)
    assert str(e.value) == ("sampler=vllm in one process starts its engine on cuda:0, but this process's device is "
                            "cuda:1: choose the GPU with CUDA_VISIBLE_DEVICES instead")
    assert log == []  # no engine started
    cuda.set_device(0)
    assert "distributed_executor_backend" not in VLLMSampler("unused", fake_tokenizer(), timeout_s=10).llm.kwargs


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


def test_the_peak_before_the_engine_reset_it_is_the_runs_peak(monkeypatch):
    # vLLM resets torch's peak-memory counter when its engine starts; the summary's cuda_max_allocated still
    # covers what came before it (the policy's load, earlier steps). torch.cuda's counter is faked (no GPU here)
    from types import SimpleNamespace

    from humanline_cli import backend
    from humanline_cli.sampling.vllm import VLLMSampler
    from humanline_cli.train.finish import peak_memory

    log: list = []
    cuda = FakeCuda(log).install(monkeypatch)
    install_fake_vllm(monkeypatch, log, cuda.current_device)
    peak = {3: 7 * 1024**3}  # 7 GiB allocated at most before the engine starts
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peak[int(device)])
    monkeypatch.setattr(backend, "_PEAK_BEFORE_RESETS", {})
    import vllm

    start = vllm.LLM

    def resetting_start(**kw):  # what vLLM's memory profiling does as the engine starts, then its own 2 GiB
        peak[3] = 2 * 1024**3
        return start(**kw)

    monkeypatch.setattr(vllm, "LLM", resetting_start)
    cuda.set_device(3)  # local rank 3 of a 4-rank job
    _ranks(monkeypatch, 4)
    s = VLLMSampler("unused", fake_tokenizer(), timeout_s=10)
    s.close()
    parts = SimpleNamespace(memory=None, backend=SimpleNamespace(device=torch.device("cuda", 3)), rss_before_weights=0)
    assert peak_memory(parts)["cuda_max_allocated"] == 7.0
    peak[3] = 9 * 1024**3  # a later, higher peak (training with the engine asleep) is the counter's own
    assert peak_memory(parts)["cuda_max_allocated"] == 9.0
