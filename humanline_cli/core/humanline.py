"""Humanline: the two parts of the method, in one place.

1. `clamp_logratios`: the perceptual distortion, a plain clamp of token log-ratios to
   [log_eps_P, log_eps_R]; tokens outside the band contribute a constant and get zero gradient
   through the clamped term (in GRPO the k3 KL penalty uses the UNclamped log-ratio, so with
   beta > 0 such tokens still get gradient from the penalty). The identity when the clamp is off.
2. `sync_reference`: copy policy weights into the reference. The trainer calls it after backward
   and gradient clipping, BEFORE optimizer.step(), so during step t the reference is the policy of
   step t-1. Syncing after the step (TRL's TR-DPO callback) would make every log-ratio 0 at k=1.
3. `ReferenceRule`: the one place that decides when the reference moves (see its docstring).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from humanline_cli.core.knobs import knob


@dataclass
class HumanlineConfig:
    """hl.*: humanline's knobs, active only with humanline=true (the method: docs/method.md)."""
    clamp: bool = knob(True, "clamp each token's log-ratio to [log_eps_P, log_eps_R] (false: sync only)")
    sync: bool = knob(True, "copy the policy into the reference every sync_every steps, before optimizer.step "
                            "(false: clamp only)")
    log_eps_P: float = knob(-1.0, "the clamp band's lower end (< 0)")
    log_eps_R: float = knob(1.5, "the clamp band's upper end (> 0)")
    sync_every: int = knob(1, "optimizer steps between reference syncs (k: the reference is the policy of step "
                              "t - k)")


@dataclass
class HumanlineSpec(HumanlineConfig):
    """hl.* as the schema declares it (the band and the sync period are the schema's fields), with clamp and sync
    meaning "on in this run": humanline=true and hl.clamp / hl.sync, so both are off unless the run turns humanline
    on. Treat as read-only, like the rest of the run's spec."""
    clamp: bool = False
    sync: bool = False

    @classmethod
    def from_config(cls, on: bool, hl: HumanlineConfig) -> HumanlineSpec:
        """The spec of a run: humanline=`on` (the root key) with the knobs `hl`."""
        return cls(**{**vars(hl), "clamp": on and hl.clamp, "sync": on and hl.sync})

    @property
    def on(self) -> bool:
        """Humanline runs (the config check refuses humanline=true with both parts off)."""
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


@dataclass(frozen=True)
class ReferenceRule:
    """When the reference takes the policy's weights, decided from the spec in one place:
    - plain offline: never (the reference is the starting policy throughout);
    - plain online (and clamp-only online): at the start of each sampling round, before its first
      forward, so the reference is the round's starting policy (the paper's online baselines);
    - humanline sync: at optimizer steps k, 2k, ... after backward and clipping, BEFORE
      optimizer.step, so during step t the reference is the policy of step t - k;
    - correction=trdpo (TR-DPO): at optimizer steps tau, 2 tau, ... AFTER optimizer.step (TRL's
      SyncRefModelCallback runs on_step_end), ref <- alpha * policy + (1 - alpha) * ref; never reset per round.
    """

    sync_every: int = 0            # 0 = no humanline sync
    reset_each_round: bool = False
    mix_every: int = 0             # 0 = no TR-DPO soft update
    mix_alpha: float = 0.0

    @classmethod
    def from_spec(cls, hl: HumanlineSpec, regime: str, correction=None) -> ReferenceRule:
        """`correction`: the run's CorrectionSpec (core/corrections.py; None: none)."""
        trdpo = correction is not None and correction.kind == "trdpo"
        return cls(sync_every=hl.sync_every if hl.sync else 0,
                   reset_each_round=regime == "online" and not hl.sync and not trdpo,
                   mix_every=correction.tau if trdpo else 0, mix_alpha=correction.alpha if trdpo else 0.0)

    def at_round_start(self, new_round: bool) -> bool:
        return self.reset_each_round and new_round

    def before_optimizer_step(self, step: int) -> bool:
        """1-based optimizer step."""
        return self.sync_every > 0 and step % self.sync_every == 0

    def after_optimizer_step(self, step: int) -> bool:
        """1-based optimizer step: TR-DPO's soft update is due after this step's optimizer.step."""
        return self.mix_every > 0 and step % self.mix_every == 0

    @property
    def moves(self) -> bool:
        """Whether the reference can leave the starting weights."""
        return self.sync_every > 0 or self.reset_each_round or self.mix_every > 0
