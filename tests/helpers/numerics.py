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
  written next to them (see test_tensor_ops.close).
"""
from __future__ import annotations

import pytest

FP64 = ["backend.precision=fp64"]
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
