"""The stale-data corrections (core/corrections.py) by hand: importance weights in TRL's four modes and the geometric
level, AReaL's decoupled behaviour weight, their place in GRPO's loss, TR-DPO's soft update and when the reference
rule applies it, and the trainer/sampler mismatch statistics. float64 throughout: exact up to 1e-12."""
from __future__ import annotations

import math

import pytest
import torch

from humanline_cli.core.corrections import (
    CorrectionConfig,
    CorrectionSpec,
    decoupled_weights,
    is_weights,
    mismatch_stats,
    mix_reference,
    raw_is_ratio,
    weight_metrics,
)
from humanline_cli.core.humanline import HumanlineSpec, ReferenceRule
from humanline_cli.core.objectives.grpo import grpo_loss

L2, L4, LH = math.log(2.0), math.log(4.0), math.log(0.5)
D = torch.float64


def _t(rows):
    return torch.tensor(rows, dtype=D)


def _eq(tensor, rows) -> bool:
    return torch.allclose(tensor.double(), _t(rows), rtol=0, atol=1e-12)


def test_token_level_weights_truncate_and_mask():
    # old - behaviour per token: 0, ln 4, ln 0.5 -> ratios 1, 4, 0.5; the cap is 3 (TRL's default)
    old, behav, mask = _t([[0.0, L4, LH]]), _t([[0.0, 0.0, 0.0]]), _t([[1.0, 1.0, 1.0]])
    assert _eq(is_weights(old, behav, mask, "token_truncate", 3.0), [[1.0, 3.0, 0.5]])
    assert _eq(is_weights(old, behav, mask, "token_mask", 3.0), [[1.0, 0.0, 0.5]])
    # C_min 0.6: truncation lifts 0.5 to 0.6, the mask drops it
    assert _eq(is_weights(old, behav, mask, "token_truncate", 3.0, 0.6), [[1.0, 3.0, 0.6]])
    assert _eq(is_weights(old, behav, mask, "token_mask", 3.0, 0.6), [[1.0, 0.0, 0.0]])


def test_sequence_and_geometric_levels():
    # row 0: two tokens of ln 2 each: summed ratio exp(2 ln 2) = 4, geometric exp(ln 2) = 2;
    # row 1: one token of ln 0.5 and a padding column whose (garbage) log-probs the mask removes: 0.5 either way
    old = _t([[L2, L2], [LH, 7.0]])
    behav = _t([[0.0, 0.0], [0.0, -3.0]])
    mask = _t([[1.0, 1.0], [1.0, 0.0]])
    assert raw_is_ratio(old, behav, mask, "sequence").flatten().tolist() == pytest.approx([4.0, 0.5], abs=1e-12)
    assert _eq(is_weights(old, behav, mask, "sequence_truncate", 3.0), [[3.0, 3.0], [0.5, 0.5]])
    assert _eq(is_weights(old, behav, mask, "sequence_mask", 3.0), [[0.0, 0.0], [0.5, 0.5]])
    assert _eq(is_weights(old, behav, mask, "geometric_mask", 3.0), [[2.0, 2.0], [0.5, 0.5]])
    with pytest.raises(ValueError, match="mode"):
        is_weights(old, behav, mask, "token_clip", 3.0)


def test_decoupled_weight_drops_tokens_above_the_cap():
    # prox - behaviour: ln 2, ln 6, ln 0.25, and a token off the mask -> 2, dropped (6 > 5), 0.25, 0
    prox = _t([[L2, math.log(6.0), math.log(0.25), 1.0]])
    behav = torch.zeros_like(prox)
    mask = _t([[1.0, 1.0, 1.0, 0.0]])
    assert _eq(decoupled_weights(prox, behav, mask, 5.0), [[2.0, 0.0, 0.25, 0.0]])
    assert _eq(decoupled_weights(prox, behav, mask, None), [[2.0, 6.0, 0.25, 0.0]])
    m = weight_metrics(raw_is_ratio(prox, behav, mask), decoupled_weights(prox, behav, mask, 5.0), mask)
    assert m["correction/raw_ratio_max"] == pytest.approx(6.0, abs=1e-12)  # before the cap
    assert m["correction/raw_ratio_mean"] == pytest.approx((2 + 6 + 0.25) / 3, abs=1e-12)
    assert m["correction/weight_mean"] == pytest.approx(2.25 / 3, abs=1e-12)
    assert m["correction/dropped_fraction"] == pytest.approx(1 / 3, abs=1e-12)


def test_grpo_loss_weights_only_the_policy_gradient_term():
    """A = 1 on both tokens, policy = denominator (rho = 1), weights 2 and 0.5: pg per token -1 x w, so the
    token mean is -(2 + 0.5) / 2 = -1.25 and d loss / d log pi_t = -w_t / 2 (rho' = rho = 1). The k3 term
    (policy - reference 0.1 on each token, beta 0.5) is not weighted: + 0.5 (e^-0.1 + 0.1 - 1)."""
    pol = _t([[0.0, 0.0]]).requires_grad_(True)
    mask = _t([[1.0, 1.0]])
    w = _t([[2.0, 0.5]])
    kl = pol + 0.1
    loss, _ = grpo_loss(pol - pol.detach(), kl, mask, _t([1.0]), 0.2, 0.5, token_weight=w)
    k3 = math.exp(-0.1) + 0.1 - 1.0
    assert float(loss.detach()) == pytest.approx(-1.25 + 0.5 * k3, abs=1e-12)
    (g,) = torch.autograd.grad(loss, pol)
    dk3 = 0.5 * (1.0 - math.exp(-0.1)) / 2  # d/dpol of beta * mean k3, k3(x) = e^-x + x - 1 at x = 0.1
    assert _eq(g, [[-1.0 + dk3, -0.25 + dk3]])
    # without weights: the plain loss
    plain, _ = grpo_loss(pol - pol.detach(), kl, mask, _t([1.0]), 0.2, 0.5)
    assert float(plain.detach()) == pytest.approx(-1.0 + 0.5 * k3, abs=1e-12)


def test_mismatch_stats_by_hand():
    trainer = _t([[-1.0, -2.0, -0.5, 5.0]])
    sampler = _t([[-1.1, -1.7, -0.5, 0.0]])
    mask = _t([[1.0, 1.0, 1.0, 0.0]])
    m = mismatch_stats(trainer, sampler, mask)
    # gaps 0.1, -0.3, 0: mean |.| 0.4 / 3, max 0.3; exp(-0.3) = 0.741 < 0.8, the others inside [0.8, 1.25]
    assert m["mismatch/logp_abs_mean"] == pytest.approx(0.4 / 3, abs=1e-12)
    assert m["mismatch/logp_abs_max"] == pytest.approx(0.3, abs=1e-12)
    assert m["mismatch/ratio_outside"] == pytest.approx(1 / 3, abs=1e-12)
    assert mismatch_stats(trainer, trainer, mask) == {"mismatch/logp_abs_mean": 0.0, "mismatch/logp_abs_max": 0.0,
                                                      "mismatch/ratio_outside": 0.0}


def test_soft_update_mixes_alpha_of_the_policy():
    policy, reference = torch.nn.Linear(1, 1, bias=False).double(), torch.nn.Linear(1, 1, bias=False).double()
    with torch.no_grad():
        policy.weight.fill_(1.0)
        reference.weight.fill_(0.0)
    mix_reference(policy, reference, 0.6)
    assert reference.weight.item() == pytest.approx(0.6, abs=1e-15)
    mix_reference(policy, reference, 0.6)  # 0.6 x 1 + 0.4 x 0.6
    assert reference.weight.item() == pytest.approx(0.84, abs=1e-15)
    mix_reference(policy, reference, 1.0)  # alpha 1: the hard copy
    assert reference.weight.item() == 1.0


def test_reference_rule_of_trdpo():
    spec = CorrectionSpec.from_config(CorrectionConfig(kind="trdpo", alpha=0.5, tau=3))
    rule = ReferenceRule.from_spec(HumanlineSpec(), "online", spec)
    # after steps 3 and 6 (TRL's on_step_end), never before a step, never at a round's start
    assert [s for s in range(1, 8) if rule.after_optimizer_step(s)] == [3, 6]
    assert not any(rule.before_optimizer_step(s) for s in range(1, 8)) and not rule.at_round_start(True)
    assert rule.mix_alpha == 0.5 and rule.moves
    plain = ReferenceRule.from_spec(HumanlineSpec(), "offline")
    assert not plain.moves and not any(plain.after_optimizer_step(s) for s in range(1, 8))


def test_correction_modes_from_config():
    assert CorrectionSpec.from_config(CorrectionConfig(kind="tis")).mode == "token_truncate"
    assert CorrectionSpec.from_config(CorrectionConfig(kind="tis", level="sequence")).mode == "sequence_truncate"
    assert CorrectionSpec.from_config(CorrectionConfig(kind="mis", level="sequence")).mode == "sequence_mask"
    assert CorrectionSpec.from_config(CorrectionConfig(kind="mis", level="geometric")).mode == "geometric_mask"
    assert CorrectionSpec.from_config(CorrectionConfig(kind="decoupled")).mode is None
    assert CorrectionSpec.from_config(CorrectionConfig(kind="humanline")).weights_tokens is False

