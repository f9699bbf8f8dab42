"""Direct Preference Optimization: -log sigmoid(beta * (r_chosen - r_rejected)) over preference pairs."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from humanline_cli.core.batches import PairBatch
from humanline_cli.core.feedback import PairExample, best_vs_worst
from humanline_cli.core.humanline import clamp_logratios
from humanline_cli.core.logprobs import masked_sum
from humanline_cli.core.objectives.base import Objective, ObjectiveConfig, ObjectiveProperties, TrlPeer, logratios


@dataclass
class DPOConfig(ObjectiveConfig):
    name: str = "dpo"


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


class PairObjective(Objective):
    """Objectives trained on preference pairs: the data's pair, else a group's best vs worst; one forward over
    the B chosen sequences followed by the B rejected ones. Subclasses give `pair_loss`."""

    properties = ObjectiveProperties(unit="pairs", units_per_prompt=1, min_micro_batch=1, seqs_per_unit=2)
    example = PairExample

    def units(self, group, min_gap, pair=None):
        if pair is None:
            best = best_vs_worst(group, min_gap)
            pair = None if best is None else best[:2]
        return [] if pair is None else [PairExample(group.prompt, *pair)]

    def completions(self, unit):
        return [unit.chosen, unit.rejected]

    def collate(self, units, partners, seqs, cfg):
        prompts = [u.prompt for u in units] * 2
        comps = [u.chosen for u in units] + [u.rejected for u in units]
        return PairBatch(seqs(prompts, comps))

    # (token log-ratios chosen, mask, rejected, mask, beta) -> (loss, metrics): the objective's pure pair loss on
    # the (humanline-clamped) halves; a subclass names its own
    pair_fn = None

    def pair_loss(self, cfg, tl_chosen, mask_chosen, tl_rejected, mask_rejected):
        return type(self).pair_fn(tl_chosen, mask_chosen, tl_rejected, mask_rejected, cfg.beta)

    def loss(self, cfg, policy, reference, batch, hl, z0, correction=None):
        logratio, mask, _ = logratios(policy, reference, batch.seqs)
        tl = clamp_logratios(logratio, hl)
        b = logratio.shape[0] // 2
        loss, m = self.pair_loss(cfg, tl[:b], mask[:b], tl[b:], mask[b:])
        return loss, m, logratio, mask


def trl_pair_row(unit: PairExample) -> dict:
    """A pair as a row of TRL's preference datasets (DPOTrainer)."""
    return {"prompt": unit.prompt, "chosen": unit.chosen, "rejected": unit.rejected}


class DPO(PairObjective):
    name = "dpo"
    config = DPOConfig
    pair_fn = dpo_loss

    def trl_peer(self, cfg):
        return TrlPeer("DPO", {"loss_type": ["sigmoid"]}, trl_pair_row)


OBJECTIVE = DPO()
