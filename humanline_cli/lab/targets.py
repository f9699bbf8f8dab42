"""GPU targets for the cost model from public figures (each named with its source) and assumptions (marked
`assumed`): estimates until a GPU run measures them (gpu_check.json supplies the training MFU).

H100 SXM5 and H200 SXM: 989 TFLOP/s dense bf16, 3.35 / 4.8 TB/s HBM, 900 GB/s NVLink 4 (NVIDIA datasheets);
model shapes from the models' config.json. Decoding (vLLM, continuous batching: one wave per call) reads the
weights and every sequence's KV cache once per step, step(c) = c_step + (W + c ctx kv_bytes) / (eta_hbm HBM),
ctx the mean context (prompt + half the completion); the peak tokens/s is c / step(c) at c = 256 (capped by
eta_gen peak / 2P), the latency bound's step step(1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from humanline_cli.lab.predict import Target

GPUS = {  # name: (bf16 dense FLOP/s, HBM bytes/s, NVLink bytes/s, source)
    "h100": (989e12, 3.35e12, 900e9, "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM5)"),
    "h200": (989e12, 4.8e12, 900e9, "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM)"),
}


@dataclass(frozen=True)
class Shape:
    """Matmul parameters (FLOPs), all parameters (bytes), KV bytes per token."""
    name: str
    matmul_params: float
    params: float
    kv_bytes_per_token: float  # bf16: 2 (K, V) x layers x kv_heads x head_dim x 2 bytes
    source: str


SHAPES = {
    # 1,543,714,304 params, tied embeddings (the head is the embedding: every parameter multiplies a token),
    # 28 layers, 2 KV heads of 128
    "qwen2_5_1_5b_instruct": Shape("qwen2_5_1_5b_instruct", 1.544e9, 1.544e9, 2 * 28 * 2 * 128 * 2,
                                   "Qwen/Qwen2.5-1.5B-Instruct config.json"),
    # 8,030,261,248 params, untied 128,256 x 4,096 input embedding (a lookup, not a matmul), 32 layers, 8 KV heads
    "llama3_8b_instruct": Shape("llama3_8b_instruct", 8.030e9 - 128256 * 4096, 8.030e9, 2 * 32 * 8 * 128 * 2,
                                "meta-llama/Meta-Llama-3-8B-Instruct config.json"),
}

# Assumptions (docs/performance.md lists what a GPU run must measure to replace each)
ASSUMED = {
    "mfu": 0.40,            # training: counted FLOPs (recomputation included) over peak, FSDP, bf16, 1-8B models
    "eta_hbm": 0.70,        # decoding reaches 70% of HBM bandwidth
    "eta_gen": 0.50,        # decoding's compute bound: half of peak
    "c_step": 0.004,        # s per decoding step outside the kernels (vLLM scheduler, sampler; CUDA graphs)
    "concurrency": 256,     # vLLM max_num_seqs (its default)
    "call_fixed_s": 0.2,    # per call: request set-up, prefix-cache reset
    "push_fixed_s": 1.0,    # per push: the engine's wake-up from sleep mode and its reload set-up
    "step_fixed_s": 0.05,   # per optimizer step: the optimizer's pass and launches
    "sync_fixed_s": 0.001,  # per reference sync
    "verifier_s_per_seq": 0.002,  # a rule-based math verifier, per completion, on one CPU core per rank
}


def gpu_target(gpu: str, shape: Shape, gpus: int, ctx: float, label_s_per_seq: float, mfu: float | None = None,
               mfu_source: str | None = None) -> Target:
    """A target for `gpus` devices of kind `gpu` running `shape` at a mean decoding context of `ctx` tokens."""
    peak, hbm, link, source = GPUS[gpu]
    a = ASSUMED
    w = 2 * shape.params  # bf16 weights
    step = lambda c: a["c_step"] + (w + c * ctx * shape.kv_bytes_per_token) / (a["eta_hbm"] * hbm)  # noqa: E731
    c = a["concurrency"]
    tokens_per_s = min(c / step(c), a["eta_gen"] * peak / (2 * shape.matmul_params))
    m = a["mfu"] if mfu is None else mfu
    # a push: under FSDP the gather of every shard over NVLink, then the engine's in-place copy in HBM
    push_bw = 1 / ((1 / link if gpus > 1 else 0.0) + 2 / hbm)
    notes = {"peak bf16 FLOP/s": f"{peak:.3g} ({source})", "HBM": f"{hbm:.3g} B/s ({source})",
             "NVLink": f"{link:.3g} B/s ({source})", "model": shape.source,
             "mfu": f"{m:g} ({mfu_source or 'assumed'})",
             **{k: f"{v:g} (assumed)" for k, v in a.items() if k != "mfu"},
             "decoding context": f"{ctx:g} tokens (assumed by the setting)"}
    return Target(name=f"{gpus}x{gpu}", source=f"{source}; constants assumed where marked", estimated=True,
                  call_fixed_s=a["call_fixed_s"], sample_tokens_per_s=tokens_per_s, decode_step_s=step(1),
                  concurrency=10**9,  # continuous batching: one wave per call
                  push_fixed_s=a["push_fixed_s"], push_bytes_per_s=push_bw, label_s_per_seq=label_s_per_seq,
                  train_flops_per_s=m * peak, step_fixed_s=a["step_fixed_s"], sync_fixed_s=a["sync_fixed_s"],
                  sync_bytes_per_s=hbm / 2,  # a copy reads and writes every byte
                  other_step_s=0.0, gpus=gpus, notes=notes)


def mfu_from_gpu_check(d: dict) -> float | None:
    """The median MFU of gpu_check.json's step rows (the upper middle of an even count), None without one."""
    values = sorted(c["mfu"] for c in d.get("checks", []) if c.get("check", "").startswith("step_")
                    and c.get("ok") and isinstance(c.get("mfu"), (int, float)) and math.isfinite(c["mfu"]))
    return values[len(values) // 2] if values else None
