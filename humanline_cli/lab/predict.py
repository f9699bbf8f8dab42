"""Predicted wall-clock of a training run from the work it counts (pure arithmetic). By phase, for T steps and
R calls (call r: m_r sequences, G_r tokens, longest L_r) on g devices:

    sample = sum_r [c_call + max(G_r / S(m_r / g) g, ceil(m_r / (c g)) L_r s_lat)]   (throughput vs latency bound)
    push   = R (c_push + W / b_push);   label = sum_r m_r c_label / g
    train  = T c_step + F P N_train / (g Phi),   F = 6 + 2 [reference forward] + 2 [gradient checkpointing]
    sync   = Y (c_sync + W / b_sync);   other = c_once + T c_other + N_train c_other_tok

S is the sampler's measured tokens/s curve, log-linear in sequences per device (the peak without one); every
call is scaled by `sample_loop_factor`. Asynchronous rounds overlap round r + 1's sampling with round r's
training, wall = s_1 + sum_r max(t_r, s_(r+1)), each phase scaled by the target's `async_*_factor`.
"""
from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields

import numpy as np

from humanline_cli.report.cost import Call

# W per parameter by the run's backend.precision: the bytes one push or sync writes, the copy's dtype. fp32: 4. bf16
# (autocast over fp32 master weights and AdamW, which stay in the trainer and are never copied): the reference's
# linear weights and a vLLM engine's are bf16, 2. fp64: 8. A machine's constants are measured in one precision
# (its `precision`) and predict runs of that precision only: bf16's matmuls, casts and fp32 head make another step.
COPY_BYTES_PER_PARAM = {"fp32": 4, "bf16": 2, "fp64": 8}


@dataclass(frozen=True)
class Target:
    """The constants of one machine; `estimated`: built on public figures, not measured."""

    name: str
    source: str
    estimated: bool
    call_fixed_s: float          # per generation call: engine wake, cache reset, request set-up
    sample_tokens_per_s: float   # one device's peak generated tokens/s (throughput bound)
    decode_step_s: float         # one decoding step with up to `concurrency` sequences in flight (latency bound)
    concurrency: int             # sequences one device decodes at once
    push_fixed_s: float          # per weight push (the FSDP gather and the engine's reload set-up)
    push_bytes_per_s: float      # weight push bandwidth (math.inf: the sampler reads the live weights)
    label_s_per_seq: float       # labeller seconds per completion
    train_flops_per_s: float     # one device: MFU x peak FLOP/s at the run's shapes
    step_fixed_s: float          # per optimizer step, independent of tokens
    sync_fixed_s: float          # per reference sync
    sync_bytes_per_s: float      # device memory copy bandwidth of a sync
    other_step_s: float = 0.0    # per step, outside the phases (collation, logging)
    other_once_s: float = 0.0    # once per run, outside the phases (lazy set-up)
    other_s_per_token: float = 0.0  # outside the phases, per forward token of a step (collation)
    gpus: int = 1
    # asynchronous rounds share the host: a phase's time beside the other process over its time alone
    async_sample_factor: float = 1.0
    async_train_factor: float = 1.0
    async_other_factor: float = 1.0
    sample_curve: tuple = ()     # ((sequences per call on one device, tokens/s), ...) measured, by size
    sample_loop_factor: float = 1.0  # a call inside the training loop over the same call timed alone
    notes: dict = field(default_factory=dict, compare=False)  # constant -> where its value comes from


@dataclass(frozen=True)
class Work:
    """What one run does, counted (machine-independent)."""

    params: float                 # P: parameters each token multiplies
    weight_bytes: float           # W: bytes of one copy of the weights
    calls: tuple                  # Call per generation call, in order
    steps: int                    # T: optimizer steps
    train_tokens: float           # N_train: tokens through the policy's forward, all steps
    reference_forward: bool       # the reference's log-probs are computed every step (no cache)
    gradient_checkpointing: bool
    syncs: int                    # Y: reference syncs
    async_lag: int = 0


def flops_per_token(work: Work) -> float:
    return (6 + 2 * work.reference_forward + 2 * work.gradient_checkpointing) * work.params


def sample_rate(t: Target, sequences: float) -> float:
    """One device's tokens/s for a call of `sequences` on it: the curve, log-linear, held at its ends."""
    if not t.sample_curve:
        return t.sample_tokens_per_s
    m, r = zip(*sorted(t.sample_curve))
    return float(np.interp(math.log(max(sequences, m[0])), np.log(m), r))


def generation_s(call: Call, t: Target) -> float:
    waves = math.ceil(call.sequences / (t.concurrency * t.gpus)) if call.sequences else 0
    return max(call.tokens / (sample_rate(t, call.sequences / t.gpus) * t.gpus), waves * call.longest * t.decode_step_s)


def call_s(call: Call, t: Target) -> float:
    return t.call_fixed_s + generation_s(call, t)


def _copy_s(fixed: float, nbytes: float, bandwidth: float) -> float:
    return fixed + (0.0 if math.isinf(bandwidth) else nbytes / bandwidth)


def predict(work: Work, t: Target) -> dict:
    """Seconds by phase (plus `wait_for_sample` under asynchronous rounds) and `loop`, the loop's wall-clock."""
    r = len(work.calls)
    overlap = bool(work.async_lag and r)
    f_sample, f_train, f_other = (t.async_sample_factor, t.async_train_factor, t.async_other_factor) if overlap \
        else (1.0, 1.0, 1.0)
    per_call = [f_sample * t.sample_loop_factor * call_s(c, t) for c in work.calls]
    out = {"sample": sum(per_call), "push": r * _copy_s(t.push_fixed_s, work.weight_bytes, t.push_bytes_per_s),
           "label": sum(c.sequences for c in work.calls) * t.label_s_per_seq / t.gpus,
           "train": f_train * (work.steps * t.step_fixed_s
                               + flops_per_token(work) * work.train_tokens / (t.gpus * t.train_flops_per_s)),
           "sync": work.syncs * _copy_s(t.sync_fixed_s, work.weight_bytes, t.sync_bytes_per_s),
           "other": f_other * (t.other_once_s + work.steps * t.other_step_s + work.train_tokens * t.other_s_per_token)}
    trainer = out["push"] + out["label"] + out["train"] + out["sync"] + out["other"]
    out["loop"] = out["sample"] + trainer
    if overlap:  # rounds hold equal steps, so each takes an equal share of the trainer's time
        out["loop"] = per_call[0] + sum(max(trainer / r, s) for s in per_call[1:] + [0.0])
        out["wait_for_sample"] = out["loop"] - trainer
    return out


def within(predicted: float, measured: float, tolerance: float = 0.15) -> bool:
    return measured > 0 and abs(predicted / measured - 1.0) <= tolerance


def target_from_json(d: dict) -> Target:
    c, skip = d["constants"], ("name", "source", "estimated", "gpus", "sample_curve", "notes")
    constants = {f.name: (math.inf if c[f.name] in ("inf", "Infinity") else c[f.name]) if f.default is MISSING
                 else float(c.get(f.name, f.default)) for f in fields(Target) if f.name not in skip}
    return Target(name=d.get("target", "this"), source=d.get("source", "?"), estimated=bool(d.get("estimated", False)),
                  gpus=int(c.get("gpus", 1)), sample_curve=tuple((float(m), float(r)) for m, r in c.get("sample_curve", ())),
                  **constants)
