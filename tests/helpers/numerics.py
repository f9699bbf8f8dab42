"""Bounds for tests that compare two computations equal in exact arithmetic (packed vs padded, N ranks
vs 1, micro-batch 4 vs 8, chunked vs full logits, ...). Such a pair differs only in the order of the
floating-point operations, and that order depends on the CPU's vectorised kernels (ATEN_CPU_CAPABILITY:
default, avx2, avx512), so a bound tuned on one machine fails on another. The rules here:

- Whole training runs are compared in float64 (`FP64`: backend.precision=fp64). In float32 no honest
  tight bound exists for them: AdamW's first steps move each weight by lr * m / (sqrt(v) + eps), which
  turns a rounding difference d in a gradient component g with |g| ~ eps = 1e-8 into a weight
  difference of up to ~lr * d / eps (float32: d ~ 1e-7 * |grad| -> 1e-2 * lr), and later steps carry it
  on. In float64, d ~ 1e-16 * |grad| * (terms summed, <= 1e4), so lr * d / eps stays below ~1e-9.
- Single forward/backward comparisons stay in float32 where they test float32 paths, with the bound
  written next to them (see numerics.close).
"""
from __future__ import annotations

import pytest
import torch

from humanline_cli.data.collate import make_seqs

FP64 = ["backend.precision=fp64"]
# Runs compared with one that cannot share prompts (FSDP2, gradient checkpointing, packing) run padded too:
# transformers' RMSNorm computes in float32 whatever the model's dtype, so summing a prompt's gradients over its
# rows before the norm's backward (train.shared_prefix) moves float64 runs by float32 rounding (~1e-8). The shared
# path has its own float64 tests (tests/core/test_shared_prefix.py), with the norm in float64.
PADDED = ["train.shared_prefix=false"]
# float64 run-level bound: relative 1e-9 of the value's own scale (and 1e-12 absolute for values ~0).
# Rounding is ~1e-16 per operation; a 3-step tiny run accumulates at most ~1e4 of them per number and
# AdamW's eps amplification (above) adds < 1e-9. Observed (packed vs padded runs): <= 2.3e-16 relative
# under ATEN_CPU_CAPABILITY=avx512, avx2 and default.
RUN_REL, RUN_ABS = 1e-9, 1e-12
# The saved model (model/model.safetensors) is float32 even for an fp64 run (train.save_dtype=auto): two
# float64 weights within RUN_REL of each other may round to neighbouring float32 values, one ulp apart,
# i.e. up to 2^-23 of max(1, max |w|) (max_weight_diff's scale). Well below any real difference (> 1e-4).
SAVED_REL = 2.0**-23


def assert_same_rows(a_rows: list[dict], b_rows: list[dict], keys=("loss", "grad_norm"), what="") -> None:
    """Per-step logged metrics of two float64 runs agree to RUN_REL/RUN_ABS."""
    assert [r["step"] for r in a_rows] == [r["step"] for r in b_rows] and a_rows
    for a, b in zip(a_rows, b_rows):
        for k in keys:
            assert b[k] == pytest.approx(a[k], rel=RUN_REL, abs=RUN_ABS), (what, a["step"], k, a[k], b[k])


def max_weight_diff(a: dict, b: dict) -> float:
    """max |a - b| over every tensor of two state dicts with the same keys, relative to max(1, max |a|)."""
    assert a.keys() == b.keys() and a
    return max(float((a[k].double() - b[k].double()).abs().max()) / max(1.0, float(a[k].abs().max())) for k in a)


def random_seqs(vocab: int, n: int = 5, seed: int = 1):
    """Right-padded prompt+completion rows of different lengths; one row has an empty completion."""
    g = torch.Generator().manual_seed(seed)
    prompts, comps = [], []
    for i in range(n):
        p_len = int(torch.randint(2, 7, (1,), generator=g))
        c_len = 0 if i == n - 1 else int(torch.randint(1, 9, (1,), generator=g))
        prompts.append(torch.randint(1, vocab, (p_len,), generator=g).tolist())
        comps.append(torch.randint(1, vocab, (c_len,), generator=g).tolist())
    return make_seqs(prompts, comps, pad_id=0)


def values_and_grads(fn, model, seqs):
    """token log-probs and the gradient of a fixed weighted sum of them w.r.t. every trainable parameter."""
    model.zero_grad(set_to_none=True)
    logps = fn(model, seqs)
    weights = torch.linspace(-1.0, 2.0, logps.numel()).reshape(logps.shape)
    (logps * weights).sum().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}
    return logps.detach(), grads


F64_TOL = 1e-10


def close(a: torch.Tensor, b: torch.Tensor, tol: float = F64_TOL) -> bool:
    """max |a - b| <= tol * max(1, max |b|), for two float64 computations equal in exact arithmetic.

    Why 1e-10: the two paths differ only in summation order (matmul blocking, chunking, packing), each
    sum has n <= a few hundred terms, so each result is off by at most ~n * 1.1e-16 * sum|terms|; with
    terms up to ~100x the result (log-softmax over spread logits) that is < 1e-11 of the scale. In
    float32 the same argument gives ~1e-3, too loose to mean anything, hence float64 (observed: ~1e-15)."""
    assert a.dtype == b.dtype == torch.float64, "compare float64 computations (spread_llama(dtype=torch.float64))"
    return float((a - b).abs().max()) <= tol * max(1.0, float(b.abs().max()))


def assert_same(a, b, tol=F64_TOL):
    (va, ga), (vb, gb) = a, b
    assert close(va, vb, tol), float((va - vb).abs().max())
    assert ga.keys() == gb.keys() and ga
    for k in ga:
        assert close(ga[k], gb[k], tol), (k, float((ga[k] - gb[k]).abs().max()))
