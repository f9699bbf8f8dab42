"""Corrections for stale data: what the field uses beside humanline, each a pure function of the tensors every
objective already has (policy, reference and sampler log-probs, the completion mask), chosen in one place
(`correction=none|humanline|tis|mis|decoupled|trdpo`, knobs under correction.*; docs/method.md's table).

Shapes: token_* tensors are (N, T) (the log-prob axis), masks float (N, T) with 1 on completion tokens. The
"old" (proximal) log-probs are the trainer's own log-probs of the sampled tokens under the policy at the round's
start, which plain online runs hold as the reference (ReferenceRule resets it at each round's start); the
behaviour log-probs are the sampler's (vLLM or transformers, GroupBatch.sampler_logps). On synchronous rounds
the two differ only by the sampler's kernels and precision; on asynchronous rounds (data.async_lag) also by the
rounds the sampler's weights are behind.

- `is_weights`: TRL's `vllm_importance_sampling_correction` (trl 1.16, GRPOTrainer._generate_and_score_completions)
  in its four modes, plus a geometric sequence level (SkyRL's geometric mask): tis truncates, mis masks.
- `decoupled_weights`: AReaL's behaviour weight of decoupled PPO (areal ppo_actor_loss_fn, behav_imp_weight_cap):
  tokens whose weight exceeds the cap are dropped.
- `mix_reference`: TR-DPO's soft reference update (TRL's SyncRefModelCallback._sync_target_model).
- `mismatch_stats`: the trainer/sampler log-prob gap of the same tokens at the same weights.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Optional

import torch

from humanline_cli.core.knobs import knob


class CorrectionKind(StrEnum):
    none = "none"
    humanline = "humanline"  # the same as humanline=true: its knobs stay under hl.*
    tis = "tis"              # truncated importance sampling against the sampler's log-probs
    mis = "mis"              # masked importance sampling (TRL's default: sequence_mask)
    decoupled = "decoupled"  # AReaL's decoupled PPO: the proximal policy between behaviour and current
    trdpo = "trdpo"          # TR-DPO's soft reference update (dpo, kto, ipo)


class ISLevel(StrEnum):
    token = "token"          # one ratio per token
    sequence = "sequence"    # exp(sum of the sequence's token log-ratios), TRL's sequence_* modes
    geometric = "geometric"  # exp(mean of the sequence's token log-ratios), SkyRL's geometric mask


# the corrections that weight GRPO's policy-gradient term by the sampler's log-probs
IS_KINDS = ("tis", "mis", "decoupled")


@dataclass
class CorrectionConfig:
    """correction.*: which stale-data correction the run uses (docs/method.md's table) and its knobs."""
    kind: CorrectionKind = knob(CorrectionKind.none, "none | humanline (= humanline=true; knobs hl.*) | tis | mis | "
                                                     "decoupled (grpo: online data, or offline data `humanline "
                                                     "sample` wrote) | trdpo (dpo, kto, ipo)")
    level: ISLevel = knob(ISLevel.token, "tis/mis: token | sequence (exp of the summed log-ratio: TRL's sequence_*) "
                                         "| geometric (exp of the mean log-ratio); correction=mis sets sequence")
    cap: float = knob(3.0, "tis/mis: C_max, TRL's vllm_importance_sampling_clip_max (truncate: clip above; mask: "
                           "drop above); decoupled: AReaL's behav_imp_weight_cap (drop above; correction=decoupled "
                           "sets 5)")
    cap_min: Optional[float] = knob(None, "tis/mis: C_min, TRL's vllm_importance_sampling_clip_min (null: none)")
    alpha: float = knob(0.6, "trdpo: ref <- alpha * policy + (1 - alpha) * ref (TRL's ref_model_mixup_alpha)")
    tau: int = knob(512, "trdpo: optimizer steps between soft updates (TRL's ref_model_sync_steps)")


@dataclass(frozen=True)
class CorrectionSpec:
    """The run's correction as the loss and the reference rule read it. `mode` is TRL's mode name for tis/mis
    ("token_truncate", ..., "geometric_mask"); `reference_is_sampler`: the reference holds the weights that
    sampled the step's data (plain online or corrected GRPO on synchronous rounds: reset at each round's start),
    so the reference log-probs measure the trainer/sampler mismatch."""
    kind: str = "none"
    mode: str | None = None
    cap: float = 3.0
    cap_min: float | None = None
    alpha: float = 0.6
    tau: int = 512
    reference_is_sampler: bool = False

    @classmethod
    def from_config(cls, c: CorrectionConfig, reference_is_sampler: bool = False) -> CorrectionSpec:
        kind = str(c.kind)
        mode = f"{c.level}_{'truncate' if kind == 'tis' else 'mask'}" if kind in ("tis", "mis") else None
        return cls(kind=kind, mode=mode, cap=c.cap, cap_min=c.cap_min, alpha=c.alpha, tau=c.tau,
                   reference_is_sampler=reference_is_sampler)

    @property
    def weights_tokens(self) -> bool:
        """GRPO's policy-gradient term is weighted by the sampler's log-probs (tis, mis, decoupled)."""
        return self.kind in IS_KINDS


NO_CORRECTION = CorrectionSpec()


def _sequence_log_ratio(diff: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """(N, T) masked token log-ratios -> (N, T) or (N, 1) per the level."""
    if level == "token":
        return diff
    total = diff.sum(dim=-1, keepdim=True)
    if level == "sequence":
        return total
    if level == "geometric":
        return total / mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
    raise ValueError(f"unknown importance-sampling level {level!r} (token | sequence | geometric)")


def raw_is_ratio(token_logp_old: torch.Tensor, token_logp_behaviour: torch.Tensor, mask: torch.Tensor,
                 level: str = "token") -> torch.Tensor:
    """The ratio before any truncation or mask: exp(d), d = (old - behaviour) * mask per token (token level),
    its sum over the sequence (sequence) or its mean over the completion's tokens (geometric). (N, T) or (N, 1);
    detached. Padding has d = 0 (ratio 1), so it never leaves the band."""
    with torch.no_grad():
        diff = (token_logp_old.double() - token_logp_behaviour.double()) * mask
        return torch.exp(_sequence_log_ratio(diff, mask, level))


def is_weights(token_logp_old: torch.Tensor, token_logp_behaviour: torch.Tensor, mask: torch.Tensor, mode: str,
               cap: float | None, cap_min: float | None = None) -> torch.Tensor:
    """Importance weights on GRPO's policy-gradient term, (N, T) (a sequence-level weight broadcast over its
    tokens), detached, in the log-probs' dtype. TRL's modes (its `vllm_importance_sampling_mode`):
      token_truncate:    w_t = clamp(exp(old_t - behav_t), cap_min, cap)
      token_mask:        w_t = exp(old_t - behav_t) if cap_min <= it <= cap else 0
      sequence_truncate: w = clamp(exp(sum_t (old_t - behav_t)), cap_min, cap) for every token of the sequence
      sequence_mask:     w = exp(sum_t ...) if inside [cap_min, cap] else 0 (the sequence is dropped)
      geometric_*:       as sequence_*, with the mean over the completion's tokens instead of the sum
    cap / cap_min None: no bound on that side. Sanity: old = behav gives w = 1 everywhere (cap >= 1).
    """
    level, _, how = mode.rpartition("_")
    ratio = raw_is_ratio(token_logp_old, token_logp_behaviour, mask, level)
    if how == "truncate":
        w = ratio.clamp(min=cap_min, max=cap)
    elif how == "mask":
        lo = -math.inf if cap_min is None else cap_min
        hi = math.inf if cap is None else cap
        w = ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)
    else:
        raise ValueError(f"unknown importance-sampling mode {mode!r} (token|sequence|geometric _truncate|_mask)")
    return w.expand_as(token_logp_old).to(token_logp_old.dtype)


def decoupled_weights(token_logp_prox: torch.Tensor, token_logp_behaviour: torch.Tensor, mask: torch.Tensor,
                      cap: float | None) -> torch.Tensor:
    """AReaL's behaviour weight (ppo_actor_loss_fn with use_decoupled_loss): w_t = pi_prox / pi_behav =
    exp(prox_t - behav_t), set to 0 where it exceeds `cap` (behav_imp_weight_cap; None: no cap) or off the mask.
    The loss is then -min(r A, clip(r, 1-eps, 1+eps) A) * w with r = pi_theta / pi_prox. (N, T), detached."""
    with torch.no_grad():
        w = torch.exp(token_logp_prox.double() - token_logp_behaviour.double())
        keep = mask.bool() if cap is None else (w <= cap) & mask.bool()
        return torch.where(keep, w, torch.zeros_like(w)).to(token_logp_prox.dtype)


def weight_metrics(raw: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor, prefix: str = "correction") -> dict:
    """The raw ratio before truncation (mean and max over completion tokens, or over sequences at a sequence
    level), the weights' mean and the fraction of completion tokens whose weight is 0 (dropped)."""
    m = mask.bool()
    raw_vals = raw[m] if raw.shape == mask.shape else raw[m.any(dim=-1)].flatten()
    n = raw_vals.numel()
    return {f"{prefix}/raw_ratio_mean": float(raw_vals.mean()) if n else 1.0,
            f"{prefix}/raw_ratio_max": float(raw_vals.max()) if n else 1.0,
            f"{prefix}/weight_mean": float(weights.detach()[m].double().mean()) if m.any() else 1.0,
            f"{prefix}/dropped_fraction": float((weights.detach()[m] == 0).double().mean()) if m.any() else 0.0}


# the band a ratio pi_trainer / pi_sampler is counted as agreeing inside (the usual PPO clip, both ways)
MISMATCH_BAND = (0.8, 1.25)


def mismatch_stats(token_logp_trainer: torch.Tensor, token_logp_sampler: torch.Tensor, mask: torch.Tensor) -> dict:
    """The trainer/sampler gap on the same tokens at the same weights, over completion tokens:
    mismatch/logp_abs_mean = mean |trainer - sampler|, mismatch/logp_abs_max = max |trainer - sampler|,
    mismatch/ratio_outside = fraction of tokens whose ratio exp(trainer - sampler) is outside [0.8, 1.25]."""
    m = mask.bool()
    if not m.any():
        return {}
    d = (token_logp_trainer.detach().double() - token_logp_sampler.detach().double())[m]
    lo, hi = (math.log(x) for x in MISMATCH_BAND)
    return {"mismatch/logp_abs_mean": float(d.abs().mean()), "mismatch/logp_abs_max": float(d.abs().max()),
            "mismatch/ratio_outside": float(((d < lo) | (d > hi)).double().mean())}


def sampler_logps_of(seqs, comps) -> torch.Tensor | None:
    """(N, T-1) sampler log-probs aligned with token_logps's columns (the completion's first token at the
    column of its loss-mask start - 1), zero elsewhere; None unless every completion carries `logps`."""
    if not all(hasattr(c, "logps") for c in comps):
        return None
    out = torch.zeros(seqs.input_ids.shape[0], seqs.input_ids.shape[1] - 1)
    for i, c in enumerate(comps):
        start = int(seqs.loss_mask[i].nonzero()[0]) - 1 if seqs.loss_mask[i].any() else 0
        lp = torch.tensor(c.logps[: int(seqs.loss_mask[i].sum())], dtype=torch.float32)
        out[i, start : start + len(lp)] = lp
    return out


@torch.no_grad()
def mix_reference(policy: torch.nn.Module, reference: torch.nn.Module, alpha: float) -> None:
    """TR-DPO's soft update, in place, parameter by parameter: ref <- alpha * policy + (1 - alpha) * ref
    (TRL's SyncRefModelCallback: target.mul_(1 - alpha).add_(policy, alpha=alpha)). alpha = 1 is the hard copy."""
    ref_params = dict(reference.named_parameters())
    for name, p in policy.named_parameters():
        r = ref_params[name]
        r.mul_(1.0 - alpha).add_(p.detach().to(r.dtype), alpha=alpha)
