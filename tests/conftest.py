"""Layout: tests/<folder>/test_<what it checks>.py mirrors humanline_cli/<folder>/ (config/: config.py, schema.py and
conf/; e2e/: whole runs through the CLI; tests/ itself: package-wide checks and top-level modules), shared plain
functions live in tests/helpers/ (never imported from another test file), and fixtures here.

Shared fixtures: a tiny bundled world built once per session into a temp cache (no network)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.cli import MODEL_CACHE

# wandb off unless a test turns it on: an offline run starts wandb's service process (seconds a run); the tests of
# the wandb record ask for `wandb.mode=offline` themselves
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# a pinned ATEN_CPU_CAPABILITY gets its own inductor cache (vLLM's compiled sampler ops; `vllm serve` too)
from humanline_cli.sampling.vllm import inductor_cache_per_kernel_set  # noqa: E402

inductor_cache_per_kernel_set()


def pytest_runtest_setup(item):
    """A test marked gpu fails where CUDA is missing: a CUDA test never passes as a skip on a CPU machine
    (`just test` deselects them; `just test-gpu` runs them)."""
    if item.get_closest_marker("gpu") is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.fail("marked gpu: needs a CUDA device, and torch.cuda.is_available() is False here", pytrace=False)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("humanline-cache")
    os.environ["HUMANLINE_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The converted SmolLM2-135M-Instruct folder (converted here first if this machine has none; a lock makes a
    second test worker wait for the first one's conversion)."""
    from humanline_cli.world.packaged import materialise

    return materialise("smollm2", MODEL_CACHE)


@pytest.fixture
def fault_env():
    """`fault_env(rank="1:3:kill")` or `fault_env(sampler="kill@3:1")`: the environment for a subprocess run
    with that fault injected (tests/faults/sitecustomize.py patches every process of the run)."""
    def make(rank: str | None = None, sampler: str | None = None) -> dict:
        path = os.pathsep.join(p for p in (str(Path(__file__).parent / "faults"), os.environ.get("PYTHONPATH")) if p)
        return {"PYTHONPATH": path, **({"HL_FAULT": rank} if rank else {}),
                **({"HL_SAMPLER_FAULT": sampler} if sampler else {})}

    return make


@pytest.fixture
def one_thread():
    """torch on one thread for the test (restored after): in-process training tests on a shared machine."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A saved tiny Llama with peaked distributions and its one-character tokenizer: (path, model, tokenizer)."""
    from tests.helpers.sampling import char_tokenizer, peaked_llama

    path = tmp_path_factory.mktemp("tiny_llama")
    tok = char_tokenizer()
    model = peaked_llama(len(tok))
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return str(path), model, tok
