"""Predicted wall-clock of a training run from the work it counts: pure arithmetic, no I/O.

A run of T optimizer steps that makes R generation calls (call r: m_r sequences, G_r generated tokens, the
longest completion L_r tokens) on a target with the constants of `Target` spends, by phase:

    sample = sum_r [ c_call + max(G_r / S_peak, ceil(m_r / (c x g)) x L_r x s_lat) ]
    push   = R x (c_push + W / b_push)
    label  = sum_r m_r x c_label
    train  = T x c_step + F x P x N_train / (g x Phi),   F = 6 + 2 [reference forward] + 2 [gradient checkpointing]
    sync   = Y x (c_sync + W / b_sync)
    other  = c_once + T x c_other + N_train x c_other_tok

with P the parameters every token multiplies, W the bytes of one copy of the weights, N_train the tokens the
policy's forward processes over the run (prompt + completion, all steps), Y the reference syncs (humanline: one
per sync_every steps; plain online: one per round), g the GPUs (data parallel: each samples and trains its share),
Phi = MFU x peak FLOP/s of one device, S_peak the sampler's peak tokens/s on one device, s_lat its seconds per
decoding step with up to c sequences in flight (c: the sampler's concurrency, HF's batch size, vLLM's
max_num_seqs).

Generation is the larger of two bounds: throughput (every generated token costs 1 / S_peak) and latency (each
wave of c x g sequences runs as many decoding steps as its longest completion, each s_lat). Where the sampler's
tokens/s was measured at several call sizes (`sample_curve`, from `humanline bench constants=true`), S_peak is
the rate at the call's own size, interpolated linearly in log(sequences per device) between the measured sizes
and held at the end values outside them: on a CPU the transformers sampler's tokens/s still grows between
calls of 512 and 8,192 sequences (docs/performance.md), so one peak measured at one size mispredicts the
others. The max is the roofline: a call is throughput-bound when it is large, latency-bound when a few long
completions keep a half-empty batch decoding. `c_other` is the loop's own time outside the phases per step (logging,
bookkeeping of each round) and `c_other_tok` its part that grows with the step's tokens (collating micro-batches
tokenizes and pads every sequence: at half the batch a step's `other` is nearly half).

Synchronous rounds add the phases. Asynchronous rounds (lag >= 1, the sampler in its own process) overlap round
r + 1's sampling with round r's training: wall = s_1 + sum_r max(t_r, s_(r+1)), with s_r a call's sampling and
t_r the trainer's time for round r (its steps' train, sync, other, its labelling and push); the trainer's idle
time `wait_for_sample` is that wall minus the trainer's own phases. The two processes share the host, so under
asynchronous rounds each call's sampling, the train phase and `other` are scaled by the target's measured factors
(`async_*_factor`: the phase's time beside the other process over its time alone; 1 where not measured).

The sampler's curve is timed with calls run back to back; a run's calls sit between optimizer steps, which leave
the caches and the heap to training. Every call is scaled by `sample_loop_factor`, the bench's calls inside its own
training loop over the same calls predicted from the curve (1 where not measured).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

LOOP_PHASES = ("sample", "push", "label", "train", "sync", "other")


@dataclass(frozen=True)
class Target:
    """The constants of one machine. `source` says where each comes from; `estimated` marks constants built on
    public figures rather than measured (every prediction on such a target says so)."""

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
    step_fixed_s: float          # per optimizer step, independent of tokens (launches, the optimizer's own pass)
    sync_fixed_s: float          # per reference sync
    sync_bytes_per_s: float      # device memory copy bandwidth of a sync
    other_step_s: float = 0.0    # per step, outside the phases (collation, logging)
    other_once_s: float = 0.0    # once per run, outside the phases (the loop's first step and round: lazy set-up)
    other_s_per_token: float = 0.0  # outside the phases, per forward token of a step (collation)
    gpus: int = 1
    # asynchronous rounds: the sampler process and the trainer run at once and share the host (caches, memory
    # bandwidth, the interpreter's own threads); each factor is that phase's time beside the other over its time
    # alone, measured by `humanline bench constants=true` (1.0: no measurement, e.g. a GPU target's sampler on
    # its own device)
    async_sample_factor: float = 1.0
    async_train_factor: float = 1.0
    async_other_factor: float = 1.0
    sample_curve: tuple = ()     # ((sequences per call on one device, tokens/s), ...) measured, by size
    # a call inside the training loop (between optimizer steps) over the same call timed on its own, back to back:
    # measured from the bench's own loop (1.0: no measurement)
    sample_loop_factor: float = 1.0
    notes: dict = field(default_factory=dict, compare=False)  # constant -> where its value comes from


@dataclass(frozen=True)
class Call:
    sequences: int   # m: completions the call generates
    tokens: int      # G: their generated tokens
    longest: int     # L: the longest completion, tokens


@dataclass(frozen=True)
class Work:
    """What one run does, counted (machine-independent)."""

    params: float                 # P: parameters each token multiplies
    weight_bytes: float           # W: bytes of one copy of the weights (2P in bf16, 4P in fp32)
    calls: tuple                  # Call per generation call, in order
    steps: int                    # T: optimizer steps
    train_tokens: float           # N_train: tokens through the policy's forward, all steps
    reference_forward: bool       # the reference's log-probs are computed every step (no cache)
    gradient_checkpointing: bool
    syncs: int                    # Y: reference syncs
    async_lag: int = 0


def flops_per_token(work: Work) -> float:
    """F x P: forward 2P, backward 4P, the reference's forward 2P, checkpointing's recomputed forward 2P."""
    return (6 + 2 * work.reference_forward + 2 * work.gradient_checkpointing) * work.params


def sample_rate(t: Target, sequences: float) -> float:
    """One device's generated tokens/s for a call of `sequences` sequences on it: the measured curve where
    there is one (log-linear between its points, its end values outside them), else the peak."""
    curve = sorted(t.sample_curve)
    if not curve:
        return t.sample_tokens_per_s
    if sequences <= curve[0][0]:
        return curve[0][1]
    for (m0, r0), (m1, r1) in zip(curve, curve[1:]):
        if sequences <= m1:
            w = (math.log(sequences) - math.log(m0)) / (math.log(m1) - math.log(m0))
            return r0 + w * (r1 - r0)
    return curve[-1][1]


def generation_s(call: Call, t: Target) -> float:
    """One call's decoding time: the larger of the throughput and latency bounds (no fixed cost)."""
    waves = math.ceil(call.sequences / (t.concurrency * t.gpus)) if call.sequences else 0
    throughput = call.tokens / (sample_rate(t, call.sequences / t.gpus) * t.gpus)
    latency = waves * call.longest * t.decode_step_s
    return max(throughput, latency)


def call_s(call: Call, t: Target) -> float:
    return t.call_fixed_s + generation_s(call, t)


def _copy_s(fixed: float, nbytes: float, bandwidth: float) -> float:
    return fixed + (0.0 if math.isinf(bandwidth) else nbytes / bandwidth)


def predict(work: Work, t: Target) -> dict:
    """Predicted seconds by phase (LOOP_PHASES, plus `wait_for_sample` under asynchronous rounds) and `loop`,
    the wall-clock of the training loop (setup, evaluation and saving are not modelled)."""
    r = len(work.calls)
    overlap = bool(work.async_lag and r)
    f_sample, f_train, f_other = ((t.async_sample_factor, t.async_train_factor, t.async_other_factor) if overlap
                                  else (1.0, 1.0, 1.0))
    sample_per_call = [f_sample * t.sample_loop_factor * call_s(c, t) for c in work.calls]
    out = {
        "sample": sum(sample_per_call),
        "push": r * _copy_s(t.push_fixed_s, work.weight_bytes, t.push_bytes_per_s),
        "label": sum(c.sequences for c in work.calls) * t.label_s_per_seq / t.gpus,
        "train": f_train * (work.steps * t.step_fixed_s
                            + flops_per_token(work) * work.train_tokens / (t.gpus * t.train_flops_per_s)),
        "sync": work.syncs * _copy_s(t.sync_fixed_s, work.weight_bytes, t.sync_bytes_per_s),
        "other": f_other * (t.other_once_s + work.steps * t.other_step_s + work.train_tokens * t.other_s_per_token),
    }
    trainer = out["push"] + out["label"] + out["train"] + out["sync"] + out["other"]
    if overlap:
        # each round's share of the trainer's time, in proportion to its steps (rounds hold equal steps)
        per_round = trainer / r
        wall = sample_per_call[0] + sum(max(per_round, sample_per_call[i + 1] if i + 1 < r else 0.0)
                                        for i in range(r))
        out["wait_for_sample"] = wall - trainer
        out["loop"] = wall
    else:
        out["loop"] = out["sample"] + trainer
    return out


def speedup(baseline: dict, other: dict, phase: str = "loop") -> float | None:
    return baseline[phase] / other[phase] if other.get(phase) else None


def within(predicted: float, measured: float, tolerance: float = 0.15) -> bool:
    """The check of the model on this machine: |predicted / measured - 1| <= tolerance."""
    return measured > 0 and abs(predicted / measured - 1.0) <= tolerance


def target_from_json(d: dict) -> Target:
    """A target from `humanline bench constants=true`'s JSON (its `constants`, `source`, `estimated`)."""
    c = d["constants"]
    fields = {k: (math.inf if c[k] in ("inf", "Infinity") else c[k]) for k in (
        "call_fixed_s", "sample_tokens_per_s", "decode_step_s", "concurrency", "push_fixed_s", "push_bytes_per_s",
        "label_s_per_seq", "train_flops_per_s", "step_fixed_s", "sync_fixed_s", "sync_bytes_per_s")}
    curve = tuple((float(m), float(r)) for m, r in c.get("sample_curve", ()))
    factors = {k: float(c.get(k, 1.0)) for k in ("async_sample_factor", "async_train_factor", "async_other_factor",
                                                  "sample_loop_factor")}
    return Target(name=d.get("target", "this"), source=d.get("source", "?"), estimated=bool(d.get("estimated", False)),
                  other_step_s=float(c.get("other_step_s", 0.0)), other_once_s=float(c.get("other_once_s", 0.0)),
                  other_s_per_token=float(c.get("other_s_per_token", 0.0)),
                  gpus=int(c.get("gpus", 1)), sample_curve=curve,
                  **factors, **fields)
