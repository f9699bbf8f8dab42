"""DPO, KTO and GRPO losses as pure functions of token log-ratios, masks and floats.

Shapes: token_* tensors are (N, T) (the log-prob axis, T = seq_len - 1), masks are float (N, T)
with 1 on completion tokens, seq_* tensors are (N,). Token log-ratios arrive already passed
through the humanline transform (identity when off). Each function returns (loss, metrics) where
metrics are detached scalars for logging.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from humanline_cli.core.logprobs import masked_mean, masked_sum, seq_masked_mean

# GRPO aggregations whose micro-batch loss is the token mean (dapo / dapo_micro differ only in how the trainer
# weights micro-batches: core/objectives.micro_batch_weights)
TOKEN_MEAN_AGGREGATIONS = ("token_mean", "dapo", "dapo_micro")


def dpo_loss(
    token_logratio_chosen: torch.Tensor,
    mask_chosen: torch.Tensor,
    token_logratio_rejected: torch.Tensor,
    mask_rejected: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """loss = mean_pairs -log sigmoid(beta * (r_w - r_l)),  r = sum_t l_t over the completion.

    Inputs (B, T) each. With policy == reference every r is 0 and the loss is ln 2.
    """
    r_w = masked_sum(token_logratio_chosen, mask_chosen)
    r_l = masked_sum(token_logratio_rejected, mask_rejected)
    margin = beta * (r_w - r_l)
    loss = -F.logsigmoid(margin).mean()
    metrics = {
        "dpo/margin": float(margin.detach().mean()),
        "dpo/accuracy": float((margin.detach() > 0).float().mean()),
        "dpo/reward_chosen": float(beta * r_w.detach().mean()),
        "dpo/reward_rejected": float(beta * r_l.detach().mean()),
    }
    return loss, metrics


def kto_reference_point(token_logratio_mismatched: torch.Tensor, mask_mismatched: torch.Tensor) -> torch.Tensor:
    """z0 = max(0, mean_i r(x_i, y_{i+1})) from mismatched pairs, detached (no gradient).

    The caller averages it across processes before use (the objective does; the loss never does I/O).
    """
    with torch.no_grad():
        return masked_sum(token_logratio_mismatched, mask_mismatched).mean().clamp(min=0.0)


def kto_loss(
    token_logratio: torch.Tensor,
    mask: torch.Tensor,
    desirable: torch.Tensor,
    z0: torch.Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per example, r = sum_t l_t:
        desirable:   w_D * (1 - sigmoid(beta * (r - z0)))
        undesirable: w_U * (1 - sigmoid(beta * (z0 - r)))
    loss = mean over the B examples. `desirable` is (B,) bool; z0 a 0-dim tensor.
    With policy == reference (r = 0, z0 = 0) each example contributes 0.5 * its weight.
    """
    r = masked_sum(token_logratio, mask)
    z0 = z0.detach().to(r.dtype)
    d = desirable.bool()
    loss_d = desirable_weight * (1.0 - torch.sigmoid(beta * (r - z0)))
    loss_u = undesirable_weight * (1.0 - torch.sigmoid(beta * (z0 - r)))
    losses = torch.where(d, loss_d, loss_u)
    loss = losses.mean()
    rd = r.detach()
    metrics = {
        "kto/z0": float(z0),
        "kto/reward_desirable": float(beta * rd[d].mean()) if d.any() else 0.0,
        "kto/reward_undesirable": float(beta * rd[~d].mean()) if (~d).any() else 0.0,
        "kto/frac_desirable": float(d.float().mean()),
    }
    return loss, metrics


def grpo_loss(
    token_logratio_ratio: torch.Tensor,
    token_logratio_kl: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    epsilon: float,
    beta: float,
    aggregation: str = "token_mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy gradient with a k3 KL penalty.

    token_logratio_ratio (N, T): log(pi / pi_denominator), humanline-clamped when on; rho = exp(.).
    token_logratio_kl (N, T): UNclamped log(pi / pi_ref) for k3 = exp(ref - pol) - (ref - pol) - 1.
    advantages (N,). Per token: -min(A rho, A clip(rho, 1-eps, 1+eps)) + beta * k3.
    aggregation: "token_mean" (mean over every completion token of the batch, the reference code)
    or "seq_mean" (mean of per-sequence token means); "dapo" and "dapo_micro" are the token mean here too:
    the trainer weights it into TRL's or the authors' dapo loss (core/objectives.micro_batch_weights).
    """
    rho = torch.exp(token_logratio_ratio)
    adv = advantages.to(rho.dtype).unsqueeze(-1)
    unclipped = adv * rho
    clipped = adv * rho.clamp(1.0 - epsilon, 1.0 + epsilon)
    pg = -torch.minimum(unclipped, clipped)
    neg = -token_logratio_kl  # ref - pol
    k3 = torch.exp(neg) - neg - 1.0
    per_token = pg + beta * k3
    if aggregation in TOKEN_MEAN_AGGREGATIONS:
        loss = masked_mean(per_token, mask)
    elif aggregation == "seq_mean":
        loss = seq_masked_mean(per_token, mask).mean()
    else:
        raise ValueError(f"unknown GRPO aggregation {aggregation!r} ({' | '.join(('seq_mean',) + TOKEN_MEAN_AGGREGATIONS)})")
    with torch.no_grad():
        clip_hit = ((rho < 1.0 - epsilon) | (rho > 1.0 + epsilon)).float()
        metrics = {
            "grpo/ratio_mean": float(masked_mean(rho, mask)),
            "grpo/clip_fraction": float(masked_mean(clip_hit, mask)),
            "grpo/kl": float(masked_mean(k3, mask)),
            "grpo/advantage_abs": float(advantages.abs().mean()) if advantages.numel() else 0.0,
        }
    return loss, metrics
