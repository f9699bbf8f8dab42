"""Sharded loading under FSDP2 (train/sharded_load.py) on 2 gloo ranks: every rank's shards of the policy and
of the reference equal those of today's full path (load the whole model, deep-copy, shard) bitwise in
float64, and so do the log-probs, the loss and the gradients of one step; a checkpoint whose names do not
match falls back to the full path; and the memory estimate matches a measured per-rank peak within 25%
while sharded loading measurably lowers the loading peak (`just memory-check`, CPU RSS)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
from transformers import LlamaConfig, Qwen2Config

WORLD = 2
CONFIGS = {  # Qwen2: q/k/v biases and tied embeddings; Llama: untied head, grouped kv heads
    "qwen2-tied": Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                              max_position_embeddings=64),
    "llama": LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         max_position_embeddings=64),
}


def _rank(rank: int, store: str, model_dir: str, out: str) -> None:
    from humanline_cli.backend import clip_grad_norm, shard_model
    from humanline_cli.core.batches import Seqs
    from humanline_cli.core.logprobs import token_logps
    from humanline_cli.core.reference import build_reference
    from humanline_cli.models import load_policy
    from humanline_cli.train.sharded_load import load_policy_sharded, sharded_reference

    tdist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        cpu, f64 = torch.device("cpu"), torch.float64
        full = load_policy(model_dir, cpu, dtype=f64)
        full_ref = build_reference(full, lora=False, moving=True, cache=False, shard=shard_model)
        shard_model(full)
        sharded = load_policy_sharded(model_dir, cpu, f64, shard_model)
        ref = build_reference(sharded, lora=False, moving=True, cache=False,
                              built=sharded_reference(sharded, f64, cpu, shard_model))
        ids = torch.randint(0, full.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(rank))
        seqs = Seqs(ids, torch.ones_like(ids), torch.ones_like(ids, dtype=torch.bool))
        res = {}
        for name, (pol, r) in {"full": (full, full_ref), "sharded": (sharded, ref)}.items():
            params = {n: p.to_local().clone() for n, p in pol.named_parameters()}
            ref_params = {n: p.to_local().clone() for n, p in r.model.named_parameters()}
            buffers = {n: b.clone() for n, b in pol.named_buffers()}
            logps = token_logps(pol, seqs)
            loss = (logps - r.logps(seqs)).pow(2).mean() + logps.mean()
            loss.backward()
            norm = clip_grad_norm(list(pol.parameters()), 1e9, _Dist())
            grads = {n: p.grad.to_local().clone() for n, p in pol.named_parameters()}
            res[name] = {"params": params, "ref": ref_params, "buffers": buffers, "logps": logps.detach(),
                         "loss": loss.detach(), "norm": norm, "grads": grads,
                         "dtypes": sorted({str(p.dtype) for p in pol.parameters()}),
                         "tied": pol.get_input_embeddings().weight is pol.get_output_embeddings().weight,
                         "sharded": all(p.to_local().shape[0] < p.shape[0] for p in pol.parameters()
                                        if p.shape[0] > 1)}
        torch.save(res, f"{out}.{rank}")
    finally:
        tdist.destroy_process_group()


class _Dist:  # backend.Dist of a 2-rank job, for clip_grad_norm's all-reduce
    enabled, rank, world_size = True, 0, WORLD


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_sharded_loading_equals_the_full_path_bitwise(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(CONFIGS[arch]).save_pretrained(tmp_path / "model")
    out = str(tmp_path / "res")
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path / "model"), out), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        res = torch.load(f"{out}.{rank}")
        a, b = res["full"], res["sharded"]
        assert b["dtypes"] == ["torch.float64"] and b["sharded"] and b["tied"] == a["tied"]
        assert a["tied"] == CONFIGS[arch].tie_word_embeddings
        for key in ("params", "ref", "buffers", "grads"):
            assert a[key].keys() == b[key].keys() and len(a[key]) > 0, key
            for name in a[key]:
                assert torch.equal(a[key][name], b[key][name]), (key, name)
        assert torch.equal(a["logps"], b["logps"]) and torch.equal(a["loss"], b["loss"]) and a["norm"] == b["norm"]
        assert float(a["loss"]) != 0.0 and a["norm"] > 0.0


def test_names_that_do_not_match_fall_back_to_the_full_path(tmp_path):
    """transformers renames some legacy checkpoints' tensors while loading; the sharded path reads names as
    they are, so a mismatch (or no local safetensors) returns None and build_parts loads the whole model."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from humanline_cli.train.sharded_load import load_policy_sharded

    def never(_):
        raise AssertionError("sharded a model whose names do not match")

    AutoModelForCausalLM.from_config(CONFIGS["llama"]).save_pretrained(tmp_path / "m")
    file = tmp_path / "m" / "model.safetensors"
    tensors = load_file(file)
    tensors["transformer.wte.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, file, metadata={"format": "pt"})
    assert load_policy_sharded(str(tmp_path / "m"), torch.device("cpu"), torch.float64, never) is None
    assert load_policy_sharded(str(tmp_path / "nowhere"), torch.device("cpu"), torch.float64, never) is None


def test_memory_estimate_matches_the_measured_peak_and_sharded_loading_lowers_it(tmp_path):
    """`just memory-check` on 2 gloo ranks (FSDP2 fp32): a 31M-parameter Llama (124 MB in fp32: vocab 32000,
    hidden 384, 4 layers, grouped kv heads) with random weights, 2 steps of 2 micro-batches of 2 x 128 tokens.
    Measured = each rank's peak RSS (sampled every ms) minus its RSS before loading. The estimate
    (memory.estimate, from the config alone) must be within 25% of it on every rank; the full loading path
    (measured first, then freed) must peak higher than the sharded one. Measured on this machine: estimate
    0.593 GiB, measured 0.598 GiB on both ranks (ratio 1.01); loading 0.278 GiB full, 0.139 GiB sharded."""
    out = tmp_path / "memory_check.json"
    r = subprocess.run([sys.executable, "-m", "humanline_cli.lab.memory_check", "--hidden", "384", "--layers", "4",
                        "--inter", "1024", "--heads", "6", "--kv-heads", "2", "--seqs", "2", "--tokens", "128",
                        "--steps", "2", "--micro", "2", "--loading", "both", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(out.read_text())
    est = report["estimate_gib"]
    assert report["ok"] and report["failures"] == [] and report["ranks"] == 2 and report["strategy"] == "fsdp"
    assert 30e6 < report["model"]["params"] < 32e6
    # the training peak is the estimate's (the backward's start), not the loading one
    assert est["total"] == est["training"] > est["loading"]
    assert len(report["measured"]) == 2
    for row in report["measured"]:
        assert 0.75 <= row["peak_gib"] / est["total"] <= 1.25, row
        assert row["loading_gib"] < 0.75 * row["loading_full_gib"], row  # sharded: about half
        assert 0.75 <= row["loading_gib"] / est["loading"] <= 1.25, row
    assert r.stdout.strip().splitlines()[-1].startswith("  ok (tolerance 25%)")
