"""`humanline bench`: training throughput of the project's own step, plain and humanline, against
TRL's trainers on the same model, data, batch size, lengths, threads and precision; optionally the
sampler (transformers generate vs vLLM). Prints a table and writes a JSON file.

    humanline bench [KEY=VALUE ...]

Bench keys (everything else is a Hydra override of the train config: objective=kto, task=preference,
model=..., backend=cuda, train.max_length=..., train.micro_batch_size=..., hl.sync_every=...):
    steps=20        timed optimizer steps per run          warmup=2     untimed steps before them
    repeats=2       runs per system, interleaved           batch_size=  units per step (objective's)
    threads=        torch CPU threads (torch's default)    trl=auto     auto | true | false
    cache=true      also time the cached-reference step (and TRL's precompute_ref_log_probs for DPO/KTO)
    sampler=false   also time HF generate vs vLLM          prompts=64   prompts for the sampler timing
    async_rounds=0  N > 0: instead, online rounds/s at data.async_lag=0 vs 1 over N rounds, against the
                    bound max(sample, train) per round (bench/async_bench.py)
    constants=false true: instead, the cost model's constants of this machine for the composed online run
                    (bench/constants.py; `humanline report DIR --target FILE` predicts from them): generation
                    at 1, prompts/64, /16, /4 and prompts prompts, training for constant_steps=12 steps at 2
                    batch sizes
    pool=           a.json,b.json,...: instead, one constants file from several sets measured for the same run
                    (each constant's median over them, its spread kept beside it) -> out=
    out=runs/bench/<objective>-<time>.json

Systems run interleaved (project, project+humanline, TRL, project, ...) so a shared machine's drift
hits all alike. The plain row runs with train.reference_cache=false (every step runs the reference
forward, as the first epoch does); the cached row is a plain run whose reference log-probs for the
timed steps were computed before timing (what every epoch after the first costs), next to TRL with
precompute_ref_log_probs=True (its reference pass also runs before its first step). TRL trains on the
same units the project's timed steps draw (batch_size x (warmup + steps) of them).
Each run builds everything fresh (the project: build_parts + trainer.train, the real loop; TRL: its
Trainer.train) and times its last `steps` steps, each from the start of its data fetch to the start
of the next step's. Throughput pools units and tokens over all timed steps of all runs.
Model FLOP/s counts 6 P T for the policy forward+backward plus 2 P T for the reference forward
(KTO adds 4 P T_kl for the two no-grad forwards of its mismatched KL sequences), with P the parameters
every token is multiplied by (all but an untied input embedding), against the best FLOP/s of a
matmul of the model's own MLP shape (fp32; bf16 under CUDA autocast) measured after every run.
On a shared machine use threads=1: with every core busy, OpenMP threads wait on each other and step
times swing several-fold between runs.
"""
from __future__ import annotations

import copy
import gc
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from humanline_cli.bench.clock import EndClock, Run, _now, collect, matmul_peak
from humanline_cli.core.objectives import PROPERTIES
from humanline_cli.core.reference import CachedReference
from humanline_cli.errors import UserError, ignore_ctrl_c
from humanline_cli.sources.source import SourceWrapper

DEFAULTS = {"steps": 20, "warmup": 2, "repeats": 2, "batch_size": None, "threads": None, "trl": "auto",
            "cache": True, "sampler": False, "prompts": 64, "out": None, "async_rounds": 0,
            "constants": False, "constant_steps": 12, "pool": None}
GRPO_NOTE = ("TRL's GRPOTrainer only trains on its own generations (no offline groups): its row times "
             "GRPOTrainer.compute_loss on the same fixed groups (reference forward, loss, backward, clip, AdamW "
             "step in the bench's loop), not GRPOTrainer.train")


# -- arguments -------------------------------------------------------------------------------------
def parse_args(args: list[str]) -> tuple[dict, list[str]]:
    """KEY=VALUE words -> (bench options, Hydra overrides)."""
    opts, overrides = dict(DEFAULTS), []
    for a in args:
        key, eq, value = a.partition("=")
        if key in DEFAULTS and eq:
            opts[key] = _value(key, value)
        elif eq or a.startswith(("+", "~")):
            overrides.append(a)
        else:
            raise UserError(f"bench: expected KEY=VALUE, got {a!r} (humanline bench --help)")
    if opts["steps"] < 1 or opts["warmup"] < 1 or opts["repeats"] < 1:
        raise UserError("bench: steps, warmup and repeats must be >= 1 (the first step is never timed)")
    if opts["trl"] not in ("auto", True, False):
        raise UserError(f"bench: trl must be auto, true or false, got {opts['trl']!r}")
    for key in ("prompts", "constant_steps"):  # sizes of what is measured: 0 would measure nothing
        if opts[key] is None or opts[key] < 1:
            raise UserError(f"bench: {key} must be >= 1, got {opts[key]}")
    return opts, overrides


# keys that take true or false, and nothing else
BOOLEAN = ("cache", "sampler", "constants")


def _value(key: str, value: str):
    if key in ("out", "pool"):
        return value
    low = value.lower()
    if key in BOOLEAN and low not in ("true", "false"):
        raise UserError(f"bench: {key} must be true or false, got {value!r}")
    if low in ("true", "false"):
        return low == "true"
    if key == "trl" and low == "auto":
        return "auto"
    if low in ("null", "none", ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise UserError(f"bench: {key} must be an integer, got {value!r}") from None


def compose_spec(overrides: list[str], opts: dict, humanline: bool, extra: tuple[str, ...] = ()):
    from humanline_cli.config import compose_train, resolve

    user = [o for o in overrides if o.lstrip("+~").split("=")[0] != "humanline"]
    mine = [f"train.steps={opts['warmup'] + opts['steps']}", "train.log_every=1000000", "train.save_model=false",
            "eval.every=0", "eval.n_prompts=1", *extra]
    if opts["batch_size"]:
        mine.append(f"train.batch_size={opts['batch_size']}")
    if opts["threads"]:
        mine.append(f"threads={opts['threads']}")
    cfg = compose_train([*user, *mine])
    if humanline:  # a declared key in newer configs, appended (+) in older ones
        cfg = compose_train([*user, *mine, ("" if "humanline" in cfg else "+") + "humanline=true"])
    spec = resolve(cfg)
    if spec.regime != "offline":
        raise UserError("bench times offline training steps; drop data=online")
    return spec


# -- timing records --------------------------------------------------------------------------------
class _TimedSource(SourceWrapper):
    """Wraps the project's offline source: each next_step call marks the start of a step. An offline
    step always holds batch_size units (pairs, examples or groups)."""

    def __init__(self, source, device, units_per_step: int):
        super().__init__(source)
        self.device, self.units_per_step = device, units_per_step
        self.starts: list[float] = []
        self.sizes: list[tuple[int, int, int]] = []

    def next_step(self, step: int):
        from humanline_cli.core.batches import BinaryBatch

        self.starts.append(_now(self.device))
        data = self.source.next_step(step)
        mbs = data.micro_batches
        self.sizes.append((self.units_per_step, sum(int(mb.seqs.attention_mask.sum()) for mb in mbs),
                           sum(int(mb.kl_seqs.attention_mask.sum()) for mb in mbs if isinstance(mb, BinaryBatch))))
        return data


# -- the project's step ----------------------------------------------------------------------------
def _prefill(parts, steps: int) -> None:
    """Compute the reference log-probs of every sequence the run's steps will draw (a copy of the
    source draws them), so the timed steps find them all in the cache, as epochs after the first do."""
    from humanline_cli.core.batches import BinaryBatch

    ghost = copy.deepcopy(parts.source)
    for step in range(1, steps + 1):
        for mb in ghost.next_step(step).micro_batches:
            for seqs in (mb.seqs, *((mb.kl_seqs,) if isinstance(mb, BinaryBatch) else ())):
                with parts.backend.autocast():
                    parts.reference.logps(seqs)


def project_run(spec, warmup: int, info: dict, prefill: bool = False) -> Run:
    from rich.console import Console

    from humanline_cli.core.humanline import ReferenceRule
    from humanline_cli.train.build import build_parts
    from humanline_cli.train.timing import PhaseTimer
    from humanline_cli.train.trainer import train

    with tempfile.TemporaryDirectory() as tmp:
        timer = PhaseTimer()
        parts = build_parts(spec, timer, Path(tmp))
        spec = parts.spec  # its micro-batch fitted to this machine's memory
        try:
            device = parts.backend.device
            if prefill:
                _prefill(parts, spec.train.steps)
                parts.reference.hits = parts.reference.misses = 0
            parts.source = _TimedSource(parts.source, device, spec.train.batch_size)
            tracker = EndClock(spec.train.steps, device)
            train(spec.train, spec.humanline, parts, objective=spec.objective_cfg,
                  rule=ReferenceRule.from_spec(spec.humanline, spec.regime), tracker=tracker, timer=timer,
                  console=Console(file=io.StringIO()), eval_every=spec.eval_cfg.every)
            if "matmul_params" not in info:
                info.update(_model_info(parts.policy))
                info["backend"] = parts.backend
                info["units"] = parts.source.source.units
                info["tokenizer"] = parts.tokenizer
            run = collect(parts.source.starts, tracker.end, parts.source.sizes, warmup)
            if isinstance(parts.reference, CachedReference):
                run.cache_hit_fraction = parts.reference.stats()["reference_cache/hit_fraction"]
            return run
        finally:
            parts.close()


def _model_info(policy) -> dict:
    n = sum(p.numel() for p in policy.parameters())
    emb, head = policy.get_input_embeddings(), policy.get_output_embeddings()
    tied = head is not None and head.weight is emb.weight
    cfg = policy.config.get_text_config()
    return {"params": n, "matmul_params": n if tied else n - emb.weight.numel(),
            "hidden_size": int(cfg.hidden_size), "intermediate_size": int(getattr(cfg, "intermediate_size", 0) or 0)
            or 4 * int(cfg.hidden_size)}




# -- numbers ---------------------------------------------------------------------------------------
def summarise(name: str, runs: list[Run], matmul_params: int, peak: float) -> dict:
    seconds = sum(sum(r.seconds) for r in runs)
    units = sum(sum(r.units) for r in runs)
    tokens = sum(sum(r.tokens) for r in runs)
    kl = sum(sum(r.kl_tokens) for r in runs)
    flops = 8.0 * matmul_params * tokens + 4.0 * matmul_params * kl
    steps = sum(len(r.seconds) for r in runs)
    row = {"name": name, "units_per_s": units / seconds, "tokens_per_s": tokens / seconds,
           "step_s": seconds / steps, "flops_per_s": flops / seconds, "units": units, "tokens": tokens,
           "kl_tokens": kl, "seconds": seconds, "steps_timed": steps,
           "step_s_per_run": [sum(r.seconds) / len(r.seconds) for r in runs]}
    row["mfu"] = row["flops_per_s"] / peak
    hits = [r.cache_hit_fraction for r in runs if r.cache_hit_fraction is not None]
    if hits:
        row["reference_cache_hit_fraction"] = min(hits)
    return row


# -- the command -----------------------------------------------------------------------------------
def run_bench(opts: dict, overrides: list[str], console) -> dict:
    specs = {"plain": compose_spec(overrides, opts, humanline=False, extra=("train.reference_cache=false",)),
             "cached": compose_spec(overrides, opts, humanline=False, extra=("train.reference_cache=true",)),
             "humanline": compose_spec(overrides, opts, humanline=True)}
    plain = specs["plain"]
    objective = plain.objective
    want_trl, no_trl = _trl_plan(opts, plain)
    info: dict = {}
    runs: dict[str, list[Run]] = {"project": [], "project_humanline": []}
    if opts["cache"]:
        runs["project_cached"] = []
    if want_trl:
        runs["trl"] = []
        if opts["cache"] and objective != "grpo":
            runs["trl_cached"] = []
    peaks = []
    for r in range(opts["repeats"]):
        for name in runs:
            console.print(f"[dim]bench {objective}: run {r + 1}/{opts['repeats']} {name}[/]")
            _release()
            runs[name].append(_one_run(name, specs, opts["warmup"], info))
            if not peaks:  # the matmul shape: the model's MLP on the first run's micro-batch size
                r0 = runs["project"][0]
                shape = (max(64, round(sum(r0.tokens) / len(r0.tokens) / plain.train.accumulation)),
                         info["hidden_size"], info["intermediate_size"])
                dtype = info["backend"].autocast_dtype or torch.float32
            peaks.append(matmul_peak(*shape, info["backend"].device, dtype))  # after every run
    peak = max(peaks)  # a busy moment only lowers a measurement, so the best is the machine's peak
    rows = {name: summarise(name, rs, info["matmul_params"], peak) for name, rs in runs.items()}
    result = _result(plain, opts, info, rows, shape, dtype, peak,
                     (GRPO_NOTE if objective == "grpo" else None) if want_trl else no_trl)
    if opts["sampler"]:
        from humanline_cli.bench.sampling_speed import sampler_bench

        result["sampler"] = sampler_bench(plain, info, opts["prompts"])
        for got in result["sampler"].values():  # decoding: a forward of 2 P FLOPs per generated token
            if isinstance(got, dict) and "tokens_per_s" in got:
                got["mfu"] = 2 * info["matmul_params"] * got["tokens_per_s"] / peak
    return result


def _trl_plan(opts: dict, plain) -> tuple[bool, str]:
    """(whether the TRL rows run, the note saying why not)."""
    from humanline_cli.bench.trl_runs import trl_available

    want_trl = opts["trl"] is True or (opts["trl"] == "auto" and trl_available())
    if opts["trl"] is True and not trl_available():
        raise UserError("bench: trl=true but TRL is not installed (pip install -e '.[bench]')")
    lora = plain.model_cfg.lora.r or 0
    if want_trl and lora > 0:  # the TRL rows mirror full fine-tuning only
        return False, "model.lora.r > 0: the TRL comparison covers full fine-tuning only"
    return want_trl, "TRL not installed (pip install -e '.[bench]') or trl=false"


def _one_run(name: str, specs: dict, warmup: int, info: dict) -> Run:
    """One timed run of the row `name`: the project's loop (plain, humanline, cached reference) or TRL's."""
    from humanline_cli.bench.trl_runs import _quiet, trl_grpo_run, trl_run

    plain = specs["plain"]
    match name:
        case "project":
            return project_run(plain, warmup, info)
        case "project_humanline":
            return project_run(specs["humanline"], warmup, info)
        case "project_cached":
            return project_run(specs["cached"], warmup, info, prefill=True)
        case "trl" if plain.objective == "grpo":
            with _quiet():
                return trl_grpo_run(plain, info, warmup)
        case "trl":
            with _quiet():
                return trl_run(plain, info, warmup)
        case "trl_cached":
            with _quiet():
                return trl_run(plain, info, warmup, precompute=True)
    raise ValueError(f"bench: no run named {name}")


def _result(plain, opts: dict, info: dict, rows: dict, shape: tuple, dtype, peak: float, trl_note) -> dict:
    """bench.json's body: the setup, the rows, and the ratios between them."""
    backend, objective = info["backend"], plain.objective
    return {
        "objective": objective, "unit": PROPERTIES[objective].unit, "task": plain.task, "model": plain.model,
        "batch_size": plain.train.batch_size, "micro_batch_size": plain.train.micro_batch_size,
        "max_length": plain.train.max_length, "steps": opts["steps"], "warmup": opts["warmup"],
        "repeats": opts["repeats"], "threads": torch.get_num_threads(), "device": backend.device.type,
        "precision": "fp32" if backend.autocast_dtype is None else str(backend.autocast_dtype).removeprefix("torch."),
        "params": info["params"], "matmul_params": info["matmul_params"],
        "matmul_peak": {"m": shape[0], "k": shape[1], "n": shape[2], "dtype": str(dtype).removeprefix("torch."),
                        "flops_per_s": peak},
        "rows": rows,
        "humanline_overhead": rows["project_humanline"]["step_s"] / rows["project"]["step_s"],
        "trl_ratio": rows["project"]["units_per_s"] / rows["trl"]["units_per_s"] if "trl" in rows else None,
        "trl_humanline_ratio": (rows["project_humanline"]["units_per_s"] / rows["trl"]["units_per_s"]
                                if "trl" in rows else None),
        "cache_speedup": (rows["project"]["step_s"] / rows["project_cached"]["step_s"]
                          if "project_cached" in rows else None),
        "trl_cached_ratio": (rows["project_cached"]["units_per_s"] / rows["trl_cached"]["units_per_s"]
                             if "trl_cached" in rows else None),
        "trl_note": trl_note,
        "versions": _versions(),
    }


def _release() -> None:
    """Free the previous run's models before the next one starts (each run builds its own)."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _versions() -> dict:
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import trl

        out["trl"] = trl.__version__
    except ImportError:
        pass
    return out


def _main_async(opts: dict, overrides: list[str], console) -> int:
    from humanline_cli.bench.async_bench import async_bench, print_async

    if opts["threads"]:
        overrides = [*overrides, f"threads={opts['threads']}"]
    res = async_bench(overrides, opts["async_rounds"], console)
    return _write_result(res, opts, "async-", print_async, console)


def _main_pool(opts: dict, overrides: list[str], console) -> int:
    from humanline_cli.bench.constants import pool_constants, print_pooled

    if overrides:
        raise UserError(f"bench pool=: takes no overrides (got {' '.join(overrides)})")
    names = [n for n in opts["pool"].split(",") if n]
    sets = []
    for n in names:
        try:
            sets.append(json.loads(Path(n).read_text()))
        except (OSError, ValueError) as e:
            raise UserError(f"bench pool=: cannot read {n} ({type(e).__name__}: {e})") from None
    res = pool_constants(sets, [Path(n).name for n in names])
    return _write_result(res, opts, "constants-pooled-", print_pooled, console)


def _check_out(out: Path) -> None:
    """Refuse an `out=` the result could not be written to before measuring, not after: a directory, a file in a
    folder that is not one, or one that is not writable (the nearest existing folder decides)."""
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


def _write_result(res: dict, opts: dict, prefix: str, printer, console) -> int:
    """The bench's JSON (`out=` or runs/bench/<prefix><objective>-<time>.json), then its table."""
    out = Path(opts["out"] or f"runs/bench/{prefix}{res['objective']}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    printer(res, console)
    console.print(f"wrote {out}")
    return 0


def main_bench(args: list[str]) -> int:
    from rich.console import Console

    if any(a in ("-h", "--help") for a in args):
        print(__doc__.split("\n\n", 1)[1].split("Systems run")[0].rstrip())
        return 0
    console = Console()
    os.environ.setdefault("WANDB_SILENT", "true")  # as in train: the mini-runs' wandb says nothing on the console
    try:
        opts, overrides = parse_args(args)
        if opts["out"]:
            _check_out(Path(opts["out"]))
        if opts["pool"]:
            return _main_pool(opts, overrides, console)
        if opts["async_rounds"]:
            return _main_async(opts, overrides, console)
        if opts["constants"]:
            from humanline_cli.bench.constants import measure, print_constants

            threads = [f"threads={opts['threads']}"] if opts["threads"] else []  # a bench key: the run's own setting
            res = measure([*overrides, *threads], console, opts["constant_steps"], opts["prompts"])
            return _write_result(res, opts, "constants-", print_constants, console)
        res = run_bench(opts, overrides, console)
    except UserError as e:
        print(f"humanline: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # nothing is written before the measurement ends (out= comes last)
        ignore_ctrl_c()  # a second Ctrl-C must not cut this line short
        print("humanline: bench interrupted (Ctrl-C) while measuring; nothing was written", file=sys.stderr)
        return 130
    from humanline_cli.bench.table import print_result

    return _write_result(res, opts, "", print_result, console)

