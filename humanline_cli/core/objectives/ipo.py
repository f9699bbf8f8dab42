"""Identity Preference Optimisation (Azar et al. 2023): the squared distance of the pair's log-ratio difference h from
1 / (2 beta), so the margin is regressed to a target instead of pushed without bound as in DPO."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from humanline_cli.core.logprobs import masked_sum
from humanline_cli.core.objectives.base import ObjectiveConfig, TrlPeer
from humanline_cli.core.objectives.dpo import PairObjective, trl_pair_row


@dataclass
class IPOConfig(ObjectiveConfig):
    name: str = "ipo"


def ipo_loss(
    token_logratio_chosen: torch.Tensor,
    mask_chosen: torch.Tensor,
    token_logratio_rejected: torch.Tensor,
    mask_rejected: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """loss = mean_pairs (h - 1 / (2 beta))^2,  h = r_w - r_l,  r = sum_t l_t over the completion (the sequence
    log-ratio, as DPO's; TRL's loss_type=ipo averages over the completion's tokens instead).

    Inputs (B, T) each. With policy == reference every h is 0 and the loss is 1 / (4 beta^2).
    """
    h = masked_sum(token_logratio_chosen, mask_chosen) - masked_sum(token_logratio_rejected, mask_rejected)
    loss = ((h - 1.0 / (2.0 * beta)) ** 2).mean()
    metrics = {
        "ipo/h": float(h.detach().mean()),
        "ipo/accuracy": float((h.detach() > 0).float().mean()),
    }
    return loss, metrics


class IPO(PairObjective):
    name = "ipo"
    config = IPOConfig
    pair_fn = ipo_loss

    def trl_peer(self, cfg):  # DPOTrainer's loss_type=ipo (a token mean where ours sums: docstring above)
        return TrlPeer("DPO", {"loss_type": ["ipo"]}, trl_pair_row)


OBJECTIVE = IPO()
