"""GRPO: group-normalised advantages, the PPO clip on rho = exp(l~), and a k3 KL penalty to the reference."""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch

from humanline_cli.core.batches import GroupBatch
from humanline_cli.core.corrections import (
    NO_CORRECTION,
    decoupled_weights,
    is_weights,
    mismatch_stats,
    raw_is_ratio,
    sampler_logps_of,
    weight_metrics,
)
from humanline_cli.core.feedback import STD_DDOF, STD_EPS, GroupExample, group_advantages
from humanline_cli.core.humanline import clamp_logratios
from humanline_cli.core.knobs import knob, positive
from humanline_cli.core.logprobs import completion_mask, masked_mean, seq_masked_mean
from humanline_cli.core.objectives.base import Objective, ObjectiveConfig, ObjectiveProperties, TrlPeer
from humanline_cli.errors import UserError


class Aggregation(StrEnum):
    token_mean = "token_mean"
    seq_mean = "seq_mean"
    dapo = "dapo"  # TRL's loss_type=dapo: the step's token sum / the round's completion tokens per step
    # the authors' dapo (open-r1-humanline's _compute_loss on TRL 0.18 / transformers 4.52.3): each accumulation
    # micro-step's token sum / its own token count over all ranks, averaged over the step's micro-steps
    dapo_micro = "dapo_micro"


class RatioDenominator(StrEnum):
    reference = "reference"
    sampler = "sampler"


@dataclass
class GRPOConfig(ObjectiveConfig):
    name: str = "grpo"
    beta: float = 0.01
    epsilon: float = knob(0.2, "PPO clip (reference code default 0.01, its online-humanline script 0.15)")
    std_ddof: int = knob(STD_DDOF, "0: population std of a group's rewards, as in the reference code (TRL/verl: 1)")
    std_eps: float = knob(STD_EPS, "advantage A = (s - mean) / (std + std_eps)")
    ratio_denominator: RatioDenominator = knob(
        RatioDenominator.reference, "the PPO ratio's denominator: reference (the reference code: the reference plays "
                                    "pi_old) | sampler (the sampler's log-probs; online only)")
    aggregation: Aggregation = knob(
        Aggregation.token_mean, "how token losses become the step's loss: token_mean (reference code) | seq_mean | "
                                "dapo (TRL's loss_type=dapo; online only) | dapo_micro (the authors' dapo, per "
                                "micro-step; docs/method.md)")


# GRPO aggregations whose micro-batch loss is the token mean (dapo / dapo_micro differ only in how the trainer
# weights micro-batches: GRPO.micro_batch_weights)
TOKEN_MEAN_AGGREGATIONS = ("token_mean", "dapo", "dapo_micro")


def grpo_loss(
    token_logratio_ratio: torch.Tensor,
    token_logratio_kl: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    epsilon: float,
    beta: float,
    aggregation: str = "token_mean",
    token_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy gradient with a k3 KL penalty.

    token_logratio_ratio (N, T): log(pi / pi_denominator), humanline-clamped when on; rho = exp(.).
    token_logratio_kl (N, T): UNclamped log(pi / pi_ref) for k3 = exp(ref - pol) - (ref - pol) - 1.
    advantages (N,). Per token: -min(A rho, A clip(rho, 1-eps, 1+eps)) * w + beta * k3, where w (N, T) is
    `token_weight`, a stale-data correction's detached importance weight (core/corrections.py; None: w = 1), as
    TRL multiplies its vLLM importance weight into the policy-gradient term only.
    aggregation: "token_mean" (mean over every completion token of the batch, the reference code)
    or "seq_mean" (mean of per-sequence token means); "dapo" and "dapo_micro" are the token mean here too:
    the trainer weights it into TRL's or the authors' dapo loss (GRPO.micro_batch_weights).
    """
    rho = torch.exp(token_logratio_ratio)
    adv = advantages.to(rho.dtype).unsqueeze(-1)
    unclipped = adv * rho
    clipped = adv * rho.clamp(1.0 - epsilon, 1.0 + epsilon)
    pg = -torch.minimum(unclipped, clipped)
    if token_weight is not None:
        pg = pg * token_weight.detach()
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


class GRPO(Objective):
    name = "grpo"
    config = GRPOConfig
    properties = ObjectiveProperties(unit="groups", units_per_prompt=1, min_micro_batch=1, seqs_per_unit=0)
    example = GroupExample
    # trdpo is refused: the reference is the ratio's denominator (the reference code) and the round-start policy
    # the IS corrections weigh against, so a soft mix of it is no peer's algorithm
    corrections = ("none", "humanline", "tis", "mis", "decoupled")

    def units(self, group, min_gap, pair=None):
        return [GroupExample(group.prompt, list(group.completions), list(group.scores))]

    def completions(self, unit):
        return list(unit.completions)

    def collate(self, units, partners, seqs, cfg):
        prompts, comps, advs = [], [], []
        for u in units:
            prompts += [u.prompt] * len(u.completions)
            comps += list(u.completions)
            advs.append(group_advantages(torch.tensor(u.rewards, dtype=torch.float64), cfg.std_ddof, cfg.std_eps))
        s = seqs(prompts, comps)
        return GroupBatch(s, torch.cat(advs), sampler_logps_of(s, comps))

    def trl_peer(self, cfg):  # GRPOTrainer generates its own groups: no row of ours
        loss_type = {"token_mean": "bnpo", "dapo": "dapo"}.get(cfg.aggregation, "grpo")
        return TrlPeer("GRPO", {"epsilon": cfg.epsilon, "loss_type": loss_type})

    def check(self, cfg, data):
        if positive(cfg.epsilon, "objective.epsilon") >= 1.0:
            raise UserError(f"objective.epsilon must be in (0, 1), got {cfg.epsilon}")
        if cfg.ratio_denominator == "sampler" and data.regime == "offline":
            raise UserError("objective.ratio_denominator=sampler needs data=online (offline data has no "
                            "sampling log-probs)")
        if cfg.aggregation == "dapo" and data.regime != "online":
            raise UserError("objective.aggregation=dapo needs data=online (it divides by the completion tokens per "
                            "step of the round a step's data were sampled in)")
        if cfg.std_ddof not in (0, 1):
            raise UserError("objective.std_ddof must be 0 or 1")
        if cfg.std_eps < 0:
            raise UserError("objective.std_eps must be >= 0")

    def check_online(self, cfg, data):
        if data.n < 2:  # advantages come from the spread within a group
            raise UserError(f"objective=grpo needs data.n >= 2 samples per prompt, got data.n={data.n} (a group of "
                            f"one has no reward spread: every advantage is 0 and nothing trains)")

    def split_invariant(self, cfg):
        # aggregation=dapo_micro's loss depends on the split
        return cfg.aggregation != "dapo_micro"

    def loss(self, cfg, policy, reference, batch, hl, z0, correction=NO_CORRECTION):
        """tis / mis / decoupled (`correction`): the ratio's denominator is the trainer's own log-probs at the
        round's start (the reference, reset each round) and the policy-gradient term is weighted by their ratio to
        the sampler's (core/corrections.py). `mismatch/*`: the reference's log-probs against the sampler's, where
        the reference holds the sampling weights."""
        ref = reference.logps(batch.seqs)
        pol = policy.logps(batch.seqs)
        logratio, mask = pol - ref, completion_mask(batch.seqs)
        if cfg.ratio_denominator == "sampler":
            ratio_logratio = pol - batch.sampler_logps * mask
        else:  # the reference code: the reference plays pi_old
            ratio_logratio = logratio
        weight, cm = None, {}
        if correction.weights_tokens:
            if correction.kind == "decoupled":
                weight = decoupled_weights(ref, batch.sampler_logps, mask, correction.cap)
                raw = raw_is_ratio(ref, batch.sampler_logps, mask)
            else:
                weight = is_weights(ref, batch.sampler_logps, mask, correction.mode, correction.cap, correction.cap_min)
                raw = raw_is_ratio(ref, batch.sampler_logps, mask, correction.mode.rpartition("_")[0])
            cm = weight_metrics(raw, weight, mask)
        loss, m = grpo_loss(clamp_logratios(ratio_logratio, hl), logratio, mask, batch.advantages, cfg.epsilon,
                            cfg.beta, cfg.aggregation, weight)
        m.update(cm)
        if batch.sampler_logps is not None:  # online data: how far the policy has moved from its sampler
            m.update(sampler_drift(pol.detach(), batch.sampler_logps, mask))
            if correction.reference_is_sampler:
                m.update(mismatch_stats(ref, batch.sampler_logps, mask))
        return loss, m, logratio, mask

    def loss_count(self, cfg, batch):
        """Completion tokens for the token mean, else groups' sequences."""
        if cfg.aggregation in TOKEN_MEAN_AGGREGATIONS:
            return float(completion_mask(batch.seqs).sum())
        return super().loss_count(cfg, batch)

    def micro_batch_weights(self, cfg, counts, total, world_size, round_tokens_per_step=None, micro_totals=None):
        """aggregation=dapo (TRL's loss_type=dapo): w_i = counts[i] / D x world_size, D = round_tokens_per_step,
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
        if cfg.aggregation == "dapo_micro":
            if micro_totals is None or len(micro_totals) != len(counts):
                raise ValueError("aggregation=dapo_micro needs each micro-step's token count over all ranks")
            g = sum(1 for n in micro_totals if n > 0)
            return [c / n / g * world_size if n > 0 else 0.0 for c, n in zip(counts, micro_totals)]
        if cfg.aggregation == "dapo":
            if round_tokens_per_step is None:
                raise ValueError("aggregation=dapo needs the round's completion tokens per step (online data)")
            total = round_tokens_per_step
        return super().micro_batch_weights(cfg, counts, total, world_size)


OBJECTIVE = GRPO()
