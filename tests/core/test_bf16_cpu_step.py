"""The bf16 autocast step on CPU, made faster without changing what the log-ratios are:
- short attention calls run in float32 (core/attention.py: the CPU kernel's bf16 backward is the slow one there);
- the LM head's backward runs in the autocast dtype, its forward (every log-prob) in float32 (logprobs._Float32Head);
- the frozen reference holds its linear layers in bf16 (backend.cast_linears), which must compute the policy's
  log-probs bit for bit, so a sync still makes every log-ratio exactly 0 (train/build.check_reference_cast)."""
from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from humanline_cli.backend import Backend, cast_linears
from humanline_cli.core import attention
from humanline_cli.core.logprobs import head_logits, token_logps
from humanline_cli.core.reference import build_reference
from humanline_cli.train.build import check_reference_cast
from tests.helpers.models import spread_llama
from tests.helpers.numerics import random_seqs

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch on one thread

BF16 = torch.autocast("cpu", dtype=torch.bfloat16)


def _kernel_dtypes(monkeypatch) -> list:
    """The query dtypes torch's SDPA kernel is called with, from here on."""
    seen, kernel = [], F.scaled_dot_product_attention

    def spy(query, key, value, **kwargs):
        seen.append(query.dtype if not torch.is_autocast_enabled("cpu") else torch.get_autocast_dtype("cpu"))
        return kernel(query, key, value, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return seen


def test_short_attention_calls_run_in_float32_under_bf16_autocast(monkeypatch):
    model = spread_llama(seed=3)
    assert attention.use_float32_short_attention(model)
    assert model.config._attn_implementation == attention.NAME
    seqs = random_seqs(64, seed=4)  # rows of at most 14 tokens: every call is short
    seen = _kernel_dtypes(monkeypatch)
    with torch.no_grad(), BF16:
        token_logps(model, seqs)
    assert seen == [torch.float32] * 2  # one call per layer, both float32
    monkeypatch.setattr(attention, "FLOAT32_BELOW", 4)  # now every call is "long": the 16-bit kernel, as sdpa runs it
    seen.clear()
    with torch.no_grad(), BF16:
        token_logps(model, seqs)
    assert seen == [torch.bfloat16] * 2
    seen.clear()
    with torch.no_grad():  # no autocast: float32 as before, whatever the length
        token_logps(model, seqs)
    assert seen == [torch.float32] * 2


def test_float32_attention_gives_the_float32_kernels_output_and_zero_log_ratios_at_a_sync():
    model = spread_llama(seed=3)
    attention.use_float32_short_attention(model)
    layer = model.get_decoder().layers[0].self_attn
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 7, 16, generator=g).to(torch.bfloat16) for _ in range(3))
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    with BF16:
        got, _ = attention.sdpa_cpu(layer, q, k, v, None, is_causal=True)
    want, _ = sdpa_attention_forward(layer, q.float(), k.float(), v.float(), None, is_causal=True)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))
    reference = copy.deepcopy(model)  # as the run's reference is made: after the switch, so both attend alike
    with torch.no_grad(), BF16:
        assert bool((token_logps(model, random_seqs(64, seed=4)) - token_logps(reference, random_seqs(64, seed=4))
                     == 0).all())


def test_the_heads_backward_runs_in_the_autocast_dtype_and_its_forward_in_float32():
    g = torch.Generator().manual_seed(1)
    head = torch.nn.Linear(32, 64, bias=False)
    h = torch.randn(5, 32, generator=g, requires_grad=True)
    up = torch.randn(5, 64, generator=g)
    with BF16:
        logits = head_logits(head, h)
    assert logits.dtype == torch.float32 and torch.equal(logits, F.linear(h, head.weight))  # float32 logits, exactly
    logits.backward(up)
    low = up.to(torch.bfloat16)
    assert torch.equal(head.weight.grad, (low.t() @ h.detach().to(torch.bfloat16)).float())
    assert torch.equal(h.grad, (low @ head.weight.detach().to(torch.bfloat16)).float())
    # the float32 gradient differs from it by bf16 rounding (inputs and output 2^-9 relative each), not by float32's
    exact = up.t() @ h.detach()
    assert 1e-5 < float((head.weight.grad - exact).norm() / exact.norm()) < 3 * 2**-9


def test_a_head_with_hooks_or_without_autocast_keeps_the_float32_backward():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(5, 32, generator=g)
    up = torch.randn(5, 64, generator=g)
    exact = up.t() @ h
    for hooked, autocast in ((True, True), (False, False)):
        head = torch.nn.Linear(32, 64, bias=False)
        calls: list = []
        if hooked:
            head.register_forward_hook(lambda *a, seen=calls: seen.append(1))
        with BF16 if autocast else torch.autocast("cpu", enabled=False):
            logits = head_logits(head, h)
        logits.backward(up)
        assert calls == ([1] if hooked else [])
        assert torch.allclose(head.weight.grad, exact, rtol=1e-5, atol=1e-5)  # float32's, to its rounding


def _linear_dtypes(model: torch.nn.Module) -> set:
    return {m.weight.dtype for layer in model.get_decoder().layers for m in layer.modules()
            if isinstance(m, torch.nn.Linear)}


def test_a_reference_with_bf16_linears_computes_the_policys_logps_bit_for_bit_and_syncs_to_zero():
    policy = spread_llama(seed=3)
    seqs = random_seqs(64, seed=4)
    reference = build_reference(policy, lora=False, moving=True, cache=False,
                                cast=partial(cast_linears, dtype=torch.bfloat16))
    assert _linear_dtypes(reference.model) == {torch.bfloat16} and _linear_dtypes(policy) == {torch.float32}
    assert reference.model.get_decoder().norm.weight.dtype == torch.float32  # the norms and the head keep float32
    assert reference.model.get_output_embeddings().weight.dtype == torch.float32
    check_reference_cast(policy, reference.model, Backend(torch.device("cpu"), torch.bfloat16))
    assert _linear_dtypes(reference.model) == {torch.bfloat16}  # the check passed: kept in bf16
    with torch.no_grad(), BF16:
        assert bool((token_logps(policy, seqs) - reference.logps(seqs) == 0).all())
    with torch.no_grad():  # the policy moves by less than a bf16 step in most weights, then the reference syncs
        for p in policy.parameters():
            p.mul_(1 + 1e-3)
    with torch.no_grad(), BF16:
        assert float((token_logps(policy, seqs) - reference.logps(seqs)).abs().max()) > 1e-4
    reference.sync(policy)
    with torch.no_grad(), BF16:
        assert bool((token_logps(policy, seqs) - reference.logps(seqs) == 0).all())


class _Float32Linear(torch.nn.Linear):
    """A layer that computes outside autocast from float32 weights (as some models' routers do)."""

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            return F.linear(x.float(), self.weight.float())


def test_a_model_with_a_linear_outside_autocast_keeps_a_float32_reference():
    policy = spread_llama(seed=3)
    mlp = policy.get_decoder().layers[0].mlp
    old = mlp.down_proj
    mlp.down_proj = _Float32Linear(old.in_features, old.out_features, bias=False)
    mlp.down_proj.weight = old.weight
    reference = build_reference(policy, lora=False, moving=True, cache=False,
                                cast=partial(cast_linears, dtype=torch.bfloat16))
    seqs = random_seqs(64, seed=4)
    with torch.no_grad(), BF16:
        assert not bool((token_logps(policy, seqs) - reference.logps(seqs) == 0).all())  # bf16-rounded weights
    check_reference_cast(policy, reference.model, Backend(torch.device("cpu"), torch.bfloat16))
    assert _linear_dtypes(reference.model) == {torch.float32}
    with torch.no_grad(), BF16:
        assert bool((token_logps(policy, seqs) - reference.logps(seqs) == 0).all())
