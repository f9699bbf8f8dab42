"""`humanline bench`: training throughput of the project's own step, plain and humanline, against TRL's trainers
on the same model, data, batch, lengths, threads and precision (docs/performance.md).

    humanline bench [KEY=VALUE ...]

Bench keys (everything else is a Hydra override of the train config: objective=kto, model=..., backend=cuda, ...):
    steps=20        timed optimizer steps per run          warmup=2     untimed steps before them
    repeats=2       runs per system, interleaved           batch_size=  units per step (objective's)
    threads=        torch CPU threads (torch's default)    trl=auto     auto | true | false
    cache=true      also time the cached-reference step (and TRL's precompute_ref_log_probs for DPO/KTO)
    sampler=false   also time HF generate vs vLLM          prompts=64   prompts for the sampler timing
                    (sampler=hf|vllm is the Hydra group: the online sampler)
    objective=grpo data=online: instead, the project's online GRPO steps (sample, label, train) against TRL's
                    GRPOTrainer.train on the same prompts, labeller, data.n, lengths and settings: steps/s of each
    out=runs/bench/<objective>-<time>.json

Systems run interleaved (project, TRL, project, ...) so a shared machine's drift hits all alike; each run builds
everything fresh and times its last `steps` steps. Model FLOP/s counts 8 P T (policy forward+backward, reference
forward; KTO adds 4 P T_kl) against the best FLOP/s of a matmul of the model's MLP shape measured after every run.
"""
from __future__ import annotations

import contextlib
import copy
import gc
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from humanline_cli.bench import trl_runs
from humanline_cli.bench.clock import EndClock, Run, StepClock, built, collect, compose, matmul_peak, train_loop
from humanline_cli.bench.sampling_speed import sampler_bench
from humanline_cli.bench.table import print_result
from humanline_cli.core.objectives import PROPERTIES
from humanline_cli.core.reference import CachedReference
from humanline_cli.errors import Preempted, Terminated, UserError, ignore_ctrl_c, one_line, raise_terminated

DEFAULTS = {"steps": 20, "warmup": 2, "repeats": 2, "batch_size": None, "threads": None, "trl": "auto",
            "cache": True, "sampler": False, "prompts": 64, "out": None}
BOOLEAN = ("cache", "sampler")
SAMPLERS = ("hf", "vllm")  # sampler=NAME is the Hydra group, sampler=true|false the bench key
GRPO_NOTE = ("TRL's GRPOTrainer only trains on its own generations (no offline groups): its row times "
             "GRPOTrainer.compute_loss on the same fixed groups (reference forward, loss, backward, clip, AdamW "
             "step in the bench's loop), not GRPOTrainer.train; data=online compares GRPOTrainer.train")


def parse_args(args: list[str]) -> tuple[dict, list[str]]:
    """KEY=VALUE words -> (bench options, Hydra overrides)."""
    opts, overrides = dict(DEFAULTS), []
    for a in args:
        key, eq, value = a.partition("=")
        if key in DEFAULTS and eq and not (key == "sampler" and value in SAMPLERS):
            opts[key] = _value(key, value)
        elif eq or a.startswith(("+", "~")):
            overrides.append(a)
        else:
            raise UserError(f"bench: expected KEY=VALUE, got {a!r} (humanline bench --help)")
    if opts["steps"] < 1 or opts["warmup"] < 1 or opts["repeats"] < 1:
        raise UserError("bench: steps, warmup and repeats must be >= 1 (the first step is never timed)")
    if opts["prompts"] is None or opts["prompts"] < 1:  # the sampler timing's size: 0 would measure nothing
        raise UserError(f"bench: prompts must be >= 1, got {opts['prompts']}")
    for key in ("batch_size", "threads"):  # null: the config's own; 0 is not "the config's" but nothing
        if opts[key] is not None and (isinstance(opts[key], bool) or opts[key] < 1):
            raise UserError(f"bench: {key} must be >= 1 or null (the config's own), got {opts[key]}")
    return opts, overrides


def _value(key: str, value: str):
    low = value.lower()
    if key == "out" or (key == "trl" and low == "auto"):
        return value if key == "out" else "auto"
    if key in ("trl", *BOOLEAN) and low not in ("true", "false"):
        raise UserError(f"bench: {key} must be {'auto, true' if key == 'trl' else 'true'} or false, got {value!r}")
    if low in ("true", "false", "null", "none", ""):
        return {"true": True, "false": False}.get(low)
    try:
        return int(value)
    except ValueError:
        raise UserError(f"bench: {key} must be an integer, got {value!r}") from None


def compose_spec(overrides: list[str], opts: dict, humanline: bool, extra: tuple[str, ...] = ()):
    user = [o for o in overrides if o.lstrip("+~").split("=")[0] != "humanline"]
    spec = compose(user, (f"train.steps={opts['warmup'] + opts['steps']}", "train.log_every=1000000",
                          "train.save_model=false", "eval.every=0", "eval.n_prompts=1", *extra,
                          *[f"train.batch_size={opts['batch_size']}"] * bool(opts["batch_size"]),
                          *[f"threads={opts['threads']}"] * bool(opts["threads"]), *["humanline=true"] * humanline))
    peer = trl_runs.peer(spec)
    if spec.regime != "offline" and not (peer is not None and peer.row is None and not humanline):
        raise UserError("bench times offline training steps (data=online compares online steps with a TRL trainer "
                        "that generates its own, GRPOTrainer: objective=grpo); drop data=online")
    return spec


def _prefill(parts, steps: int) -> None:
    """The reference log-probs of every sequence the run's steps will draw (a copy of the source draws them), so
    the timed steps find them all in the cache, as epochs after the first do."""
    ghost = copy.deepcopy(parts.source)
    for step in range(1, steps + 1):
        for mb in ghost.next_step(step).micro_batches:
            for seqs in (mb.seqs, *mb.extra_seqs()):
                with parts.backend.autocast():
                    parts.reference.logps(seqs)


def project_run(spec, warmup: int, info: dict, prefill: bool = False) -> Run:
    """The real loop (build_parts + trainer.train) timed from each step's data fetch to the next's."""
    with built(spec) as (parts, timer, _):
        spec = parts.spec
        device = parts.backend.device
        if prefill:
            _prefill(parts, spec.train.steps)
            parts.reference.hits = parts.reference.misses = 0
        parts.source = StepClock(parts.source, device, spec.train.batch_size, policy=parts.train_model)
        tracker = EndClock(spec.train.steps, device)
        train_loop(parts, timer, tracker)
        if "matmul_params" not in info:
            n = sum(p.numel() for p in parts.policy.parameters())
            emb, head = parts.policy.get_input_embeddings(), parts.policy.get_output_embeddings()
            cfg = parts.policy.config.get_text_config()
            info.update(params=n, matmul_params=n if head is not None and head.weight is emb.weight
                        else n - emb.weight.numel(), hidden_size=int(cfg.hidden_size),
                        intermediate_size=int(getattr(cfg, "intermediate_size", 0) or 0)
                        or 4 * int(cfg.hidden_size), backend=parts.backend, tokenizer=parts.tokenizer,
                        units=getattr(parts.source.source, "units", None),
                        micro_batch_size=spec.train.micro_batch_size)
        run = collect(parts.source.starts, tracker.end, parts.source.sizes, warmup)
        # the positions the decoder ran: fewer than the real tokens where rows share a prefix, more where padded
        run.positions = parts.source.positions[warmup:]
        if isinstance(parts.reference, CachedReference):
            run.cache_hit_fraction = parts.reference.stats()["reference_cache/hit_fraction"]
        return run


def summarise(name: str, runs: list[Run], matmul_params: int, peak: float, fp32_peak: float | None = None) -> dict:
    """One system's row; `fp32_peak` (a bf16 run's): its model FLOP/s also as a share of the fp32 matmul peak."""
    seconds, units, tokens, kl = (sum(sum(getattr(r, k)) for r in runs) for k in ("seconds", "units", "tokens", "kl_tokens"))
    flops = 8.0 * matmul_params * tokens + 4.0 * matmul_params * kl
    steps = sum(len(r.seconds) for r in runs)
    row = {"name": name, "units_per_s": units / seconds, "tokens_per_s": tokens / seconds,
           "step_s": seconds / steps, "steps_per_s": steps / seconds, "flops_per_s": flops / seconds,
           "mfu": flops / seconds / peak, "units": units, "tokens": tokens, "kl_tokens": kl, "seconds": seconds,
           "steps_timed": steps, "step_s_per_run": [sum(r.seconds) / len(r.seconds) for r in runs]}
    if fp32_peak:
        row["mfu_fp32"] = flops / seconds / fp32_peak
    if runs[0].precision is not None:
        row["precision"] = runs[0].precision
    if any(r.completions for r in runs):  # online GRPO: per step, as each side recorded them
        row["units_per_step"] = [u for r in runs for u in r.units]
        row["completions_per_step"] = [c for r in runs for c in r.completions]
    if all(r.positions for r in runs):  # the FLOPs the step ran (8 P per decoder position), against the peak
        row["positions"] = sum(sum(r.positions) for r in runs)
        row["run_mfu"] = (8.0 * matmul_params * row["positions"] + 4.0 * matmul_params * kl) / seconds / peak
    hits = [r.cache_hit_fraction for r in runs if r.cache_hit_fraction is not None]
    if hits:
        row["reference_cache_hit_fraction"] = min(hits)
    return row


def _ratio(rows: dict, a: str, b: str, key: str = "units_per_s"):
    return rows[a][key] / rows[b][key] if a in rows and b in rows else None


@dataclass
class BenchPlan:
    """What a bench measures: the plain spec (online: one round per step), the project rows' specs by key, the
    systems in the order each repeat runs them, and the note on TRL's rows."""
    plain: object
    specs: dict
    names: list[str]
    note: str | None


@dataclass
class MatmulPeak:
    """The matmul of the model's MLP shape on the first run's micro-batch, at its best over every run's
    measurement (a busy moment only lowers one), in the steps' dtype and, for a bf16 run, in fp32 too."""
    shape: tuple
    dtype: torch.dtype
    best: float
    fp32: float | None


def run_bench(opts: dict, overrides: list[str], console) -> dict:
    plan = plan_bench(opts, overrides)
    runs, info, note, peak = measure(plan, opts, console)
    return bench_result(plan, opts, runs, info, note, peak)


def plan_bench(opts: dict, overrides: list[str]) -> BenchPlan:
    plain = compose_spec(overrides, opts, humanline=False, extra=("train.reference_cache=false",))
    online = plain.regime == "online"
    if online:  # one round of batch_size prompts per step, as TRL generates one batch per step
        specs = {"plain": compose_spec(overrides, opts, False, ("data.generate_every=1", "train.checkpoint_every=0"))}
        plain = specs["plain"]
    else:
        specs = {"plain": plain, "humanline": compose_spec(overrides, opts, humanline=True),
                 "cached": compose_spec(overrides, opts, humanline=False, extra=("train.reference_cache=true",))}
    want_trl, note = _trl_plan(opts, plain)
    names = ["project"] if online else ["project", "project_humanline"] + ["project_cached"] * opts["cache"]
    if want_trl:  # TRL precomputes the reference over a dataset it trains on (DPOTrainer, KTOTrainer)
        own_data = trl_runs.peer(plain).row is not None
        names += ["trl"] + ["trl_cached"] * (opts["cache"] and own_data and not online)
        note = None if online or own_data else GRPO_NOTE
    return BenchPlan(plain, specs, names, note)


def measure(plan: BenchPlan, opts: dict, console) -> tuple[dict[str, list[Run]], dict, str | None, MatmulPeak]:
    """Every system's runs, interleaved repeat by repeat, the model's facts (info), the note on TRL's rows and
    the matmul peak measured after every run."""
    plain, online = plan.plain, plan.plain.regime == "online"
    runs: dict[str, list[Run]] = {name: [] for name in plan.names}
    info: dict = {}
    note, peaks, fp32_peaks = plan.note, [], []
    for r in range(opts["repeats"]):
        for name in list(runs):
            console.print(f"[dim]bench {plain.objective}: run {r + 1}/{opts['repeats']} {name}[/]")
            gc.collect()  # the previous run's models go before the next run builds its own
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()
            try:
                runs[name].append(_one_run(name, plan.specs, opts["warmup"], info))
            except Exception as e:  # noqa: BLE001 - TRL's vLLM colocate mode may not run on this machine
                if not (online and name == "trl" and plain.sampler_cfg.name == "vllm"):
                    raise
                note = f"TRL GRPOTrainer use_vllm=True vllm_mode=colocate did not run here: {one_line(e)}"
                del runs[name]
                continue
            if not peaks:  # the matmul shape: the model's MLP on the first run's micro-batch size
                r0 = runs["project"][0]
                shape = (max(64, round(sum(r0.tokens) / len(r0.tokens) / plain.train.accumulation)),
                         info["hidden_size"], info["intermediate_size"])
                dtype = info["backend"].autocast_dtype or info["backend"].param_dtype or torch.float32
            peaks.append(matmul_peak(*shape, info["backend"].device, dtype))  # after every run
            if dtype != torch.float32:  # a bf16 run: the fp32 peak beside it, what the same step reaches in fp32
                fp32_peaks.append(matmul_peak(*shape, info["backend"].device, torch.float32))
    return runs, info, note, MatmulPeak(shape, dtype, max(peaks), max(fp32_peaks, default=None))


def bench_result(plan: BenchPlan, opts: dict, runs: dict[str, list[Run]], info: dict, note: str | None,
                 peak: MatmulPeak) -> dict:
    """The bench's JSON: the setting, the machine, each system's row and the ratios between them."""
    plain = plan.plain
    rows = {name: summarise(name, rs, info["matmul_params"], peak.best, peak.fp32) for name, rs in runs.items()}
    backend = info["backend"]
    result = {
        "objective": plain.objective, "unit": PROPERTIES[plain.objective].unit, "task": plain.task, "model": plain.model,
        "regime": plain.regime, "batch_size": plain.train.batch_size, "micro_batch_size": info["micro_batch_size"],
        "max_length": plain.train.max_length, "steps": opts["steps"], "warmup": opts["warmup"],
        "repeats": opts["repeats"], "threads": torch.get_num_threads(), "device": backend.device.type,
        "precision": _precision(backend),
        "params": info["params"], "matmul_params": info["matmul_params"],
        "matmul_peak": {"m": peak.shape[0], "k": peak.shape[1], "n": peak.shape[2],
                        "dtype": str(peak.dtype).removeprefix("torch."), "flops_per_s": peak.best},
        "fp32_matmul_peak": peak.fp32,  # a bf16 run's: the fp32 peak of the same shape (rows' mfu_fp32)
        "precision_why": backend.why,
        "rows": rows,
        "humanline_overhead": _ratio(rows, "project_humanline", "project", "step_s"),
        "trl_ratio": _ratio(rows, "project", "trl"), "trl_humanline_ratio": _ratio(rows, "project_humanline", "trl"),
        "trl_steps_ratio": _ratio(rows, "project", "trl", "steps_per_s"),
        "cache_speedup": _ratio(rows, "project", "project_cached", "step_s"),
        "trl_cached_ratio": _ratio(rows, "project_cached", "trl_cached"), "trl_note": note, "versions": _versions()}
    if plain.regime == "online":
        d = plain.data_cfg
        result["online"] = {"sampler": plain.sampler_cfg.name, "n": d.n, "prompts_per_step": plain.train.batch_size,
                            "max_new_tokens": d.max_new_tokens, "temperature": d.temperature, "lr": plain.train.lr,
                            "beta": plain.objective_cfg.beta, "epsilon": plain.objective_cfg.epsilon}
    if opts["sampler"]:
        result["sampler"] = sampler_bench(plain, info, opts["prompts"])
        for got in result["sampler"].values():  # decoding: a forward of 2 P FLOPs per generated token
            if isinstance(got, dict) and "tokens_per_s" in got:
                got["mfu"] = 2 * info["matmul_params"] * got["tokens_per_s"] / peak.best
    return result


def _precision(backend) -> str:
    """fp32 | fp64 | bfloat16 (autocast, or FSDP2 mixed precision): what the steps computed in; TRL's rows ran
    the same (bf16=True where this is bfloat16)."""
    dtype = backend.autocast_dtype or backend.param_dtype
    if dtype is not None:
        return str(dtype).removeprefix("torch.")
    return "fp64" if backend.weights_dtype == torch.float64 else "fp32"


def _trl_plan(opts: dict, plain) -> tuple[bool, str]:
    """(whether the TRL rows run, the note saying why not)."""
    if opts["trl"] is not False and trl_runs.peer(plain) is None:
        return False, f"objective={plain.objective} has no counterpart in TRL: its TRL rows are skipped"
    want_trl = opts["trl"] is True or (opts["trl"] == "auto" and trl_runs.trl_available())
    if opts["trl"] is True and not trl_runs.trl_available():
        raise UserError("bench: trl=true but TRL is not installed (pip install -e '.[bench]')")
    if want_trl and (plain.model_cfg.lora.r or 0) > 0:  # the TRL rows mirror full fine-tuning only
        return False, "model.lora.r > 0: the TRL comparison covers full fine-tuning only"
    return want_trl, "TRL not installed (pip install -e '.[bench]') or trl=false"


def _one_run(name: str, specs: dict, warmup: int, info: dict) -> Run:
    plain = specs["plain"]
    if name.startswith("project"):
        key = {"project": "plain", "project_humanline": "humanline", "project_cached": "cached"}[name]
        return project_run(specs[key], warmup, info, prefill=name == "project_cached")
    with trl_runs._quiet():
        if plain.regime == "online":
            return trl_runs.trl_online_grpo_run(plain, info, warmup)
        return trl_runs.trl_run(plain, info, warmup, precompute=name == "trl_cached")


def _versions() -> dict:
    out = {}
    for name in ("torch", "transformers", "trl"):
        with contextlib.suppress(PackageNotFoundError):
            out[name] = version(name)
    return out


def check_out(out: Path) -> None:
    """Refuse an `out=` the result could not be written to before measuring, not after."""
    if out.is_dir():
        raise UserError(f"bench: out={out} is a directory; name a file such as {out / 'bench.json'}")
    folder = out.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise UserError(f"bench: cannot write out={out}: {folder} is not a directory")
    try:  # a real write (permission bits say nothing to root, nor about a read-only mount)
        if out.exists():
            with open(out, "a"):
                pass
        else:
            tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise UserError(f"bench: cannot write out={out}: {e.strerror or e}") from None


def main_bench(args: list[str]) -> int:
    from rich.console import Console

    if any(a in ("-h", "--help") for a in args):
        print(__doc__.split("\n\n", 1)[1].split("Systems run")[0].rstrip())
        return 0
    console = Console()
    os.environ.setdefault("WANDB_SILENT", "true")  # as in train: the mini-runs' wandb says nothing on the console
    old = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        opts, overrides = parse_args(args)
        if opts["out"]:
            check_out(Path(opts["out"]))
        res = run_bench(opts, overrides, console)
    except UserError as e:
        print(f"humanline: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # nothing is written before the measurement ends (out= comes last)
        ignore_ctrl_c()  # a second Ctrl-C must not cut this line short
        print("humanline: bench interrupted (Ctrl-C) while measuring; nothing was written", file=sys.stderr)
        return 130
    except (Terminated, Preempted):  # a mini-run's own SIGTERM handling ends in Preempted
        print("humanline: bench stopped by SIGTERM while measuring; nothing was written", file=sys.stderr)
        return 143
    finally:
        signal.signal(signal.SIGTERM, old)
    out = Path(opts["out"] or f"runs/bench/{res['objective']}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print_result(res, console)
    console.print(f"wrote {out}")
    return 0
