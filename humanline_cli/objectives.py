"""Glue between models and losses: token log-ratios (policy minus reference), the humanline
transform in exactly one place, then the objective's pure loss. Returns (loss, metrics)."""
from __future__ import annotations

import torch

from .batches import BinaryBatch, GroupBatch, PairBatch
from .humanline import HumanlineSpec, clamp_logratios, unclamped_fraction
from .losses import dpo_loss, grpo_loss, kto_loss, kto_reference_point
from .tensor_ops import completion_mask, token_logps


def _logratios(policy, reference, seqs, grad: bool = True):
    """(token_logratio (N, T-1), mask (N, T-1), policy_logps)."""
    with torch.no_grad():
        ref = token_logps(reference, seqs)
    if grad:
        pol = token_logps(policy, seqs)
    else:
        with torch.no_grad():
            pol = token_logps(policy, seqs)
    return pol - ref, completion_mask(seqs), pol


def _all_reduce_mean(x: torch.Tensor) -> torch.Tensor:
    """KTO's z0 is averaged across processes (a no-op in a single process)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        x = x.clone()
        torch.distributed.all_reduce(x)
        x /= torch.distributed.get_world_size()
    return x


def logratio_histogram(token_logratio: torch.Tensor, mask: torch.Tensor) -> list[int]:
    """Counts of completion-token log-ratios in 60 bins over [-3, 3], plus underflow and overflow
    (62 numbers): the humanline diagnostic of how many tokens the clamp band would cut."""
    vals = token_logratio[mask > 0].float().cpu()
    inner = torch.histc(vals, bins=60, min=-3.0, max=3.0)
    return [int((vals < -3.0).sum())] + [int(c) for c in inner] + [int((vals > 3.0).sum())]


def compute_loss(objective_cfg, policy, reference, batch, hl: HumanlineSpec, histogram: bool = False):
    metrics: dict[str, float] = {}
    match batch:
        case PairBatch():
            lr, mask, _ = _logratios(policy, reference, batch.seqs)
            tl = clamp_logratios(lr, hl)
            b = lr.shape[0] // 2
            loss, m = dpo_loss(tl[:b], mask[:b], tl[b:], mask[b:], objective_cfg.beta)
        case BinaryBatch():
            lr, mask, _ = _logratios(policy, reference, batch.seqs)
            kl_lr, kl_mask, _ = _logratios(policy, reference, batch.kl_seqs, grad=False)
            z0 = _all_reduce_mean(kto_reference_point(clamp_logratios(kl_lr, hl), kl_mask))
            loss, m = kto_loss(clamp_logratios(lr, hl), mask, batch.labels, z0, objective_cfg.beta,
                               objective_cfg.desirable_weight, objective_cfg.undesirable_weight)
        case GroupBatch():
            lr, mask, pol = _logratios(policy, reference, batch.seqs)
            if objective_cfg.ratio_denominator == "sampler":
                ratio_lr = pol - batch.sampler_logps * mask
            else:  # the reference code: the reference plays pi_old
                ratio_lr = lr
            loss, m = grpo_loss(clamp_logratios(ratio_lr, hl), lr, mask, batch.advantages,
                                objective_cfg.epsilon, objective_cfg.beta, objective_cfg.aggregation)
        case _:
            raise TypeError(type(batch))
    metrics.update(m)
    metrics["logratio_mean"] = float((lr.detach() * mask).sum() / mask.sum().clamp(min=1))
    if hl.clamp:
        metrics["humanline/unclamped_fraction"] = unclamped_fraction(lr.detach(), mask, hl)
    metrics["_n_tokens"] = float(batch.seqs.attention_mask.sum())
    if histogram:  # only on logged steps: it copies every token's log-ratio to the host
        metrics["_logratio_hist"] = logratio_histogram(lr.detach(), mask)
    return loss, metrics
