"""The vLLM engine samples in the trainer's compute precision (build.vllm_options' dtype): bfloat16 where training
computes in bf16, float32 elsewhere (fp64 runs too: vLLM has no float64), so the drift/* metrics measure kernels,
never a precision the trainer does not use."""
from __future__ import annotations

import pytest

from humanline_cli.config import compose_train, resolve
from humanline_cli.train.samplers import vllm_options


@pytest.mark.parametrize("backend, want", [
    (["backend=cpu", "backend.precision=bf16"], "bfloat16"),
    (["backend=cpu", "backend.precision=fp32"], "float32"),
    (["backend=cpu", "backend.precision=fp64"], "float32"),
    (["backend=cpu", "backend.precision=null"], "float32"),  # null: the device's default, fp32 on CPU
    (["backend=cuda"], "bfloat16"),  # cuda.yaml: bf16 autocast
    (["backend=cuda", "backend.precision=auto"], "bfloat16"),
    (["backend=cuda", "backend.precision=null"], "bfloat16"),
    (["backend=cuda", "backend.precision=fp32"], "float32"),
])
def test_the_engine_dtype_is_the_trainers_precision(backend, want):
    spec = resolve(compose_train(["sampler=vllm", "data=online", *backend]))
    assert vllm_options(spec)["dtype"] == want
