"""Kahneman-Tversky Optimization: desirable and undesirable examples against the reference point z0, the mean
log-ratio of mismatched pairs (prompt i with the next example's completion)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from humanline_cli.core.batches import BinaryBatch
from humanline_cli.core.feedback import BinaryExample, kto_examples
from humanline_cli.core.humanline import clamp_logratios
from humanline_cli.core.knobs import knob, positive
from humanline_cli.core.logprobs import masked_sum
from humanline_cli.core.objectives.base import Objective, ObjectiveConfig, ObjectiveProperties, TrlPeer, logratios


@dataclass
class KTOConfig(ObjectiveConfig):
    name: str = "kto"
    batch_size: int = 64  # examples per optimizer step (the paper's); a pair gives 2 examples
    desirable_weight: float = knob(1.0, "weight of the desirable examples' loss")
    undesirable_weight: float = knob(1.0, "weight of the undesirable examples' loss")


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


class KTO(Objective):
    name = "kto"
    config = KTOConfig
    # a desirable and an undesirable example per prompt
    properties = ObjectiveProperties(unit="examples", units_per_prompt=2, min_micro_batch=2, seqs_per_unit=1)
    min_micro_batch_reason = ("z0 pairs each prompt with the next example's completion in the micro-batch, so one "
                              "example would be mismatched with itself")
    example = BinaryExample
    unpaired_rows = True
    unshuffled_pairs_refused = ("objective=kto with data.shuffle=false on paired data: each KTO example's neighbour is "
                                "the other half of its own pair, so z0's mismatched pairs would share the prompt; keep "
                                "data.shuffle=true")

    def units(self, group, min_gap, pair=None):
        split = [(pair[0], True), (pair[1], False)] if pair is not None else kto_examples(group, min_gap)
        return [BinaryExample(group.prompt, c, d) for c, d in split]

    def completions(self, unit):
        return [unit.completion]

    def collate(self, units, partners, seqs, cfg):
        prompts = [u.prompt for u in units]
        comps = [u.completion for u in units]
        # prompt i with completion i+1: the KL estimate's mismatch
        shifted = [u.completion for u in partners] if partners is not None else comps[1:] + comps[:1]
        return BinaryBatch(seqs(prompts, comps), torch.tensor([u.desirable for u in units], dtype=torch.bool),
                           seqs(prompts, shifted))

    def trl_peer(self, cfg):
        return TrlPeer("KTO", {"desirable_weight": cfg.desirable_weight, "undesirable_weight": cfg.undesirable_weight},
                       lambda u: {"prompt": u.prompt, "completion": u.completion, "label": bool(u.desirable)})

    def check(self, cfg, data):
        positive(cfg.desirable_weight, "objective.desirable_weight")
        positive(cfg.undesirable_weight, "objective.undesirable_weight")

    def step_z0(self, cfg, policy, reference, micro_batches, hl, reduce_sum=None, fillers=None):
        """z0 for a whole optimizer step: max(0, mean r(x_i, y_partner(i))) over every mismatched pair of every
        micro-batch on every rank (`reduce_sum` sums a tensor across ranks), without gradient and with the humanline
        clamp. So z0, like the loss, does not depend on how the global batch is split into micro-batches or
        processes. `fillers[i]`: micro-batch i only pads a rank's share (sources.source.micro_batches): its forward
        runs (a collective under FSDP), its pairs are not counted."""
        total = torch.zeros(2, dtype=torch.float64)
        for i, mb in enumerate(micro_batches):
            kl_logratio, kl_mask, _ = logratios(policy, reference, mb.kl_seqs, grad=False)
            r = masked_sum(clamp_logratios(kl_logratio, hl), kl_mask)
            if fillers is not None and fillers[i]:
                continue
            total += torch.stack([r.sum().double().cpu(), torch.tensor(float(len(r)), dtype=torch.float64)])
        if reduce_sum is not None:
            total = reduce_sum(total)
        # float64: kto_loss casts z0 to the log-ratios' dtype (float32, or float64 under precision=fp64)
        return (total[0] / total[1].clamp(min=1.0)).clamp(min=0.0)

    def loss(self, cfg, policy, reference, batch, hl, z0, correction=None):
        """`z0` comes from step_z0 over the whole step, else it is estimated from this micro-batch alone."""
        logratio, mask, _ = logratios(policy, reference, batch.seqs)
        if z0 is None:
            kl_logratio, kl_mask, _ = logratios(policy, reference, batch.kl_seqs, grad=False)
            z0 = kto_reference_point(clamp_logratios(kl_logratio, hl), kl_mask)
        loss, m = kto_loss(clamp_logratios(logratio, hl), mask, batch.labels, z0, cfg.beta, cfg.desirable_weight,
                           cfg.undesirable_weight)
        return loss, m, logratio, mask


OBJECTIVE = KTO()
