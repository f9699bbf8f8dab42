"""DPO / KTO / GRPO losses against hand-computed values (see /work/shared/method.md)."""

from __future__ import annotations

import math

import pytest
import torch

from humanline_cli.core.losses import dpo_loss, grpo_loss, kto_loss, kto_reference_point

D = torch.float64


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=D)


# ---------------------------------------------------------------- DPO
# chosen: pair0 r_w = 0.5 - 0.2 + 0.3 = 0.6 (100.0 padded); pair1 r_w = 1.0 + 0.4 = 1.4 (-50, 77 padded)
# rejected: pair0 r_l = 0.2 + 0.1 = 0.3 (-999, 123 padded); pair1 r_l = 4 * 0.5 = 2.0
CHOSEN = [[0.5, -0.2, 0.3, 100.0], [1.0, 0.4, -50.0, 77.0]]
M_CHOSEN = [[1, 1, 1, 0], [1, 1, 0, 0]]
REJECTED = [[0.2, 0.1, -999.0, 123.0], [0.5, 0.5, 0.5, 0.5]]
M_REJECTED = [[1, 1, 0, 0], [1, 1, 1, 1]]
BETA = 0.1
MARGINS = [BETA * (0.6 - 0.3), BETA * (1.4 - 2.0)]  # 0.03, -0.06


def test_dpo_hand_computed_loss_ignores_padding():
    loss, _ = dpo_loss(t(CHOSEN), t(M_CHOSEN), t(REJECTED), t(M_REJECTED), BETA)
    # -log sigmoid(m) = log(1 + exp(-m))
    expected = (math.log(1 + math.exp(-0.03)) + math.log(1 + math.exp(0.06))) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-12)


def test_dpo_metrics():
    _, m = dpo_loss(t(CHOSEN), t(M_CHOSEN), t(REJECTED), t(M_REJECTED), BETA)
    assert m["dpo/margin"] == pytest.approx((0.03 - 0.06) / 2, abs=1e-12)
    assert m["dpo/accuracy"] == 0.5  # only pair 0 has margin > 0
    assert m["dpo/reward_chosen"] == pytest.approx(BETA * (0.6 + 1.4) / 2, abs=1e-12)
    assert m["dpo/reward_rejected"] == pytest.approx(BETA * (0.3 + 2.0) / 2, abs=1e-12)


def test_dpo_accuracy_zero_margin_is_not_correct():
    z = torch.zeros(3, 4, dtype=D)
    _, m = dpo_loss(z, torch.ones_like(z), z, torch.ones_like(z), BETA)
    assert m["dpo/accuracy"] == 0.0  # strict margin > 0


@pytest.mark.parametrize("B", [1, 2, 5])
def test_dpo_zero_logratios_give_ln2(B):
    z = torch.zeros(B, 6, dtype=D)
    mask = torch.ones_like(z)
    mask[:, 4:] = 0
    loss, m = dpo_loss(z, mask, z.clone(), mask, BETA)
    assert loss.item() == pytest.approx(math.log(2), rel=1e-15)
    assert m["dpo/margin"] == 0.0


def test_dpo_gradient_matches_hand_derivation():
    lw = t(CHOSEN).requires_grad_(True)
    ll = t(REJECTED).requires_grad_(True)
    loss, _ = dpo_loss(lw, t(M_CHOSEN), ll, t(M_REJECTED), BETA)
    loss.backward()
    B = 2
    # d/dm [-log sigmoid(m)] = -sigmoid(-m); dm/dl_w = beta * mask; dm/dl_l = -beta * mask
    g_w = [[-BETA * sig(-MARGINS[i]) / B * mk for mk in M_CHOSEN[i]] for i in range(B)]
    g_l = [[BETA * sig(-MARGINS[i]) / B * mk for mk in M_REJECTED[i]] for i in range(B)]
    torch.testing.assert_close(lw.grad, t(g_w), rtol=1e-12, atol=0)
    torch.testing.assert_close(ll.grad, t(g_l), rtol=1e-12, atol=0)
    # padded tokens get exactly zero gradient
    assert lw.grad[0, 3] == 0 and lw.grad[1, 2] == 0 and lw.grad[1, 3] == 0
    assert ll.grad[0, 2] == 0 and ll.grad[0, 3] == 0


# ---------------------------------------------------------------- KTO
def test_kto_reference_point_mean_and_clamp():
    # masked sums: 0.7 + 0.3 = 1.0 and -0.2 (pad 50 ignored) -> mean 0.4
    z0 = kto_reference_point(t([[0.7, 0.3], [-0.2, 50.0]]), t([[1, 1], [1, 0]]))
    assert z0.item() == pytest.approx(0.4, abs=1e-12)
    assert z0.dim() == 0
    # masked sums -1.0, -2.0 -> mean -1.5 -> clamped to 0
    x = t([[-1.0, 0.0], [-1.5, -0.5]]).requires_grad_(True)
    z0 = kto_reference_point(x, t([[1, 1], [1, 1]]))
    assert z0.item() == 0.0
    assert not z0.requires_grad and z0.grad_fn is None


def test_kto_reference_point_has_no_grad_when_positive():
    x = t([[1.0, 2.0]]).requires_grad_(True)
    z0 = kto_reference_point(x, t([[1, 1]]))
    assert z0.item() == 3.0 and not z0.requires_grad


def test_kto_hand_computed_with_z0_and_weights():
    # r = [2.0, -1.0, 0.5]; labels [D, U, D]; z0 = 0.4; beta 0.1; w_D = 1.1, w_U = 1.0
    x = t([[1.5, 0.5, 9.0], [-1.0, 0.0, -9.0], [0.25, 0.25, 0.0]]).requires_grad_(True)
    mask = t([[1, 1, 0], [1, 1, 0], [1, 1, 1]])
    lab = torch.tensor([True, False, True])
    z0 = torch.tensor(0.4, dtype=D, requires_grad=True)  # detached inside the loss
    loss, m = kto_loss(x, mask, lab, z0, 0.1, desirable_weight=1.1, undesirable_weight=1.0)
    e0 = 1.1 * (1 - sig(0.1 * (2.0 - 0.4)))
    e1 = 1.0 * (1 - sig(0.1 * (0.4 - (-1.0))))
    e2 = 1.1 * (1 - sig(0.1 * (0.5 - 0.4)))
    assert loss.item() == pytest.approx((e0 + e1 + e2) / 3, rel=1e-12)
    assert m["kto/z0"] == pytest.approx(0.4)
    assert m["kto/reward_desirable"] == pytest.approx(0.1 * (2.0 + 0.5) / 2, abs=1e-12)
    assert m["kto/reward_undesirable"] == pytest.approx(0.1 * -1.0, abs=1e-12)
    assert m["kto/frac_desirable"] == pytest.approx(2 / 3)
    loss.backward()
    assert z0.grad is None


def test_kto_gradient_hand_derived():
    x = t([[2.0, 7.0], [-1.0, 7.0]]).requires_grad_(True)
    mask = t([[1, 0], [1, 0]])
    lab = torch.tensor([True, False])
    z0 = torch.tensor(0.0, dtype=D)
    loss, _ = kto_loss(x, mask, lab, z0, 0.1, 1.1, 1.0)
    loss.backward()
    # d/dr w(1 - s(b r)) = -w b s(b r)(1 - s(b r)); d/dr w(1 - s(-b r)) = +w b s(-b r)(1 - s(-b r))
    s0, s1 = sig(0.2), sig(0.1)
    g = [[-1.1 * 0.1 * s0 * (1 - s0) / 2, 0.0], [1.0 * 0.1 * s1 * (1 - s1) / 2, 0.0]]
    torch.testing.assert_close(x.grad, t(g), rtol=1e-12, atol=0)


def test_kto_zero_logratios_give_half_weight():
    z = torch.zeros(5, 3, dtype=D)
    lab = torch.tensor([True, False, True, False, False])
    loss, _ = kto_loss(z, torch.ones_like(z), lab, torch.tensor(0.0), 0.1, 1.1, 1.0)
    assert loss.item() == pytest.approx((2 * 0.5 * 1.1 + 3 * 0.5 * 1.0) / 5, rel=1e-15)


# ---------------------------------------------------------------- GRPO
EPS = 0.2
# row0 A=+1: rho 1.5 (clipped to 1.2), rho 0.5 (min picks unclipped 0.5), rho 1.1 (inside)
# row1 A=-1: rho 0.5 (min(-0.5, -0.8) = clipped -0.8), rho 1.5 (min(-1.5,-1.2) = unclipped), pad
RATIO = [[math.log(1.5), math.log(0.5), math.log(1.1)], [math.log(0.5), math.log(1.5), 5.0]]
MASK = [[1, 1, 1], [1, 1, 0]]
ADV = [1.0, -1.0]
PG = [[-1.2, -0.5, -1.1], [0.8, 1.5]]


def k3(l: float) -> float:
    return math.exp(-l) + l - 1  # exp(ref - pol) - (ref - pol) - 1 with ref - pol = -l


KL = [[0.5, -0.5, 0.0], [1.0, 0.0, 9.0]]
K3 = [[k3(0.5), k3(-0.5), 0.0], [k3(1.0), 0.0]]


def test_k3_known_values():
    assert k3(0.5) == pytest.approx(math.exp(-0.5) + 0.5 - 1)
    _, m = grpo_loss(t([[0.0]]), t([[0.5]]), t([[1]]), t([0.0]), EPS, 0.0)
    assert m["grpo/kl"] == pytest.approx(math.exp(-0.5) + 0.5 - 1, rel=1e-12)
    _, m = grpo_loss(t([[0.0]]), t([[-1.0]]), t([[1]]), t([0.0]), EPS, 0.0)
    assert m["grpo/kl"] == pytest.approx(math.exp(1.0) - 1.0 - 1, rel=1e-12)


def test_grpo_token_mean_hand_computed():
    beta = 0.05
    loss, m = grpo_loss(t(RATIO), t(KL), t(MASK), t(ADV), EPS, beta, "token_mean")
    tok = [p + beta * k for rp, rk in zip(PG, K3) for p, k in zip(rp, rk)]
    assert loss.item() == pytest.approx(sum(tok) / 5, rel=1e-12)
    assert m["grpo/clip_fraction"] == pytest.approx(4 / 5)  # all but rho=1.1
    assert m["grpo/ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1 + 0.5 + 1.5) / 5, rel=1e-12)
    assert m["grpo/kl"] == pytest.approx(sum(sum(r) for r in K3) / 5, rel=1e-12)
    assert m["grpo/advantage_abs"] == 1.0


def test_grpo_seq_mean_hand_computed():
    beta = 0.05
    loss, _ = grpo_loss(t(RATIO), t(KL), t(MASK), t(ADV), EPS, beta, "seq_mean")
    s0 = sum(p + beta * k for p, k in zip(PG[0], K3[0])) / 3
    s1 = sum(p + beta * k for p, k in zip(PG[1], K3[1])) / 2
    assert loss.item() == pytest.approx((s0 + s1) / 2, rel=1e-12)


def test_grpo_pg_only_token_vs_seq_mean():
    tm, _ = grpo_loss(t(RATIO), t(KL), t(MASK), t(ADV), EPS, 0.0, "token_mean")
    sm, _ = grpo_loss(t(RATIO), t(KL), t(MASK), t(ADV), EPS, 0.0, "seq_mean")
    assert tm.item() == pytest.approx((-1.2 - 0.5 - 1.1 + 0.8 + 1.5) / 5, rel=1e-12)
    assert sm.item() == pytest.approx(((-1.2 - 0.5 - 1.1) / 3 + (0.8 + 1.5) / 2) / 2, rel=1e-12)


def test_grpo_gradient_zero_on_clipped_tokens():
    x = t(RATIO).requires_grad_(True)
    loss, _ = grpo_loss(x, t(KL), t(MASK), t(ADV), EPS, 0.05, "token_mean")
    loss.backward()
    # d/dl [-A rho] = -A rho on unclipped tokens, / 5 tokens; KL input is a separate tensor
    expected = [[0.0, -1.0 * 0.5 / 5, -1.0 * 1.1 / 5], [0.0, 1.0 * 1.5 / 5, 0.0]]
    torch.testing.assert_close(x.grad, t(expected), rtol=1e-12, atol=0)
    assert x.grad[0, 0] == 0 and x.grad[1, 0] == 0  # clipped in the direction A pushes


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
def test_grpo_reference_equals_policy(agg):
    # lengths 3, 1, 2; ratio 1, KL 0 -> per token -A
    mask = t([[1, 1, 1], [1, 0, 0], [1, 1, 0]])
    adv = t([0.5, -1.0, 2.0])
    z = torch.zeros(3, 3, dtype=D)
    loss, m = grpo_loss(z, z, mask, adv, EPS, 0.04, agg)
    expected = -(0.5 * 3 - 1.0 * 1 + 2.0 * 2) / 6 if agg == "token_mean" else -(0.5 - 1.0 + 2.0) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-15)
    assert m["grpo/ratio_mean"] == 1.0 and m["grpo/kl"] == 0.0 and m["grpo/clip_fraction"] == 0.0


def test_grpo_unknown_aggregation_raises():
    z = torch.zeros(1, 2, dtype=D)
    with pytest.raises(ValueError, match="aggregation"):
        grpo_loss(z, z, torch.ones_like(z), t([1.0]), EPS, 0.0, "sum")
