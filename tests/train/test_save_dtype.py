"""train.save_dtype: the saved model's weights in the dtype the user chose (auto: bf16 when training
computes in bf16, else fp32), config.json saying so, and the run's own evaluation-ready model loading."""
from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from humanline_cli.backend import Backend
from humanline_cli.models import load_policy
from humanline_cli.train.finish import saved_dtype
from tests.helpers.cli import FAST, TINY_WORLD, run_cli


def test_auto_follows_the_training_compute_dtype():
    cpu = torch.device("cpu")
    assert saved_dtype("auto", Backend(cpu, None)) == torch.float32
    assert saved_dtype("auto", Backend(cpu, torch.bfloat16)) == torch.bfloat16          # bf16 autocast (CUDA)
    assert saved_dtype("auto", Backend(cpu, None, torch.bfloat16)) == torch.bfloat16    # FSDP2 mixed precision
    assert saved_dtype("fp32", Backend(cpu, torch.bfloat16)) == torch.float32
    assert saved_dtype("bf16", Backend(cpu, None)) == torch.bfloat16


def test_save_dtype_bf16_writes_bf16_weights(tmp_path, cache_dir):
    out = tmp_path / "run"
    r = run_cli(["train", *TINY_WORLD, *FAST, "backend=cpu", "objective=dpo", "train.save_dtype=bf16",
                 f"hydra.run.dir={out}"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    weights = load_file(str(out / "model" / "model.safetensors"))
    assert weights and {v.dtype for v in weights.values()} == {torch.bfloat16}
    cfg = json.loads((out / "model" / "config.json").read_text())
    assert cfg.get("torch_dtype", cfg.get("dtype")) == "bfloat16"
    model = load_policy(str(out / "model"), torch.device("cpu"))  # what eval loads: fp32 from the bf16 file
    live = model.state_dict()
    assert all(torch.equal(live[k], w.float()) for k, w in weights.items())  # bf16 -> fp32 is exact
