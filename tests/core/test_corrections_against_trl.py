"""The importance-sampling corrections (correction=tis|mis) against TRL 1.16's own code, in float64, and TR-DPO's
soft update against TRL's SyncRefModelCallback.

TRL computes its vLLM importance weight inline in GRPOTrainer._generate_and_score_completions; that block (from
`if self.use_vllm and self.vllm_importance_sampling_correction:` to the reference model's forward) is cut out of the
installed source and run unchanged on the test's tensors, so the weights compared are TRL's. Its loss then runs
through GRPOTrainer._compute_loss (loss_type=bnpo: the token mean of one micro-step, ours objective.aggregation=
token_mean) with the model forward stubbed to return leaf log-probs, as tests/core/test_dapo_against_trl.py does:
equal loss and equal gradients with respect to every per-token log-prob, to 1e-12. TRL's "old" log-probs are the
trainer's own at generation time, ours the reference reset at the round's start: the same tensor here."""
from __future__ import annotations

import inspect
import math
import textwrap
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from trl import GRPOTrainer
from trl.trainer.callbacks import SyncRefModelCallback

from humanline_cli.core.corrections import is_weights, mix_reference, raw_is_ratio
from humanline_cli.core.objectives.grpo import grpo_loss

EPS, BETA, CAP, B, T = 0.2, 0.04, 3.0, 4, 6
MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def _trl_is_block() -> str:
    """TRL's importance-weight block, dedented, as installed."""
    src = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    start = src.index("if self.use_vllm and self.vllm_importance_sampling_correction:\n")
    end = src.index("# Compute the per-token log probabilities for the reference model", start)
    block = textwrap.dedent(src[start:end].rstrip() + "\n")
    assert "vllm_importance_sampling_ratio = torch.exp(logps_diff)" in block  # the block it was written against
    return block


def _trl_weights(old, sampling, mask, mode, cap_min=None):
    trl_self = SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=True,
                               vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_max=CAP,
                               vllm_importance_sampling_clip_min=cap_min)
    scope = {"self": trl_self, "torch": torch, "math": math, "old_per_token_logps": old,
             "sampling_per_token_logps": sampling, "completion_mask": mask, "tool_mask": None}
    exec(_trl_is_block(), scope)
    return scope["vllm_importance_sampling_ratio"]


class _TRLSelf:
    """What GRPOTrainer._compute_loss reads for loss_type=bnpo with vLLM importance sampling on."""

    def __init__(self, logps):
        self.loss_type, self.beta = "bnpo", BETA
        self.epsilon_low = self.epsilon_high = EPS
        self.importance_sampling_level = "token"
        self.top_entropy_quantile, self.off_policy_mask_threshold = 1.0, None
        self.use_vllm = self.vllm_importance_sampling_correction = True
        self.aux_loss_enabled = self._entropy_bonus_enabled = False
        self.current_gradient_accumulation_steps = 1
        self.args = SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1)
        self.model = SimpleNamespace(training=True)
        self.accelerator = SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x)
        self._metrics = defaultdict(lambda: defaultdict(list))
        self._logps = logps

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, **kw):
        return self._logps, torch.zeros_like(self._logps), None


def _batch(seed: int):
    """Policy log-probs (leaf), round-start (TRL's old), sampler and reference log-probs, advantages, and a mask of
    unequal lengths; the sampler is 0.4 nats off per token so that every mode truncates or drops something."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([6, 4, 2, 5])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    sampling = old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    pol = (old + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_(True)
    ref = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return dict(pol=pol, old=old, sampling=sampling, ref=ref, adv=adv, mask=mask)


@pytest.mark.parametrize("mode", MODES)
def test_importance_weights_equal_trls(mode):
    b = _batch(0)
    for cap_min in (None, 0.5):
        trl = _trl_weights(b["old"], b["sampling"], b["mask"], mode, cap_min).expand(B, T)
        ours = is_weights(b["old"], b["sampling"], b["mask"], mode, CAP, cap_min)
        on = b["mask"].bool()  # off the mask TRL's sequence weights broadcast too: compare where the loss reads
        assert torch.allclose(ours[on], trl[on], rtol=0, atol=1e-12)
    # the batch exercises the bound: in every mode some weight is truncated or dropped (differs from the raw ratio)
    raw = raw_is_ratio(b["old"], b["sampling"], b["mask"], mode.split("_")[0]).expand(B, T)
    ours = is_weights(b["old"], b["sampling"], b["mask"], mode, CAP)
    assert not torch.allclose(ours[on], raw[on], rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_corrected_grpo_loss_and_gradients_equal_trls(mode):
    b = _batch(1)
    pol, mask = b["pol"], b["mask"]
    ratio = _trl_weights(b["old"], b["sampling"], mask, mode)
    inputs = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
              "advantages": b["adv"], "old_per_token_logps": b["old"], "ref_per_token_logps": b["ref"],
              "sampling_per_token_logps": b["sampling"], "importance_sampling_ratio": ratio}
    trl_loss = GRPOTrainer._compute_loss(_TRLSelf(pol), None, inputs)
    (trl_grad,) = torch.autograd.grad(trl_loss, pol)
    w = is_weights(b["old"], b["sampling"], mask, mode, CAP)
    ours, _ = grpo_loss(pol - b["old"], pol - b["ref"], mask, b["adv"], EPS, BETA, "token_mean", w)
    (our_grad,) = torch.autograd.grad(ours, pol)
    assert float(ours.detach()) == pytest.approx(float(trl_loss.detach()), rel=0, abs=1e-12)
    assert torch.allclose(our_grad, trl_grad, rtol=0, atol=1e-12) and float(trl_grad.abs().max()) > 1e-3
    # and the correction changes the loss (the weights are not all 1)
    plain, _ = grpo_loss(pol - b["old"], pol - b["ref"], mask, b["adv"], EPS, BETA, "token_mean")
    assert abs(float(plain.detach()) - float(ours.detach())) > 1e-4


def test_soft_update_equals_trls_sync_ref_model_callback():
    torch.manual_seed(0)
    policy = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).double()
    reference = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).double()
    trl_reference = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).double()
    trl_reference.load_state_dict(reference.state_dict())
    for _ in range(3):  # three updates, the policy moving between them
        mix_reference(policy, reference, 0.6)
        SyncRefModelCallback._sync_target_model(policy, trl_reference, 0.6)
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(0.1)
    for a, b in zip(reference.parameters(), trl_reference.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-15)
    assert not torch.allclose(next(reference.parameters()), next(policy.parameters()))
