"""Humanline clamp (zero gradient outside the band, any sign) and reference sync."""

from __future__ import annotations

import pytest
import torch

from humanline_cli.core.humanline import (
    HumanlineSpec,
    ReferenceRule,
    clamp_logratios,
    sync_reference,
    unclamped_fraction,
)
from humanline_cli.core.losses import dpo_loss, grpo_loss, kto_loss

D = torch.float64
ON = HumanlineSpec(clamp=True, sync=True)  # band [-1.0, 1.5]

# columns 0 and 3 are strictly outside the band (-3.0 < -1.0, 2.0 > 1.5); 1, 2, 4 inside.
# Inside values with A < 0 and rho = exp(0.5) > 1 + eps: PPO's min still keeps the gradient.
VALUES = [[-3.0, 0.1, -0.1, 2.0, 0.5], [2.5, 0.5, 0.2, -1.7, -0.3]]
OUTSIDE = torch.tensor([[1, 0, 0, 1, 0], [1, 0, 0, 1, 0]], dtype=torch.bool)


def leaf() -> torch.Tensor:
    return torch.tensor(VALUES, dtype=D, requires_grad=True)


def ones() -> torch.Tensor:
    return torch.ones(2, 5, dtype=D)


def check_band_grad(g: torch.Tensor) -> None:
    assert torch.all(g[OUTSIDE] == 0.0), g
    assert torch.all(g[~OUTSIDE] != 0.0), g


def test_defaults():
    s = HumanlineSpec()
    assert (s.clamp, s.sync, s.log_eps_P, s.log_eps_R, s.sync_every) == (False, False, -1.0, 1.5, 1)


def test_clamp_off_is_identity_with_unit_gradient():
    x = leaf()
    y = clamp_logratios(x, HumanlineSpec(clamp=False, sync=True))
    assert torch.equal(y, x)
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_clamp_on_values():
    y = clamp_logratios(leaf(), ON)
    expected = [[-1.0, 0.1, -0.1, 1.5, 0.5], [1.5, 0.5, 0.2, -1.0, -0.3]]
    assert torch.equal(y.detach(), torch.tensor(expected, dtype=D))


def test_clamp_custom_band():
    spec = HumanlineSpec(clamp=True, log_eps_P=-0.2, log_eps_R=0.3)
    y = clamp_logratios(leaf(), spec)
    expected = [[-0.2, 0.1, -0.1, 0.3, 0.3], [0.3, 0.3, 0.2, -0.2, -0.2]]
    assert torch.equal(y.detach(), torch.tensor(expected, dtype=D))


@pytest.mark.parametrize("chosen_row", [0, 1])
def test_dpo_zero_grad_outside_band(chosen_row):
    lw, ll = leaf(), leaf()
    # swap rows for the rejected side so the two pairs have margins of opposite sign
    rej = torch.flip(clamp_logratios(ll, ON), dims=[0])
    loss, _ = dpo_loss(clamp_logratios(lw, ON), ones(), rej, ones(), 0.1)
    loss.backward()
    check_band_grad(lw.grad)
    check_band_grad(ll.grad)


def test_kto_zero_grad_outside_band_both_labels():
    x = leaf()
    for lab in ([True, False], [False, True]):
        x.grad = None
        loss, _ = kto_loss(
            clamp_logratios(x, ON), ones(), torch.tensor(lab), torch.tensor(0.3), 0.1, 1.1, 1.0
        )
        loss.backward()
        check_band_grad(x.grad)


@pytest.mark.parametrize("adv", [[1.0, -1.0], [-1.0, 1.0], [2.0, 0.5], [-2.0, -0.5]])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("eps", [0.2, 5.0])
def test_grpo_zero_grad_outside_band_any_advantage_sign(adv, agg, eps):
    x = leaf()
    kl = torch.tensor(VALUES, dtype=D)  # k3 uses unclamped log-ratios; separate tensor here
    loss, _ = grpo_loss(clamp_logratios(x, ON), kl, ones(), torch.tensor(adv, dtype=D), eps, 0.05, agg)
    loss.backward()
    if eps == 5.0:  # PPO clip [-4, 6] never binds inside the band (rho in [e^-1, e^1.5])
        check_band_grad(x.grad)
    else:  # inside tokens may also be PPO-clipped; outside ones are zero regardless
        assert torch.all(x.grad[OUTSIDE] == 0.0)
        # PPO keeps the gradient iff min() picks the unclipped term: A>0, rho<1+eps or A<0, rho>1-eps
        a = torch.tensor(adv, dtype=D)
        rho = torch.exp(torch.tensor(VALUES, dtype=D))
        keep = ((a[:, None] > 0) & (rho < 1 + eps)) | ((a[:, None] < 0) & (rho > 1 - eps))
        assert torch.all(x.grad[~OUTSIDE & keep] != 0.0)
        assert torch.all(x.grad[~OUTSIDE & ~keep] == 0.0)


def test_grpo_without_clamp_outside_tokens_keep_ppo_gradient():
    # The same tokens without the clamp: PPO's min keeps the gradient where the advantage pushes
    # away from the clip (A > 0 with rho < 1 - eps; A < 0 with rho > 1 + eps). Humanline zeroes it.
    x = leaf()
    adv = torch.tensor([1.0, -1.0], dtype=D)
    loss, _ = grpo_loss(x, torch.zeros(2, 5, dtype=D), ones(), adv, 0.2, 0.0)
    loss.backward()
    assert x.grad[0, 0] != 0  # A > 0, rho = exp(-3) < 0.8 -> unclipped term chosen
    assert x.grad[1, 0] != 0  # A < 0, rho = exp(2.5) > 1.2 -> unclipped term chosen
    assert x.grad[0, 3] == 0  # A > 0, rho = exp(2) > 1.2 -> PPO clip cuts it


def test_clamped_band_edges_contribute_constant():
    # tokens beyond the band contribute exactly the band edge: r = -1.0 + 1.5 = 0.5 per row below
    x = torch.tensor([[-7.0, 9.0], [-1.5, 1.6]], dtype=D)
    loss_a, _ = dpo_loss(
        clamp_logratios(x, ON),
        torch.ones(2, 2, dtype=D),
        torch.zeros(2, 2, dtype=D),
        torch.ones(2, 2, dtype=D),
        0.1,
    )
    y = torch.tensor([[-1.0, 1.5], [-1.0, 1.5]], dtype=D)
    loss_b, _ = dpo_loss(
        y, torch.ones(2, 2, dtype=D), torch.zeros(2, 2, dtype=D), torch.ones(2, 2, dtype=D), 0.1
    )
    assert loss_a.item() == loss_b.item()


def test_unclamped_fraction_hand_example():
    # row0: -2.0 out, -1.0 edge (not strictly inside), 0.0 in, 1.5 edge, 0.7 in -> 2 of 5
    # row1: 1.6 out, -0.99 in, three masked tokens (inside the band, must not count) -> 1 of 2
    x = torch.tensor([[-2.0, -1.0, 0.0, 1.5, 0.7], [1.6, -0.99, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.float32)
    assert unclamped_fraction(x, mask, ON) == pytest.approx(3 / 7)
    assert unclamped_fraction(x, torch.zeros_like(mask), ON) == 1.0


def _sync(hl, step, regime="offline"):
    return ReferenceRule.from_spec(hl, regime).before_optimizer_step(step)


def test_should_sync_schedule():
    steps = range(1, 7)
    assert [_sync(HumanlineSpec(sync=True, sync_every=1), s) for s in steps] == [True] * 6
    k3 = [_sync(HumanlineSpec(sync=True, sync_every=3), s) for s in steps]
    assert k3 == [False, False, True, False, False, True]
    assert not any(_sync(HumanlineSpec(clamp=True, sync=False), s) for s in steps)


@pytest.mark.parametrize("regime,hl,round_reset,sync_steps", [
    ("offline", HumanlineSpec(), False, []),                                  # plain offline: never
    ("online", HumanlineSpec(), True, []),                                    # plain online: each round start
    ("online", HumanlineSpec(clamp=True), True, []),                          # clamp-only online: as plain
    ("offline", HumanlineSpec(clamp=True, sync=True, sync_every=2), False, [2, 4, 6]),
    ("online", HumanlineSpec(clamp=True, sync=True), False, [1, 2, 3, 4, 5, 6]),  # humanline online: no round reset
])
def test_reference_rule_from_spec(regime, hl, round_reset, sync_steps):
    rule = ReferenceRule.from_spec(hl, regime)
    assert rule.at_round_start(True) == round_reset and not rule.at_round_start(False)
    assert [s for s in range(1, 7) if rule.before_optimizer_step(s)] == sync_steps


def test_sync_reference_linear():
    torch.manual_seed(0)
    pol, ref = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    x = torch.randn(5, 4)
    assert not torch.equal(pol(x), ref(x))
    ids = [id(p) for p in ref.parameters()]
    sync_reference(pol, ref)
    assert [id(p) for p in ref.parameters()] == ids  # in place
    for (n1, p1), (n2, p2) in zip(pol.named_parameters(), ref.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
    assert torch.equal(pol(x), ref(x))
    with torch.no_grad():  # a copy, not an alias
        pol.weight.add_(1.0)
    assert not torch.equal(pol.weight, ref.weight)


def test_sync_reference_converts_dtype():
    torch.manual_seed(1)
    pol, ref = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3).to(torch.bfloat16)
    sync_reference(pol, ref)
    assert ref.weight.dtype == torch.bfloat16
    assert torch.equal(ref.weight, pol.weight.detach().to(torch.bfloat16))


def test_sync_reference_tiny_llama():
    from tests.helpers.models import tiny_llama

    shape = dict(vocab_size=32, hidden_size=64, intermediate_size=128, tie_word_embeddings=True)
    pol = tiny_llama(0, **shape).eval()
    ref = tiny_llama(1, **shape).eval()
    ids = torch.randint(0, 32, (2, 7))
    with torch.no_grad():
        assert not torch.equal(pol(input_ids=ids).logits, ref(input_ids=ids).logits)
    sync_reference(pol, ref)
    sp, sr = pol.state_dict(), ref.state_dict()
    assert sp.keys() == sr.keys()
    for k in sp:
        assert torch.equal(sp[k], sr[k]), k
    assert ref.lm_head.weight.data_ptr() == ref.model.embed_tokens.weight.data_ptr()  # still tied
    with torch.no_grad():
        assert torch.equal(pol(input_ids=ids).logits, ref(input_ids=ids).logits)
