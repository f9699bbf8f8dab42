"""The objectives and the glue between models and losses: token log-ratios (policy minus reference), the humanline
transform in exactly one place, then the objective's own loss. Returns (loss, metrics).

`OBJECTIVES` maps each objective's name (objective=NAME) to its `Objective` (base.py): everything the rest of
the package needs of it, so that schema, config, data, sources, train and bench look it up or iterate it and never
name one. A new objective is a module here (its config, loss, units, collation, properties; `OBJECTIVE = ...`),
its line in MODULES, and conf/objective/NAME.yaml. `register` adds one from elsewhere (a test, a plugin) before
the schema registers its config (humanline_cli.schema.register).

`PROPERTIES` holds each objective's properties (what one unit of train.batch_size is, how many sequences it runs
through the model, how many units one sampled prompt gives).
"""
from __future__ import annotations

import torch

from humanline_cli.core.corrections import NO_CORRECTION, CorrectionSpec
from humanline_cli.core.humanline import HumanlineSpec, unclamped_fraction
from humanline_cli.core.objectives import dpo, grpo, ipo, kto
from humanline_cli.core.objectives.base import Objective, ObjectiveConfig, ObjectiveProperties
from humanline_cli.core.objectives.grpo import sampler_drift

__all__ = ["MODULES", "OBJECTIVES", "PROPERTIES", "Objective", "ObjectiveConfig", "ObjectiveProperties",
           "compute_loss", "for_unit", "get", "logratio_histogram", "loss_count", "micro_batch_weights", "register",
           "sampler_drift", "step_z0"]

# the objectives' modules, in the order listings show them
MODULES = (dpo, kto, grpo, ipo)

OBJECTIVES: dict[str, Objective] = {}
PROPERTIES: dict[str, ObjectiveProperties] = {}


def register(objective: Objective) -> Objective:
    """Add `objective` under its name (replacing one of the same name)."""
    OBJECTIVES[objective.name] = objective
    PROPERTIES[objective.name] = objective.properties
    return objective


for _module in MODULES:
    register(_module.OBJECTIVE)


def get(name: str) -> Objective:
    """The objective called `name`; a ValueError naming the known ones otherwise."""
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise ValueError(f"unknown objective {name!r} ({' | '.join(OBJECTIVES)})") from None


def for_unit(unit) -> Objective:
    """The (first registered) objective whose units are of `unit`'s type: objectives sharing a unit type (a pair)
    collate it the same way."""
    for objective in OBJECTIVES.values():
        if type(unit) is objective.example:
            return objective
    raise TypeError(type(unit))


# what the trainer calls, each delegating to the objective `objective_cfg.name` names
def step_z0(objective_cfg, policy, reference, micro_batches, hl: HumanlineSpec, reduce_sum=None,
            fillers: list[bool] | None = None) -> torch.Tensor | None:
    """A statistic of the whole optimizer step the objective's loss needs (KTO's z0, over every micro-batch on
    every rank: `reduce_sum` sums a tensor across ranks), or None. `fillers[i]`: micro-batch i only pads a rank's
    share (sources.source.micro_batches)."""
    return get(objective_cfg.name).step_z0(objective_cfg, policy, reference, micro_batches, hl, reduce_sum, fillers)


def loss_count(objective_cfg, batch) -> float:
    """What the objective's loss averages over in this micro-batch: completion tokens for GRPO's
    token mean, else units (pairs, examples, sequences). The trainer weights each micro-batch's loss
    by count / (count over the global batch), so micro-batching and ranks only change memory."""
    return get(objective_cfg.name).loss_count(objective_cfg, batch)


def micro_batch_weights(objective_cfg, counts: list[float], total: float, world_size: int,
                        round_tokens_per_step: float | None = None,
                        micro_totals: list[float] | None = None) -> list[float]:
    """What each micro-batch's mean loss is multiplied by before backward, so that the summed (and, under
    DDP/FSDP, rank-averaged) gradient is the gradient of the step's loss.

    counts[i] = loss_count of micro-batch i of this rank; total = the sum over every rank's micro-batches.
    Default: w_i = counts[i] / total x world_size, so the step's loss is the mean over the GLOBAL batch's
    units or tokens (DDP/FSDP average over ranks, hence x world_size). GRPO's dapo aggregations weigh by the
    round's or each micro-step's tokens instead (grpo.GRPO.micro_batch_weights)."""
    return get(objective_cfg.name).micro_batch_weights(objective_cfg, counts, total, world_size,
                                                       round_tokens_per_step, micro_totals)


def logratio_histogram(token_logratio: torch.Tensor, mask: torch.Tensor) -> list[int]:
    """Counts of completion-token log-ratios in 60 bins over [-3, 3], plus underflow and overflow
    (62 numbers): the humanline diagnostic of how many tokens the clamp band would cut."""
    vals = token_logratio[mask > 0].float().cpu()
    inner = torch.histc(vals, bins=60, min=-3.0, max=3.0)
    return [int((vals < -3.0).sum())] + [int(c) for c in inner] + [int((vals > 3.0).sum())]


def compute_loss(objective_cfg, policy, reference, batch, hl: HumanlineSpec, histogram: bool = False,
                 z0: torch.Tensor | None = None, correction: CorrectionSpec = NO_CORRECTION):
    """`policy` is a logprobs.PolicyForward (the module to differentiate: a DDP wrapper under DDP, and the run's
    forward options); `z0` (KTO) comes from
    step_z0 over the whole step, else it is estimated from this micro-batch alone; `correction`: the run's
    stale-data correction (core/corrections.py)."""
    metrics: dict[str, float] = {}
    loss, m, logratio, mask = get(objective_cfg.name).loss(objective_cfg, policy, reference, batch, hl, z0,
                                                           correction)
    metrics.update(m)
    metrics["logratio_mean"] = float((logratio.detach() * mask).sum() / mask.sum().clamp(min=1))
    if hl.clamp:
        metrics["humanline/unclamped_fraction"] = unclamped_fraction(logratio.detach(), mask, hl)
    metrics["_n_tokens"] = float(batch.seqs.attention_mask.sum())
    # the positions the forward ran on for those tokens: N x T padded, the same real tokens packed
    metrics["_n_processed"] = float(policy.processed_tokens(batch.seqs))
    if histogram:  # only on logged steps: it copies every token's log-ratio to the host
        metrics["_logratio_hist"] = logratio_histogram(logratio.detach(), mask)
    return loss, metrics
