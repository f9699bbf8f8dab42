"""One `humanline train` job: validate, build, evaluate the starting policy, train, evaluate,
save, write summary.json. Failures leave failed.json (never a summary presented as complete).

The run dir was made ready by the CLI before any rank started (checkpoint.prepare_run_dir: a rerun
of the same config resumes, another config is refused or moved aside), so a job never deletes a
previous run's outputs. With a checkpoint in the run dir the job resumes from the newest one: the
starting policy's evaluation comes from the checkpoint, training continues after its step."""
from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import threading
from pathlib import Path

import torch
import transformers
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table
from safetensors import SafetensorError

from humanline_cli import __version__
from humanline_cli.backend import wait_for_rank0
from humanline_cli.config import RunSpec, resolve
from humanline_cli.errors import RunFailed, UserError
from humanline_cli.eval.evaluator import flat_metrics
from humanline_cli.train.build import build_parts
from humanline_cli.train.checkpoint import Checkpoints
from humanline_cli.train.signals import StepMarker, StopSignal, interrupted_where
from humanline_cli.train.timing import PhaseTimer
from humanline_cli.train.tracking import NullTracker, Tracker, write_failed_json
from humanline_cli.train.trainer import train

UNIT = {"dpo": "pairs", "kto": "examples", "grpo": "groups"}


def _git_commit() -> str | None:
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except Exception:
        return None


def header(spec: RunSpec, parts, console: Console) -> None:
    tr = spec.train
    hl = spec.humanline
    n_params = sum(p.numel() for p in parts.policy.parameters())
    mode = "off"
    if spec.humanline_on:
        mode = (f"clamp [{hl.log_eps_P}, {hl.log_eps_R}]" if hl.clamp else "no clamp") + ", " + (
            f"sync every {hl.sync_every} step(s) before optimizer.step" if hl.sync else "no sync")
    console.print(f"[bold]humanline train[/]: {spec.objective} / {spec.regime} / humanline {mode}")
    console.print(f"  task {spec.task}, model {spec.model} ({n_params / 1e6:.2f}M params), "
                  f"{parts.backend.describe()}, seed {spec.seed}")
    console.print(f"  data: {parts.source.describe()}")
    if getattr(parts, "memory", None) is not None:
        console.print(f"  {parts.memory.describe()}")
    for note in spec.notes:
        console.print(f"  [yellow]note:[/] {note}")
    console.print(f"  {tr.steps} steps; a step sees {tr.batch_size} {UNIT[spec.objective]} "
                  f"(micro-batch {tr.micro_batch_size} x {tr.accumulation} accumulation), lr {tr.lr} "
                  f"({tr.schedule}, warm-up {tr.warmup_ratio:.0%})")


def run_job(cfg: DictConfig, run_dir: Path, console: Console | None = None, spec: RunSpec | None = None) -> dict:
    """One job in this process. Under torch.distributed every rank calls it with the same config and
    run dir; only rank 0 writes outputs (metrics, samples, summary, wandb, model, failed.json). `spec`:
    the config already validated by the caller (one process); ranks validate their own copy."""
    console = console or Console(stderr=True)
    transformers.utils.logging.disable_progress_bar()  # our rich bars are the progress display
    timer = PhaseTimer()
    StepMarker.unwound = None  # a previous job's loop (multirun in one process) says nothing about this one
    main = int(os.environ.get("RANK", "0")) == 0
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
    tracker = parts = None
    peer_failed = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from humanline_cli.train import failures

        def peer_failed() -> bool:  # a rank recorded a failure (a Preempted record is the same signal, not one)
            rec = failures.root_cause(run_dir)
            return rec is not None and rec["type"] != "Preempted"
    trained = False
    stop = StopSignal(peer_failed).__enter__()  # SIGTERM: a checkpoint at the next step boundary, then Preempted
    try:
        spec = spec if spec is not None else resolve(cfg)
        with timer.phase("setup"):
            parts = build_parts(spec, timer, run_dir)
            if not main:
                console = Console(file=io.StringIO())  # one progress display, rank 0's
            tr = spec.train
            checkpoints = Checkpoints(run_dir, tr.checkpoint_every, tr.keep_checkpoints, parts.dist, console)
            resume_from = checkpoints.latest() if spec.resume else None
            tracker = Tracker(run_dir, spec.config, spec.wandb, run_dir.name, resume=resume_from is not None) \
                if main else NullTracker()
            wait_for_rank0()  # rank 0 starts wandb (seconds): the others wait outside the training group's timeout
        resumed = int(resume_from.name.removeprefix("step_")) if resume_from is not None else None
        if resumed is not None:
            console.print(f"humanline: resuming {run_dir} from step {resumed} of {tr.steps} "
                          f"(checkpoints/{resume_from.name}; resume=false starts over)", soft_wrap=True, markup=False,
                          highlight=False)
        header(spec, parts, console)
        if resume_from is None and parts.evaluator is not None:  # a resumed run: from the checkpoint
            with timer.phase("eval"):
                parts.evaluator.set_baseline(parts.eval_sampler)
        last = train(spec, parts, tracker, timer, console, checkpoints, resume_from, stop=stop)
        trained = True  # an interruption from here on lands after training
        summary = finish(spec, parts, tracker, timer, run_dir, last, resumed)
        tracker.finish(0)
        if main:
            print_summary(summary, run_dir, console)
        return summary
    except BaseException as caught:
        e = out_of_memory(caught) or caught  # one line instead of torch's allocator traceback
        failed = {"status": "failed", "error": f"{type(e).__name__}: {e}", "wall_clock_s": timer.report()}
        if isinstance(e, KeyboardInterrupt):  # the step it landed in, for the launching process to report
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C (the agent forwards one) must not
            failed["interrupted"] = interrupted_where(e, trained)  # cut failed.json short
            failed["error"] = "KeyboardInterrupt"  # Ctrl-C (the step is in "interrupted")
            if int(os.environ.get("WORLD_SIZE", "1")) > 1:
                from humanline_cli.train import failures

                failures.record_interrupt(run_dir, int(os.environ.get("RANK", "0")), failed["interrupted"])
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not isinstance(e, KeyboardInterrupt):
            from humanline_cli.train import failures

            # every rank records its own cause; rank 0 reports the root one (another rank's, when
            # rank 0's own error only says that rank went away)
            timeout_s = (cfg.get("backend") or {}).get("timeout_s")  # the spec may not exist yet
            failures.record(run_dir, int(os.environ.get("RANK", "0")), e, timer.report(), timeout_s)
            rec = failures.root_cause(run_dir) if main else None
            failed = failures.failed_json(rec) if rec is not None else failed
            where = failures.interrupted(run_dir) if main and failures.is_secondary(e) else None
            if where is not None:  # Ctrl-C reached another rank first: rank 0 only saw it leave
                failed = failures.interrupted_json(where, timer.report())
        note = write_failed_json(run_dir / "failed.json", failed) if main and run_dir.is_dir() else None
        if note is None and main and isinstance(e, RunFailed) and isinstance(e.__cause__, OSError):
            note = "failed.json written"  # a failed write (a full disk): the line says what failed.json got
        if tracker is not None:
            tracker.finish(1)
        if note is not None and isinstance(e, (UserError, RunFailed)):  # a full disk: the error line says so
            raise type(e)(f"{e}; {note}") from caught
        if e is not caught:
            raise e from caught
        raise
    finally:  # engines, samplers and wandb are released whatever happened (a sweep runs on in this process)
        stop.__exit__()
        if parts is not None:
            parts.close()
        if tracker is not None:
            tracker.finish(0)


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
        tracker.summary(run_summary(spec, parts, timer, last, resumed, None, "trained"))
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
    summary = run_summary(spec, parts, timer, last, resumed, ev, "complete")
    tracker.summary(summary)
    return summary


def run_summary(spec: RunSpec, parts, timer: PhaseTimer, last: dict, resumed: int | None, ev: dict | None,
                status: str) -> dict:
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
        "batch_unit": UNIT[spec.objective],
        "eval": ev,
        "final_train_metrics": last,
        "wall_clock_s": timer.report(),
        "tokens_per_s": {"train": last.get("tokens_per_s"),
                         "sample": getattr(parts.source, "sample_tokens_per_s", lambda: None)()},
        "memory_gib": peak_memory(parts),
        "versions": {"humanline": __version__, "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "git_commit": _git_commit(),
    }


def out_of_memory(e: BaseException) -> RunFailed | None:
    """Out of memory (host RAM under a ulimit or cgroup, or a GPU's) as one RunFailed line, else None."""
    oom_types = tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                                  getattr(torch.cuda, "OutOfMemoryError", None)) if t is not None)
    text = " ".join(ln.strip() for ln in str(e).splitlines() if ln.strip())
    if not (isinstance(e, (MemoryError, *oom_types)) or (
            isinstance(e, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower()))):
        return None
    text = text if len(text) <= 160 else text[:157] + "..."
    return RunFailed(f"out of memory ({type(e).__name__}{': ' + text if text else ''}): lower "
                     f"train.micro_batch_size, or turn on train.gradient_checkpointing or LoRA, or use more ranks")


def peak_memory(parts) -> dict:
    """The memory estimate printed in the header and, on CUDA, what this rank's allocator really peaked
    at (torch.cuda.max_memory_allocated: tensors only, not the CUDA context or allocator slack)."""
    est = getattr(parts, "memory", None)
    out = {"estimate": round(est.total / 1024**3, 3) if est is not None else None, "cuda_max_allocated": None}
    if parts.backend.device.type == "cuda":
        out["cuda_max_allocated"] = round(torch.cuda.max_memory_allocated(parts.backend.device) / 1024**3, 3)
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
    import json

    cfg = json.loads(config.read_text())
    name = str(dtype).removeprefix("torch.")
    for key in ("torch_dtype", "dtype"):
        if key in cfg:
            cfg[key] = name
    config.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


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
