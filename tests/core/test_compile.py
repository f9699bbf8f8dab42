"""train.compile: token_logps through a compiled decoder gives the eager values and gradients (float64), the
module itself is untouched (state dict, generate's path), a compile that fails falls back to eager in one line,
and the configs it cannot compile are refused in one line."""
from __future__ import annotations

import pytest
import torch
import torch._inductor.config

from humanline_cli.core import logprobs
from humanline_cli.core.logprobs import _decoder_and_head, compile_decoder, token_logps
from tests.helpers.models import spread_llama
from tests.helpers.numerics import assert_same, random_seqs, values_and_grads

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch on one thread

# The model is float64, but transformers computes the rotary tables in float32 (cos/sin of float32 angles, then
# cast), and inductor's vectorised cos/sin may differ from ATen's by a float32 ulp (6e-8 relative). Through the
# two layers that moved the log-probs by 1.6e-8 relative to their largest and the gradients by 2.0e-7: 1e-6 is
# five times the larger. Every other op is float64 (the eager-vs-eager paths agree to 1e-10).
COMPILED_TOL = 1e-6


@torch._inductor.config.patch(compile_threads=1)  # no pool of compile workers in the suite; the config's own
def test_compiled_decoder_matches_eager_values_and_gradients():  # patch, which restores the key (monkeypatch drops it)
    eager_model, model = spread_llama(dtype=torch.float64), spread_llama(dtype=torch.float64)
    keys = list(model.state_dict())
    assert compile_decoder(model)
    decoder = _decoder_and_head(model)[0]
    assert decoder in logprobs._COMPILED and list(model.state_dict()) == keys  # no submodule added
    for n in (5, 7):  # another batch size and other lengths: the dynamic graph serves them
        seqs = random_seqs(64, n=n, seed=n)
        assert_same(values_and_grads(token_logps, model, seqs), values_and_grads(token_logps, eager_model, seqs),
                    tol=COMPILED_TOL)
    assert decoder in logprobs._COMPILED  # still compiled: nothing fell back


def test_a_failing_compile_runs_eager_with_one_line(monkeypatch, capsys):
    def broken(module, **kwargs):
        def run(**inputs):
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nlong traceback")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    eager_model, model = spread_llama(dtype=torch.float64), spread_llama(dtype=torch.float64)
    assert compile_decoder(model)
    seqs = random_seqs(64)
    assert_same(values_and_grads(token_logps, model, seqs), values_and_grads(token_logps, eager_model, seqs))
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["train.compile: torch.compile failed (RuntimeError: InvalidCxxCompiler: No working C++ compiler "
                   "found); running eager"]
    assert _decoder_and_head(model)[0] not in logprobs._COMPILED  # said once, eager from then on


@pytest.mark.parametrize("overrides, message", [
    (["backend.strategy=fsdp", "backend.nproc=2"], "train.compile=true runs one process or DDP; backend.strategy=fsdp"),
    (["model.lora.r=4"], "train.compile=true compiles full fine-tuning; model.lora.r > 0 is not compiled"),
])
def test_configs_it_cannot_compile_are_refused(overrides, message):
    from hydra import compose, initialize_config_module

    from humanline_cli.config import resolve
    from humanline_cli.errors import UserError

    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose("train", overrides=["train.compile=true", *overrides])
    with pytest.raises(UserError, match=message):
        resolve(cfg)
