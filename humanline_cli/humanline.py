"""Humanline: the two parts of the method, in one place.

1. `clamp_logratios`: the perceptual distortion, a plain clamp of token log-ratios to
   [log_eps_P, log_eps_R]; tokens outside the band contribute a constant and get zero gradient.
   The identity when humanline (or its clamp) is off.
2. `sync_reference`: copy policy weights into the reference. The trainer calls it after backward
   and gradient clipping, BEFORE optimizer.step(), so during step t the reference is the policy of
   step t-1. Syncing after the step (TRL's TR-DPO callback) would make every log-ratio 0 at k=1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HumanlineSpec:
    clamp: bool = False
    sync: bool = False
    log_eps_P: float = -1.0
    log_eps_R: float = 1.5
    sync_every: int = 1

    @property
    def enabled(self) -> bool:
        return self.clamp or self.sync


def clamp_logratios(token_logratio: torch.Tensor, spec: HumanlineSpec) -> torch.Tensor:
    """(N, T) -> (N, T): clamp(l_t, log_eps_P, log_eps_R) when the clamp is on, else l_t unchanged."""
    if not spec.clamp:
        return token_logratio
    return token_logratio.clamp(min=spec.log_eps_P, max=spec.log_eps_R)


def unclamped_fraction(token_logratio: torch.Tensor, mask: torch.Tensor, spec: HumanlineSpec) -> float:
    """Fraction of response tokens strictly inside (log_eps_P, log_eps_R)."""
    inside = (token_logratio > spec.log_eps_P) & (token_logratio < spec.log_eps_R)
    n = mask.sum()
    return float((inside.float() * mask).sum() / n) if n > 0 else 1.0


@torch.no_grad()
def sync_reference(policy: torch.nn.Module, reference: torch.nn.Module) -> None:
    """reference <- policy, parameter by parameter and in place (dtype-converting if needed)."""
    ref_params = dict(reference.named_parameters())
    for name, p in policy.named_parameters():
        ref_params[name].copy_(p.detach())


def should_sync(spec: HumanlineSpec, step: int) -> bool:
    """Sync at optimizer steps k, 2k, 3k, ... (1-based)."""
    return spec.sync and step % spec.sync_every == 0
