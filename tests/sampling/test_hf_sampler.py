"""The transformers sampler's own decoding loop: raw log-probs equal a one-forward recomputation, a
completion depends only on (seed, prompt index, sample index) (not on its batch, call or rank), and the
nucleus draw picks the tokens the hand-computed CDF says."""
from __future__ import annotations

import math
import socket

import pytest
import torch
import torch.multiprocessing as mp

from humanline_cli.core.interfaces import SamplingParams
from humanline_cli.sampling.hf import HFSampler, _draw
from tests.helpers.sampling import PROMPTS, tiny64

MAX_NEW = 10


def test_logps_equal_a_recomputation_with_one_forward():
    """Each kept token's log-prob is log_softmax(raw logits) at that position, as one forward over
    prompt + completion computes it (float64; the decoding loop uses the KV cache and left padding,
    the recomputation neither)."""
    model, tok = tiny64()
    out = HFSampler(model, tok, batch_size=5).generate(
        PROMPTS, SamplingParams(n=2, temperature=0.7, top_p=0.9, max_new_tokens=MAX_NEW, seed=3))
    assert len(out.token_ids) == 2 * len(PROMPTS)
    worst = 0.0
    for k, (ids, lps) in enumerate(zip(out.token_ids, out.logps)):
        prompt = PROMPTS[k // 2]
        assert len(ids) == len(lps) > 0
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
        worst = max(worst, (ref - torch.tensor(lps, dtype=torch.float64)).abs().max().item())
    assert worst < 1e-10, worst
    eos = tok.eos_token_id
    assert any(ids[-1] == eos for ids in out.token_ids) and any(len(ids) == MAX_NEW for ids in out.token_ids)


def test_a_completion_depends_only_on_seed_prompt_and_sample_index():
    """A rank's share (prompts 6, 1, 3, sampled alone, in another batch size) gets exactly the tokens
    those prompts get in the whole call, and log-probs equal to 1e-10 (float64: only the padding and
    batch shape differ); another seed gives other samples."""
    model, tok = tiny64()
    p = SamplingParams(n=3, temperature=1.0, top_p=0.95, max_new_tokens=MAX_NEW, seed=5)
    whole = HFSampler(model, tok, batch_size=24).generate(PROMPTS, p)
    share = [6, 1, 3]
    part = HFSampler(model, tok, batch_size=2).generate([PROMPTS[i] for i in share], p, indices=share)
    assert part.token_ids == [whole.token_ids[i * 3 + j] for i in share for j in range(3)]
    for a, k in enumerate(share):
        for j in range(3):
            assert max((abs(x - y) for x, y in zip(part.logps[a * 3 + j], whole.logps[k * 3 + j])), default=0) < 1e-10
    assert len({tuple(t) for t in whole.token_ids}) > len(PROMPTS)  # samples of a prompt differ
    other = HFSampler(model, tok, batch_size=24).generate(PROMPTS, SamplingParams(**{**vars(p), "seed": 6}))
    assert other.token_ids != whole.token_ids


def test_nucleus_draw_by_hand():
    """p = (0.5, 0.3, 0.2), T = 1, top_p = 0.7: the nucleus is {0, 1} (token 2 has 0.8 of mass before
    it, >= 0.7), renormalised CDF (0.5, 0.8, 0.8) / 0.8; u = 0.6 -> 0.48 -> token 0, u = 0.7 -> 0.56 ->
    token 1, u = 0.99 -> 0.792 -> token 1 (never 2). top_p = 1, CDF (0.5, 0.8, 1): u = 0.6 -> token 1,
    0.7 -> token 1, 0.99 -> token 2. At T = 0.5 the
    probabilities are p^2 / sum p^2 = (25, 9, 4) / 38: u = 0.6 -> 22.8 / 38 -> token 0, u = 0.7 -> 26.6 / 38
    -> token 1."""
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]] * 3)
    u = torch.tensor([0.6, 0.7, 0.99], dtype=torch.float64)
    nucleus = SamplingParams(temperature=1.0, top_p=0.7)
    assert _draw(logits, nucleus, u).tolist() == [0, 1, 1]
    assert _draw(logits, SamplingParams(temperature=1.0, top_p=1.0), u).tolist() == [1, 1, 2]
    assert _draw(logits[:2], SamplingParams(temperature=0.5, top_p=1.0), u[:2]).tolist() == [0, 1]


def _fsdp_rank(rank: int, port: int, result: dict) -> None:
    import os

    import torch.distributed as tdist

    from humanline_cli.backend import shard_model
    from humanline_cli.sources.source import Shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tdist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        model, tok = tiny64()
        shard_model(model)
        shard = Shard(rank, 2)
        mine = shard.share(7)  # 4 and 3 prompts: unequal shares, rows finishing at different steps
        out = HFSampler(model, tok, batch_size=3, lockstep=shard.max_int).generate(
            [PROMPTS[i] for i in mine], SamplingParams(n=2, temperature=1.0, max_new_tokens=MAX_NEW, seed=9),
            indices=mine)
        result[rank] = (mine, out.token_ids, out.logps)
    finally:
        tdist.destroy_process_group()


@pytest.mark.slow
def test_fsdp_ranks_sample_their_shares_in_lockstep():
    """Under FSDP every forward all-gathers the layer's shards, so ranks with unequal shares (4 vs 3
    prompts, 3 vs 2 batches, different stopping steps) must decode in lockstep (Shard.max_int); their
    completions are the one-process ones (tokens exact, float64 log-probs to 1e-10)."""
    model, tok = tiny64()
    p = SamplingParams(n=2, temperature=1.0, max_new_tokens=MAX_NEW, seed=9)
    whole = HFSampler(model, tok, batch_size=16).generate(PROMPTS[:7], p)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = mp.Manager().dict()
    mp.spawn(_fsdp_rank, args=(port, result), nprocs=2, join=True)
    got = {}
    for rank in (0, 1):
        mine, ids, lps = result[rank]
        for a, i in enumerate(mine):
            for j in range(2):
                got[i * 2 + j] = (ids[a * 2 + j], lps[a * 2 + j])
    assert sorted(got) == list(range(14))
    assert [got[k][0] for k in range(14)] == whole.token_ids
    assert max(abs(x - y) for k in range(14) for x, y in zip(got[k][1], whole.logps[k])) < 1e-10
    assert len({len(t) for t in whole.token_ids}) > 1  # rows stop at different steps
