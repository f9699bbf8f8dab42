"""What an objective is to the rest of the package, and the glue every objective shares.

An objective is one module of this package holding an `Objective` (`OBJECTIVE = MyObjective()`), and one option
file, conf/objective/NAME.yaml. The `Objective` carries its config schema (a dataclass of `knob`s, registered by
humanline_cli/schema.py under `schema/objective/NAME`), its properties (what one unit of train.batch_size is), how a
scored group becomes its units, how its units collate into its batch, its loss on a micro-batch, its config checks
and how the trainer weights its micro-batches. Nothing outside core/ branches on an objective's name: it looks the
objective up in the registry (core/objectives/__init__.py) and asks it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from humanline_cli.core.batches import Seqs, n_units
from humanline_cli.core.corrections import NO_CORRECTION, CorrectionSpec
from humanline_cli.core.feedback import ScoredGroup
from humanline_cli.core.humanline import HumanlineSpec
from humanline_cli.core.knobs import knob
from humanline_cli.core.logprobs import completion_mask


@dataclass
class ObjectiveConfig:
    name: str = knob(help="the objective: dpo | ipo | kto | grpo (the option chosen)")
    beta: float = knob(0.1, "weight of the reference: DPO's and KTO's beta; GRPO's KL weight")
    batch_size: int = knob(32, "units per optimizer step: pairs (dpo, ipo), examples (kto), groups (grpo; a scored "
                                  "pair: 2)")
    tempered_logps: bool = knob(False, "log-probs of softmax(logits / data.temperature) for the policy, the reference "
                                       "and the sampler (TRL's convention, the authors' math code); false: of "
                                       "softmax(logits)")


@dataclass(frozen=True)
class ObjectiveProperties:
    unit: str                 # what one unit of train.batch_size is (pairs, examples, groups)
    units_per_prompt: int     # units one online prompt's scored samples give (a round samples B x K / this)
    min_micro_batch: int      # the fewest units a micro-batch may hold
    seqs_per_unit: int        # sequences one unit runs through the model; 0: the group size (grpo)

    def sequences(self, units: int, group: int) -> int:
        """Sequences `units` units run through the model; `group`: sequences in a GRPO group."""
        return units * (self.seqs_per_unit or group)


@dataclass(frozen=True)
class TrlPeer:
    """An objective's counterpart in TRL, which `humanline bench` times beside it: trl.<trainer>Trainer with
    trl.<trainer>Config and the objective's own keys of that config; named as strings so core never imports TRL."""

    trainer: str                # "DPO" | "KTO" | "GRPO": the TRL trainer and config class prefix
    args: dict                  # the objective's keys of TRL's config (loss_type, desirable_weight, epsilon, ...)
    # a unit -> its row of TRL's dataset; None: TRL's trainer trains only on its own generations (GRPOTrainer), so
    # its offline row times its loss path on the project's fixed units, and data=online compares Trainer.train
    row: Callable[[object], dict] | None = None


# (prompts, completions) -> their collated sequences: the collator's tokenisation (data/collate.py)
SeqsOf = Callable[[list, list], Seqs]


class Objective:
    """One objective. Subclasses set the class attributes and implement `units`, `completions`, `collate` and
    `loss`; the other methods have the defaults most objectives want."""

    name: ClassVar[str]
    config: ClassVar[type[ObjectiveConfig]]      # its config schema (objective.*)
    properties: ClassVar[ObjectiveProperties]
    example: ClassVar[type]                      # its unit's type (core/feedback.py's, or its own dataclass)
    # rows without a pair or group (prompt/completion/label) are its units as they are; otherwise such a file is
    # refused, since no preference can be read from one labelled completion
    unpaired_rows: ClassVar[bool] = False
    # why a micro-batch needs at least properties.min_micro_batch units (shown when a config asks for fewer)
    min_micro_batch_reason: ClassVar[str] = ""
    # why paired rows in file order (data.shuffle=false) are refused; None: they are fine
    unshuffled_pairs_refused: ClassVar[str | None] = None
    # the stale-data corrections (correction=KIND, core/corrections.py) that have a meaning for this objective
    corrections: ClassVar[tuple[str, ...]] = ("none", "humanline", "trdpo")

    # ---------------------------------------------------------------- data
    def units(self, group: ScoredGroup, min_gap: float, pair: tuple | None = None) -> list:
        """One scored group -> its units (possibly none). `pair` (chosen, rejected) is set when the data names
        the preferred completion; otherwise the scores decide, and a gap <= min_gap may leave no preference."""
        raise NotImplementedError

    def completions(self, unit) -> list:
        """The completions a unit trains on (their tokens are what length bucketing and dapo count)."""
        raise NotImplementedError

    def collate(self, units: list, partners: list | None, seqs: SeqsOf, cfg) -> object:
        """Units -> one batch. `partners[i]` is the unit after units[i] in the whole step (objectives that pair a
        unit with another's completion use it; None: the next unit of `units`, wrapping around). `cfg` is the
        objective's config (or a stand-in with the keys collation reads)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- config
    def check(self, cfg, data) -> None:
        """objective.*'s own rules (beta and batch_size are checked for every objective); `data` is data.*."""

    def check_online(self, cfg, data) -> None:
        """Rules on online data's keys (data.n, ...) this objective needs."""

    def trl_peer(self, cfg) -> TrlPeer | None:
        """What `humanline bench` compares the objective with in TRL; None: no peer (its TRL rows are skipped)."""
        return None

    def split_invariant(self, cfg) -> bool:
        """Whether the step's loss is the same however the step is cut into micro-batches (train.micro_batch_size
        =auto may then choose the cut from memory alone)."""
        return True

    # ---------------------------------------------------------------- loss
    def loss(self, cfg, policy, reference, batch, hl: HumanlineSpec, z0: torch.Tensor | None,
             correction: CorrectionSpec = NO_CORRECTION):
        """(loss, metrics, token log-ratio (N, T-1), mask (N, T-1)) of one micro-batch; the log-ratio and mask are
        the sequences' policy-minus-reference ones, before the humanline clamp, for the shared metrics. `policy`:
        a logprobs.PolicyForward (`policy.logps(seqs)`, as `reference.logps(seqs)`). `correction`: the run's
        stale-data correction, for objectives whose loss it changes (GRPO's tis, mis, decoupled); a reference-rule
        correction (trdpo) never reaches the loss."""
        raise NotImplementedError

    def step_z0(self, cfg, policy, reference, micro_batches, hl: HumanlineSpec, reduce_sum=None,
                fillers: list[bool] | None = None) -> torch.Tensor | None:
        """A statistic of the whole optimizer step the loss needs before any micro-batch's backward (KTO's z0);
        None when the loss needs none."""
        return None

    def loss_count(self, cfg, batch) -> float:
        """What the loss averages over in this micro-batch (units, unless the objective says otherwise)."""
        return float(n_units(batch))

    def micro_batch_weights(self, cfg, counts: list[float], total: float, world_size: int,
                            round_tokens_per_step: float | None = None,
                            micro_totals: list[float] | None = None) -> list[float]:
        """What each micro-batch's mean loss is multiplied by before backward: counts[i] / total x world_size, so
        the step's loss is the mean over the GLOBAL batch (DDP/FSDP average over ranks, hence x world_size)."""
        return [c / max(total, 1.0) * world_size for c in counts]


def logratios(policy, reference, seqs, grad: bool = True):
    """(token_logratio (N, T-1), mask (N, T-1), policy_logps). `policy` is a logprobs.PolicyForward, `reference` a
    reference.py object: both run `seqs` with the run's forward options."""
    ref = reference.logps(seqs)
    if grad:
        pol = policy.logps(seqs)
    else:
        with torch.no_grad():
            pol = policy.logps(seqs)
    return pol - ref, completion_mask(seqs), pol
