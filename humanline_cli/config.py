"""Validate the composed Hydra config and derive typed, frozen run settings (never mutates cfg).

Every check raises UserError with a one-line message naming the key, before any work starts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .errors import UserError
from .humanline import HumanlineSpec

OBJECTIVES = ("dpo", "kto", "grpo")
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

    @property
    def accumulation(self) -> int:
        return self.batch_size // self.micro_batch_size


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


def _get(cfg: DictConfig, key: str, kind: type | tuple, *, optional: bool = False):
    try:
        value = OmegaConf.select(cfg, key, throw_on_missing=True)
    except OmegaConfBaseException as e:
        raise UserError(f"config key '{key}': {str(e).splitlines()[0]}") from None
    if value is None:
        if optional:
            return None
        raise UserError(f"config key '{key}' is missing")
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) and bool not in kinds:
        raise UserError(f"config key '{key}' must be {'/'.join(k.__name__ for k in kinds)}, got {value!r}")
    if not isinstance(value, kinds):
        raise UserError(f"config key '{key}' must be {'/'.join(k.__name__ for k in kinds)}, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"config key '{key}' must be finite, got {value!r}")
    return value


def _positive(cfg, key, kind=int):
    v = _get(cfg, key, kind)
    if v <= 0:
        raise UserError(f"config key '{key}' must be > 0, got {v}")
    return v


def _choice(cfg, key, choices):
    v = _get(cfg, key, str)
    if v not in choices:
        raise UserError(f"config key '{key}' must be one of {', '.join(choices)}; got {v!r}")
    return v


def validate(cfg: DictConfig) -> RunSpec:
    objective = _choice(cfg, "objective.name", OBJECTIVES)
    regime = _choice(cfg, "data.regime", REGIMES)
    hl_on = _get(cfg, "humanline", bool, optional=True) or False
    hl = HumanlineSpec(
        clamp=hl_on and _get(cfg, "hl.clamp", bool),
        sync=hl_on and _get(cfg, "hl.sync", bool),
        log_eps_P=_get(cfg, "hl.log_eps_P", float),
        log_eps_R=_get(cfg, "hl.log_eps_R", float),
        sync_every=_positive(cfg, "hl.sync_every"),
    )
    if hl_on and not (hl.clamp or hl.sync):
        raise UserError("+humanline=true with hl.clamp=false and hl.sync=false turns everything off; drop one")
    if not hl.log_eps_P < 0.0 < hl.log_eps_R:
        raise UserError(f"humanline band must satisfy hl.log_eps_P < 0 < hl.log_eps_R, got "
                        f"[{hl.log_eps_P}, {hl.log_eps_R}]")
    _positive(cfg, "objective.beta", float)
    if objective == "kto":
        _positive(cfg, "objective.desirable_weight", float)
        _positive(cfg, "objective.undesirable_weight", float)
    if objective == "grpo":
        eps = _positive(cfg, "objective.epsilon", float)
        if eps >= 1.0:
            raise UserError(f"objective.epsilon must be in (0, 1), got {eps}")
        _choice(cfg, "objective.aggregation", ("token_mean", "seq_mean"))
        denom = _choice(cfg, "objective.ratio_denominator", ("reference", "sampler"))
        if denom == "sampler" and regime == "offline":
            raise UserError("objective.ratio_denominator=sampler needs data=online (offline data has no "
                            "sampling log-probs)")
        if _get(cfg, "objective.std_ddof", int) not in (0, 1):
            raise UserError("objective.std_ddof must be 0 or 1")
        if _get(cfg, "objective.std_eps", float) < 0:
            raise UserError("objective.std_eps must be >= 0")
    batch = _positive(cfg, "train.batch_size")
    micro = _get(cfg, "train.micro_batch_size", int, optional=True) or batch
    if micro <= 0 or batch % micro:
        raise UserError(f"train.batch_size ({batch}) must be a positive multiple of train.micro_batch_size ({micro})")
    max_len = _positive(cfg, "train.max_length")
    max_prompt = _positive(cfg, "train.max_prompt_length")
    if max_prompt >= max_len:
        raise UserError(f"train.max_prompt_length ({max_prompt}) must be < train.max_length ({max_len})")
    warmup = _get(cfg, "train.warmup_ratio", float)
    if not 0.0 <= warmup < 1.0:
        raise UserError(f"train.warmup_ratio must be in [0, 1), got {warmup}")
    train = TrainSpec(
        steps=_positive(cfg, "train.steps"),
        batch_size=batch,
        micro_batch_size=micro,
        lr=_positive(cfg, "train.lr", float),
        weight_decay=_get(cfg, "train.weight_decay", float),
        warmup_ratio=warmup,
        schedule=_choice(cfg, "train.schedule", ("constant", "cosine")),
        max_grad_norm=_positive(cfg, "train.max_grad_norm", float),
        max_length=max_len,
        max_prompt_length=max_prompt,
        log_every=_positive(cfg, "train.log_every"),
        save_model=_get(cfg, "train.save_model", bool),
    )
    _positive(cfg, "eval.max_new_tokens")
    _positive(cfg, "eval.batch_size")
    if _get(cfg, "eval.temperature", float) < 0:
        raise UserError("eval.temperature must be >= 0 (0 = greedy)")
    _get(cfg, "eval.n_prompts", int, optional=True)
    _get(cfg, "eval.every", int)
    _choice(cfg, "backend.device", ("auto", "cpu", "cuda"))
    _choice(cfg, "backend.precision", ("auto", "fp32", "bf16"))
    _get(cfg, "model.name_or_path", str)
    _get(cfg, "model.trust_remote_code", bool)
    _get(cfg, "task.name", str)
    _get(cfg, "task.prompts.eval", str)
    _get(cfg, "task.judge.kind", str)
    if regime == "offline":
        _get(cfg, "data.path", str)
    return RunSpec(objective=objective, regime=regime, task=cfg.task.name, model=cfg.model.name,
                   seed=_get(cfg, "seed", int), humanline=hl, humanline_on=hl_on, train=train)
