"""Glue between models and losses: token log-ratios (policy minus reference), the humanline
transform in exactly one place, then the objective's pure loss. Returns (loss, metrics).

`PROPERTIES` holds what the rest of the package needs to know about each objective (what one unit of
train.batch_size is, how many sequences it runs through the model, how many units one sampled prompt gives),
so a new objective is its loss, one entry here and its config.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from humanline_cli.core.batches import BinaryBatch, GroupBatch, PairBatch, n_units
from humanline_cli.core.humanline import HumanlineSpec, clamp_logratios, unclamped_fraction
from humanline_cli.core.logprobs import completion_mask, masked_sum, processed_tokens, token_logps
from humanline_cli.core.losses import TOKEN_MEAN_AGGREGATIONS, dpo_loss, grpo_loss, kto_loss, kto_reference_point


@dataclass(frozen=True)
class ObjectiveProperties:
    unit: str                 # what one unit of train.batch_size is (pairs, examples, groups)
    units_per_prompt: int     # units one online prompt's scored samples give (a round samples B x K / this)
    min_micro_batch: int      # the fewest units a micro-batch may hold
    seqs_per_unit: int        # sequences one unit runs through the model; 0: the group size (grpo)

    def sequences(self, units: int, group: int) -> int:
        """Sequences `units` units run through the model; `group`: sequences in a GRPO group."""
        return units * (self.seqs_per_unit or group)


PROPERTIES = {
    "dpo": ObjectiveProperties(unit="pairs", units_per_prompt=1, min_micro_batch=1, seqs_per_unit=2),
    # a desirable and an undesirable example per prompt; z0 pairs each prompt with the next example's completion,
    # so one example alone would be mismatched with itself
    "kto": ObjectiveProperties(unit="examples", units_per_prompt=2, min_micro_batch=2, seqs_per_unit=1),
    "grpo": ObjectiveProperties(unit="groups", units_per_prompt=1, min_micro_batch=1, seqs_per_unit=0),
}


def _logratios(policy, reference, seqs, grad: bool = True):
    """(token_logratio (N, T-1), mask (N, T-1), policy_logps). `reference` is a reference.py object."""
    ref = reference.logps(seqs)
    if grad:
        pol = token_logps(policy, seqs)
    else:
        with torch.no_grad():
            pol = token_logps(policy, seqs)
    return pol - ref, completion_mask(seqs), pol


def step_z0(objective_cfg, policy, reference, micro_batches, hl: HumanlineSpec, reduce_sum=None,
            fillers: list[bool] | None = None) -> torch.Tensor | None:
    """KTO's z0 for a whole optimizer step: max(0, mean r(x_i, y_partner(i))) over every mismatched
    pair of every micro-batch on every rank (`reduce_sum` sums a tensor across ranks), without
    gradient and with the humanline clamp. So z0, like the loss, does not depend on how the global
    batch is split into micro-batches or processes. None for DPO/GRPO. `fillers[i]`: micro-batch i only
    pads a rank's share (sources.source.micro_batches): its forward runs (a collective under FSDP), its
    pairs are not counted."""
    if objective_cfg.name != "kto":
        return None
    total = torch.zeros(2, dtype=torch.float64)
    for i, mb in enumerate(micro_batches):
        kl_logratio, kl_mask, _ = _logratios(policy, reference, mb.kl_seqs, grad=False)
        r = masked_sum(clamp_logratios(kl_logratio, hl), kl_mask)
        if fillers is not None and fillers[i]:
            continue
        total += torch.stack([r.sum().double().cpu(), torch.tensor(float(len(r)), dtype=torch.float64)])
    if reduce_sum is not None:
        total = reduce_sum(total)
    # float64: kto_loss casts z0 to the log-ratios' dtype (float32, or float64 under precision=fp64)
    return (total[0] / total[1].clamp(min=1.0)).clamp(min=0.0)


def loss_count(objective_cfg, batch) -> float:
    """What the objective's loss averages over in this micro-batch: completion tokens for GRPO's
    token mean, else units (pairs, examples, sequences). The trainer weights each micro-batch's loss
    by count / (count over the global batch), so micro-batching and ranks only change memory."""
    if isinstance(batch, GroupBatch) and objective_cfg.aggregation in TOKEN_MEAN_AGGREGATIONS:
        return float(completion_mask(batch.seqs).sum())
    return float(n_units(batch))


def micro_batch_weights(objective_cfg, counts: list[float], total: float, world_size: int,
                        round_tokens_per_step: float | None = None,
                        micro_totals: list[float] | None = None) -> list[float]:
    """What each micro-batch's mean loss is multiplied by before backward, so that the summed (and, under
    DDP/FSDP, rank-averaged) gradient is the gradient of the step's loss.

    counts[i] = loss_count of micro-batch i of this rank; total = the sum over every rank's micro-batches.
    Default: w_i = counts[i] / total x world_size, so the step's loss is the mean over the GLOBAL batch's
    units or tokens (DDP/FSDP average over ranks, hence x world_size).
    aggregation=dapo (TRL's loss_type=dapo): w_i = counts[i] / D x world_size, D = round_tokens_per_step,
    the completion tokens of the round (generation) this step's data came from per optimizer step it serves:
    step loss = (sum over the step's completion tokens of the per-token loss) / D. TRL: num_items_in_batch
    (the generation batch's tokens over all processes) x gradient_accumulation_steps / steps_per_generation.
    A round of one step gives D = total (token_mean); a stale round of K steps gives its mean, so a step
    with longer completions than its round's average weighs more.
    aggregation=dapo_micro (the authors' dapo: open-r1-humanline's _compute_loss divides micro-step i's token
    sum by N_i / world_size, N_i = micro-step i's completion tokens over all ranks, and transformers 4.52.3
    divides each micro-step's loss by the accumulation steps G): w_i = counts[i] / N_i / G x world_size,
    micro_totals[i] = N_i; step loss = (1/G) sum_i (micro-step i's token sum over all ranks) / N_i, the mean
    over micro-steps of each micro-step's global token mean. G counts the micro-steps with a token on some
    rank. It depends on how the step is split into micro-batches (train.micro_batch_size), as the authors'
    loss did on per_device_train_batch_size."""
    name = objective_cfg.name
    if name == "grpo" and objective_cfg.aggregation == "dapo_micro":
        if micro_totals is None or len(micro_totals) != len(counts):
            raise ValueError("aggregation=dapo_micro needs each micro-step's token count over all ranks")
        g = sum(1 for n in micro_totals if n > 0)
        return [c / n / g * world_size if n > 0 else 0.0 for c, n in zip(counts, micro_totals)]
    den = total
    if name == "grpo" and objective_cfg.aggregation == "dapo":
        if round_tokens_per_step is None:
            raise ValueError("aggregation=dapo needs the round's completion tokens per step (online data)")
        den = round_tokens_per_step
    return [c / max(den, 1.0) * world_size for c in counts]


def logratio_histogram(token_logratio: torch.Tensor, mask: torch.Tensor) -> list[int]:
    """Counts of completion-token log-ratios in 60 bins over [-3, 3], plus underflow and overflow
    (62 numbers): the humanline diagnostic of how many tokens the clamp band would cut."""
    vals = token_logratio[mask > 0].float().cpu()
    inner = torch.histc(vals, bins=60, min=-3.0, max=3.0)
    return [int((vals < -3.0).sum())] + [int(c) for c in inner] + [int((vals > 3.0).sum())]


def sampler_drift(policy_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor) -> dict:
    """How far the policy being trained has drifted from the policy that sampled its data, on the trained
    (completion) tokens: `drift/logratio_mean`, the token mean of log pi(y_t) - log pi_sampler(y_t), and
    `drift/kl`, the token mean of exp(r) - 1 - r with r = log pi(y_t) - log pi_sampler(y_t) (the k3 estimate of
    KL(pi_sampler || pi) from the sampler's own tokens: unbiased, non-negative per token). Both are 0 when the policy is the
    sampler (online, before its first update on a round) and grow as a round's data is reused
    (data.generate_every=K); a staleness axis that does not depend on the step count or lr."""
    n = mask.sum().clamp(min=1)
    r = (policy_logps.float() - sampler_logps.float()) * mask
    kl = (torch.exp(r) - 1.0 - r) * mask
    return {"drift/logratio_mean": float(r.sum() / n), "drift/kl": float(kl.sum() / n)}


def compute_loss(objective_cfg, policy, reference, batch, hl: HumanlineSpec, histogram: bool = False,
                 z0: torch.Tensor | None = None):
    """`policy` is the module to differentiate (a DDP wrapper under DDP); `z0` (KTO) comes from
    step_z0 over the whole step, else it is estimated from this micro-batch alone."""
    metrics: dict[str, float] = {}
    match batch:
        case PairBatch():
            logratio, mask, _ = _logratios(policy, reference, batch.seqs)
            tl = clamp_logratios(logratio, hl)
            b = logratio.shape[0] // 2
            loss, m = dpo_loss(tl[:b], mask[:b], tl[b:], mask[b:], objective_cfg.beta)
        case BinaryBatch():
            logratio, mask, _ = _logratios(policy, reference, batch.seqs)
            if z0 is None:
                kl_logratio, kl_mask, _ = _logratios(policy, reference, batch.kl_seqs, grad=False)
                z0 = kto_reference_point(clamp_logratios(kl_logratio, hl), kl_mask)
            loss, m = kto_loss(clamp_logratios(logratio, hl), mask, batch.labels, z0, objective_cfg.beta,
                               objective_cfg.desirable_weight, objective_cfg.undesirable_weight)
        case GroupBatch():
            logratio, mask, pol = _logratios(policy, reference, batch.seqs)
            if objective_cfg.ratio_denominator == "sampler":
                ratio_logratio = pol - batch.sampler_logps * mask
            else:  # the reference code: the reference plays pi_old
                ratio_logratio = logratio
            loss, m = grpo_loss(clamp_logratios(ratio_logratio, hl), logratio, mask, batch.advantages,
                                objective_cfg.epsilon, objective_cfg.beta, objective_cfg.aggregation)
            if batch.sampler_logps is not None:  # online data: how far the policy has moved from its sampler
                m.update(sampler_drift(pol.detach(), batch.sampler_logps, mask))
        case _:
            raise TypeError(type(batch))
    metrics.update(m)
    metrics["logratio_mean"] = float((logratio.detach() * mask).sum() / mask.sum().clamp(min=1))
    if hl.clamp:
        metrics["humanline/unclamped_fraction"] = unclamped_fraction(logratio.detach(), mask, hl)
    metrics["_n_tokens"] = float(batch.seqs.attention_mask.sum())
    # the positions the forward ran on for those tokens: N x T padded, the same real tokens packed
    metrics["_n_processed"] = float(processed_tokens(policy, batch.seqs))
    if histogram:  # only on logged steps: it copies every token's log-ratio to the host
        metrics["_logratio_hist"] = logratio_histogram(logratio.detach(), mask)
    return loss, metrics
