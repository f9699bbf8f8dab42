"""objective.tempered_logps (TRL's convention, the authors' math recipe): every training log-prob is
log softmax(logits / T), T = data.temperature, for the policy, the reference and the sampler alike."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_module

from humanline_cli.config import resolve
from humanline_cli.core.interfaces import SamplingParams
from humanline_cli.core.logprobs import ForwardOptions, token_logps
from humanline_cli.core.reference import FrozenCopy
from humanline_cli.data.collate import make_seqs
from humanline_cli.errors import UserError
from humanline_cli.sampling.hf import HFSampler
from humanline_cli.train.build import forward_options
from tests.helpers.sampling import LOGP_TOL, PROMPTS, tiny64

# A 3-token LM whose logits depend on the previous token only: one-hot embeddings, head weight W, so the
# logits after token a are W[:, a]. After 0: [1.4, 0.7, 0.0]; after 1: [0.0, 2.1, 0.7].
W = torch.tensor([[1.4, 0.0, 0.0], [0.7, 2.1, 0.0], [0.0, 0.7, 0.0]], dtype=torch.float64)


class _Decoder(torch.nn.Module):
    def __init__(self, emb):
        super().__init__()
        self.emb = emb

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        return (self.emb(input_ids),)


class _SplitLM(torch.nn.Module):
    """Exposes decoder and head: token_logps takes its chunked (and packed) path."""
    config = None

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(3, 3, dtype=torch.float64)
        self.head = torch.nn.Linear(3, 3, bias=False, dtype=torch.float64)
        with torch.no_grad():
            self.emb.weight.copy_(torch.eye(3, dtype=torch.float64))
            self.head.weight.copy_(W)
        self.dec = _Decoder(self.emb)

    def get_decoder(self):
        return self.dec

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        return SimpleNamespace(logits=self.head(self.emb(input_ids)))


class _WholeLM(_SplitLM):
    """No decoder/head split: token_logps takes the full-logits path."""
    get_decoder = None


def _lse(*z):
    return math.log(sum(math.exp(v) for v in z))


@pytest.mark.parametrize("model_cls,pack", [(_SplitLM, False), (_SplitLM, True), (_WholeLM, False)])
def test_token_logps_divide_the_logits_by_the_temperature_hand_computed(model_cls, pack):
    """Rows [0 | 1, 2] and [1 | 0] (prompt | completion). At T = 0.7 the logits / T are [2, 1, 0] after
    token 0 and [0, 3, 1] after token 1, so log p(1 | 0) = 1 - lse(2, 1, 0) = -1.40760596444438,
    log p(2 | 1) = 1 - lse(0, 3, 1) = -2.16984601955629 and log p(0 | 1) = 0 - lse(0, 3, 1) = -3.16984601955629;
    at T = 1 (the default) the raw ones: 0.7 - lse(1.4, 0.7, 0) = -1.25571233234609,
    0.7 - lse(0, 2.1, 0.7) = -1.71411954641840, 0 - lse(0, 2.1, 0.7) = -2.41411954641840. Float64, on the
    chunked, packed and full-logits paths; the reference (FrozenCopy) gets the same numbers."""
    model = model_cls()
    expected = {0.7: [1 - _lse(2, 1, 0), 1 - _lse(0, 3, 1), 0 - _lse(0, 3, 1)],
                1.0: [0.7 - _lse(1.4, 0.7, 0), 0.7 - _lse(0, 2.1, 0.7), 0 - _lse(0, 2.1, 0.7)]}
    assert expected[0.7][0] == pytest.approx(-1.40760596444438, abs=1e-13)
    assert expected[1.0][2] == pytest.approx(-2.41411954641840, abs=1e-13)
    for temperature, want in expected.items():
        seqs = make_seqs([[0], [1]], [[1, 2], [0]], pad_id=0)
        options = ForwardOptions(pack=pack, temperature=temperature)
        got = token_logps(model, seqs, options)
        assert got.dtype == torch.float64
        picked = [got[0, 0].item(), got[0, 1].item(), got[1, 0].item()]
        assert picked == pytest.approx(want, abs=1e-12)
        assert got[1, 1].item() == 0.0  # padding
        assert FrozenCopy(model, options=options).logps(seqs).tolist() == got.tolist()


def test_tempered_sampler_logps_equal_the_policys_so_the_first_ratio_is_one():
    """The transformers sampler with tempered_logps returns log softmax(logits / T) of each kept token: the
    policy's token_logps on the same sequences at temperature T, to 1e-10 in float64 (decoding with
    the KV cache and left padding vs one padded forward). So with ratio_denominator=sampler the PPO ratio
    exp(pol - sampler) is 1 before the first update. Without tempering the sampler's raw log-probs differ
    from the tempered policy's (by more than 1e-3 somewhere): the mismatch the key removes."""
    model, tok = tiny64()
    prompts = PROMPTS[:4]
    params = SamplingParams(n=2, temperature=0.7, top_p=1.0, max_new_tokens=8, seed=5)
    sampler = HFSampler(model, tok, batch_size=8)
    tempered = sampler.generate(prompts, SamplingParams(**{**vars(params), "tempered_logps": True}))
    raw = sampler.generate(prompts, params)
    assert tempered.token_ids == raw.token_ids  # the draw does not depend on which log-probs are kept
    seqs = make_seqs([p for p in prompts for _ in range(2)], tempered.token_ids, tok.pad_token_id)
    with torch.no_grad():
        policy = token_logps(model, seqs, ForwardOptions(temperature=0.7))
    mask = seqs.loss_mask[:, 1:]
    sampled = torch.zeros_like(policy)
    unt = torch.zeros_like(policy)
    for i, (lp, lr) in enumerate(zip(tempered.logps, raw.logps)):
        cols = mask[i].nonzero().squeeze(-1)
        sampled[i, cols] = torch.tensor(lp, dtype=torch.float64)
        unt[i, cols] = torch.tensor(lr, dtype=torch.float64)
    assert (policy - sampled)[mask].abs().max().item() < 1e-10
    assert (policy - unt)[mask].abs().max().item() > 1e-3


def test_vllm_sampler_tempered_logps_equal_the_policys(tiny):
    """vLLM started with tempered_logps returns processed log-probs, log softmax(logits / T) at top_p 1:
    the policy's token_logps at temperature T, to LOGP_TOL (float32 engine vs float32 forward).
    Params that disagree with the engine's mode are refused (the mode is fixed when the engine starts)."""
    from humanline_cli.sampling.vllm import VLLMSampler

    path, model, tok = tiny
    params = SamplingParams(n=2, temperature=0.7, top_p=1.0, max_new_tokens=8, seed=5, tempered_logps=True)
    sampler = VLLMSampler(path, tok, seed=0, max_model_len=256, timeout_s=120, block_size=32, tempered_logps=True)
    try:
        out = sampler.generate(PROMPTS[:4], params)
        with pytest.raises(ValueError, match="tempered_logps"):
            sampler.generate(PROMPTS[:4], SamplingParams(**{**vars(params), "tempered_logps": False}))
    finally:
        sampler.close()
    seqs = make_seqs([p for p in PROMPTS[:4] for _ in range(2)], out.token_ids, tok.pad_token_id)
    with torch.no_grad():
        policy = token_logps(model, seqs, ForwardOptions(temperature=0.7))
    mask = seqs.loss_mask[:, 1:]
    diffs = [(policy[i, mask[i]] - torch.tensor(lp)).abs().max().item() for i, lp in enumerate(out.logps)]
    assert max(diffs) < LOGP_TOL, diffs
    with torch.no_grad():
        raw = token_logps(model, seqs)
    assert max((raw[i, mask[i]] - torch.tensor(lp)).abs().max().item() for i, lp in enumerate(out.logps)) > 1e-3


def _compose(overrides):
    with initialize_config_module("conf", version_base=None):
        return compose("train", overrides=overrides)


def test_paper_math_tempers_at_its_sampling_temperature_and_nothing_else_does():
    paper = resolve(_compose(["experiment=paper_math"]))
    assert paper.objective_cfg.tempered_logps is True and forward_options(paper).temperature == 0.7
    for over in (["objective=grpo", "data=online"], ["objective=dpo"], ["objective=kto", "data=online"]):
        spec = resolve(_compose(["task=arithmetic", *over]))
        assert spec.objective_cfg.tempered_logps is False and forward_options(spec).temperature == 1.0
    with pytest.raises(UserError, match="needs data.top_p=1"):
        resolve(_compose(["experiment=paper_math", "data.top_p=0.95"]))
    with pytest.raises(UserError, match="must be > 0"):
        resolve(_compose(["experiment=paper_math", "data.temperature=0"]))
