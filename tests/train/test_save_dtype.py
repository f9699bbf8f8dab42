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


def test_a_tied_embedding_is_saved_once_in_any_dtype_and_reloads_tied(tmp_path):
    """A dtype conversion copies each state-dict entry, so the tied head and embedding no longer share storage;
    the file still holds the shared tensor once, as an unconverted save_pretrained writes it."""
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaForCausalLM

    from humanline_cli.train.finish import save_model

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    parts = SimpleNamespace(dist=SimpleNamespace(enabled=False, is_main=True), policy=model,
                            tokenizer=SimpleNamespace(save_pretrained=lambda path: None))
    for dtype in (torch.float32, torch.bfloat16):
        out = tmp_path / str(dtype)
        save_model(parts, out, dtype)
        weights = load_file(str(out / "model.safetensors"))
        assert "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights
        back = load_policy(str(out), torch.device("cpu"))
        assert back.lm_head.weight is back.model.embed_tokens.weight
        assert torch.equal(back.model.embed_tokens.weight, model.model.embed_tokens.weight.to(dtype).float())
