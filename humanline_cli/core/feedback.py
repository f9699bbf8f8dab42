"""Scores -> training signal: group advantages, best-vs-worst pairs, KTO labels, and the units objectives train on
(a preference pair, a labelled example, a scored group).

Used by offline data (converting pairs / groups to an objective's unit) and by online rollouts
(scored samples). Pure Python/torch on floats; no models.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# the reference code's advantage normalisation (objective.std_ddof, objective.std_eps default to these)
STD_DDOF = 0
STD_EPS = 0.01


def group_advantages(scores: torch.Tensor, std_ddof: int = STD_DDOF, std_eps: float = STD_EPS) -> torch.Tensor:
    """A_i = (s_i - mean(s)) / (std(s) + std_eps) within one group. (G,) -> (G,).

    ddof=0 is the reference code's population std; TRL/verl use ddof=1 and a tiny eps. A group of
    identical scores gives exactly 0 (never NaN), also for G=1 with ddof=1.
    """
    s = scores.double()
    if s.numel() - std_ddof <= 0 or bool((s == s[0]).all()):
        return torch.zeros_like(s).float()  # exact zeros: float rounding in mean/std must not leak
    centered = s - s.mean()
    std = s.std(correction=std_ddof)
    return (centered / (std + std_eps)).float()


@dataclass(frozen=True)
class PairExample:
    """A preference pair: `chosen` preferred to `rejected` for `prompt`."""

    prompt: object
    chosen: object
    rejected: object


@dataclass(frozen=True)
class BinaryExample:
    """One completion labelled desirable (True) or undesirable."""

    prompt: object
    completion: object
    desirable: bool


@dataclass(frozen=True)
class GroupExample:
    """A prompt's completions with their rewards."""

    prompt: object
    completions: list
    rewards: list[float]


@dataclass(frozen=True)
class ScoredGroup:
    """One prompt with its scored completions (text or chat messages, passed through untouched)."""

    prompt: object
    completions: list
    scores: list[float]


def best_vs_worst(group: ScoredGroup, min_gap: float) -> tuple[object, object, float, float] | None:
    """(chosen, rejected, score_chosen, score_rejected) if max - min score > min_gap, else None.

    Ties on the best (worst) score take the first (last) such completion, deterministically.
    """
    if len(group.completions) < 2:
        return None
    scores = list(group.scores)
    hi = max(range(len(scores)), key=lambda i: (scores[i], -i))
    lo = min(range(len(scores)), key=lambda i: (scores[i], -i))
    if scores[hi] - scores[lo] <= min_gap:
        return None
    return group.completions[hi], group.completions[lo], scores[hi], scores[lo]


def kto_examples(group: ScoredGroup, min_gap: float) -> list[tuple[object, bool]]:
    """The best-vs-worst pair split into one desirable and one undesirable example (the paper's KTO)."""
    pair = best_vs_worst(group, min_gap)
    if pair is None:
        return []
    chosen, rejected, _, _ = pair
    return [(chosen, True), (rejected, False)]
