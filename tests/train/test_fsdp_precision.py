"""FSDP2 on 2 gloo ranks: gradients stay sharded between micro-batches with the same update as one
process (float64, so the comparison is exact up to addition order), bf16 mixed precision keeps fp32
master weights, gradients and AdamW states, and a bf16 FSDP run trains end to end through the CLI."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
from transformers import LlamaConfig

from humanline_cli.backend import shard_model
from humanline_cli.train.trainer import grad_sync
from tests.helpers.cli import FAST, TINY_WORLD, run_cli
from tests.helpers.models import tiny_llama

WORLD = 2
N_SEQS, T, VOCAB = 4, 8, 64


def _model(dtype=torch.float64):
    return tiny_llama(0, vocab_size=VOCAB, num_attention_heads=4, max_position_embeddings=32).to(dtype)


def _data() -> torch.Tensor:
    return torch.randint(0, VOCAB, (N_SEQS, T), generator=torch.Generator().manual_seed(1))


def _loss_sum(model, ids: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy of `ids` (float32/64 logits as the model returns them)."""
    logits = model(input_ids=ids).logits[:, :-1]
    logits = logits if logits.dtype == torch.float64 else logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="sum")


def _rank(rank: int, store: str, out: str, mode: str) -> None:
    tdist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        ids = _data()[rank * 2:(rank + 1) * 2]  # this rank's half of the global batch: 2 micro-batches of 1
        total = (N_SEQS * (T - 1))              # the global batch's token count
        if mode == "accumulate":
            model = _model(torch.float64)
            shard_model(model)
            sharded_after_first = []
            for i in range(2):
                with grad_sync(model, i, 2):
                    # the trainer's scaling: this micro-batch's share of the GLOBAL batch times world size
                    # (FSDP averages gradients over ranks)
                    (_loss_sum(model, ids[i:i + 1]) / total * WORLD).backward()
                if i == 0:
                    sharded_after_first = [p.grad is not None and p.grad.to_local().numel() < p.numel()
                                           for p in model.parameters()]
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            if rank == 0:
                torch.save({"grads": grads, "sharded": sharded_after_first}, out)
        else:  # bf16 mixed precision
            model = _model(torch.float32)
            shard_model(model, torch.bfloat16)
            seen = []
            model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, a, o: seen.append(str(o.dtype)))
            logits_dtype = str(model(input_ids=ids).logits.dtype)
            (_loss_sum(model, ids) / total * WORLD).backward()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            opt.step()
            p = next(model.parameters())
            if rank == 0:
                json.dump({"layer": seen[0], "logits": logits_dtype, "master": str(p.to_local().dtype),
                           "grad": str(p.grad.to_local().dtype),
                           "exp_avg": str(opt.state[p]["exp_avg"].to_local().dtype),
                           "exp_avg_sq": str(opt.state[p]["exp_avg_sq"].to_local().dtype),
                           "sharded": p.to_local().numel() < p.numel()}, open(out, "w"))
        # both ranks done (rank 0's file written) before either tears its group down: one rank's teardown racing
        # the other's last collective ended a rank in std::terminate once, under a loaded suite
        tdist.barrier()
    finally:
        tdist.destroy_process_group()


def _spawn(tmp_path, mode: str) -> str:
    out = str(tmp_path / f"{mode}.out")
    mp.spawn(_rank, args=(str(tmp_path / f"{mode}.store"), out, mode), nprocs=WORLD, join=True)
    return out


def test_fsdp_accumulation_keeps_gradients_sharded_and_matches_one_process(tmp_path):
    """After the FIRST micro-batch's backward every parameter already holds a 1/2-size gradient shard
    (reduce-scattered; before, FSDP kept full unsharded gradients until the last micro-batch), and the
    accumulated gradient equals one process's gradient of the whole batch. float64: the only
    difference is the order of additions, ~1e-16 relative; 1e-12 absolute bounds it with room."""
    res = torch.load(_spawn(tmp_path, "accumulate"))
    assert res["sharded"] and all(res["sharded"])
    model = _model(torch.float64)
    (_loss_sum(model, _data()) / (N_SEQS * (T - 1))).backward()
    for name, p in model.named_parameters():
        diff = float((res["grads"][name] - p.grad).abs().max())
        assert diff < 1e-12, (name, diff)
    assert float(model.lm_head.weight.grad.abs().max()) > 1e-3  # a real gradient, not zeros on both sides


def test_bf16_mixed_precision_keeps_fp32_master_weights_and_adamw(tmp_path):
    """MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) on the decoder layers: they compute in bf16, while
    the root (final norm, LM head) keeps fp32 (the logits come out fp32: core/logprobs.head_logits), and the shards
    AdamW updates, their gradients and both moments are fp32."""
    got = json.load(open(_spawn(tmp_path, "bf16")))
    assert got == {"layer": "torch.bfloat16", "logits": "torch.float32", "master": "torch.float32", "grad": "torch.float32",
                   "exp_avg": "torch.float32", "exp_avg_sq": "torch.float32", "sharded": True}


@pytest.mark.slow
def test_bf16_fsdp_trains_on_two_gloo_ranks(tmp_path, cache_dir):
    """backend.precision=bf16 under FSDP2 runs on CPU (gloo all-gathers bf16). The bf16 reference is
    the bf16 cast of the same weights FSDP casts the policy to, run by the same kernels, so at step 1
    every log-ratio is exactly 0 and DPO's loss is exactly ln 2 (in float32: 0.6931471824645996)."""
    out = tmp_path / "bf16"
    r = run_cli(["train", *TINY_WORLD, *FAST, "backend=cpu", "objective=dpo", "+humanline=true",
                 "backend.strategy=fsdp", "backend.nproc=2", "backend.precision=bf16", f"hydra.run.dir={out}"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "FSDP2 mixed precision: bfloat16 compute, fp32 master weights" in " ".join(r.stderr.split())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-7) and rows[0]["logratio_mean"] == 0.0
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows)
    assert rows[-1]["loss"] != rows[0]["loss"]  # it trained
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "complete"
    # the header's estimate in the summary; the CUDA allocator's peak only on CUDA
    assert summary["memory_gib"]["estimate"] > 0 and summary["memory_gib"]["cuda_max_allocated"] is None


def _rank_logps(rank: int, store: str, out: str) -> None:
    """token_logps on an FSDP2 root (2 ranks, float64): the chunked path (the full-logits path is
    made to fail), its log-probs and the gradients of their sum."""
    from humanline_cli.core import logprobs

    tdist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        def no_full_logits(*a, **k):
            raise AssertionError("full (N, T, V) logits under FSDP")

        logprobs._full_logits_token_logps = no_full_logits
        model = _model(torch.float64)
        shard_model(model)
        seqs = _seqs()
        with torch.no_grad():
            frozen = logprobs.token_logps(model, seqs, chunk_size=3)  # no grad: the reference's route
        lp = logprobs.token_logps(model, seqs, chunk_size=3)  # 3 positions per chunk: several chunks
        lp.sum().backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        if rank == 0:
            torch.save({"logps": lp.detach(), "frozen": frozen, "grads": grads}, out)
    finally:
        tdist.destroy_process_group()


def _seqs():
    from humanline_cli.core.batches import Seqs

    ids = _data()
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # one right-padded row
    loss = torch.zeros_like(ids, dtype=torch.bool)
    loss[:, 3:] = True
    return Seqs(ids, mask, loss & mask.bool())


def test_chunked_logps_under_fsdp_match_one_process(tmp_path):
    """Under FSDP2 token_logps no longer falls back to full logits: the chunked head runs inside the
    root's forward (its hooks gather the head) and the log-probs (with and without grad) and the
    gradients equal one process's to float64 addition-order rounding (1e-12)."""
    from humanline_cli.core.logprobs import token_logps

    out = str(tmp_path / "logps.out")
    mp.spawn(_rank_logps, args=(str(tmp_path / "logps.store"), out), nprocs=WORLD, join=True)
    got = torch.load(out)
    model = _model(torch.float64)
    lp = token_logps(model, _seqs(), chunk_size=3)
    lp.sum().backward()
    assert float((got["logps"] - lp.detach()).abs().max()) < 1e-12
    assert float((got["frozen"] - lp.detach()).abs().max()) < 1e-12
    assert float(lp.detach().abs().sum()) > 1.0  # real log-probs on the completion positions
    for name, p in model.named_parameters():
        assert float((got["grads"][name] - p.grad).abs().max()) < 1e-12, name


def test_memory_estimate_counts_a_bf16_reference_under_fsdp():
    """bf16 under FSDP2 keeps the frozen reference's decoder layers in bf16: 2 bytes per parameter over the ranks
    instead of 4, its root (embeddings 525.3M, head 525.3M, final norm 4,096) in fp32 as the policy's head computes
    (Llama-3-8B's shape, 8 ranks: (2 * (8.03e9 - 1.0507e9) + 4 * 1.0507e9) / 8 bytes = 2.11 GiB instead of 3.74)."""
    from humanline_cli.memory import GB, estimate

    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)
    n = 8_030_261_248  # Llama-3-8B's parameter count (memory.count_params on this config)
    kw = dict(seqs_per_micro=8, max_length=2048, strategy="fsdp", ranks=8, gradient_checkpointing=True, params=n)
    fp32, bf16 = estimate(cfg, **kw), estimate(cfg, **kw, reference_bytes=2.0)
    root = 2 * 128256 * 4096 + 4096
    assert fp32.reference == 4.0 * n / 8 and bf16.reference == (2.0 * (n - root) + 4.0 * root) / 8
    assert round(bf16.reference / GB, 2) == 2.11 and fp32.training - bf16.training == 2.0 * (n - root) / 8
