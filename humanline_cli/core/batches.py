"""Batch types every data source yields and every objective consumes.

Sequences are prompt+completion token ids, right-padded. `loss_mask` marks completion tokens
(through the first EOS) in input-position coordinates; log-prob tensors are (N, T-1) and use
loss_mask[:, 1:]. Offline files and online rollouts both produce these types, so the trainer
cannot tell them apart.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass, replace

import torch


@dataclass
class Seqs:
    input_ids: torch.Tensor  # (N, T) long
    attention_mask: torch.Tensor  # (N, T) long, 1 on real tokens
    loss_mask: torch.Tensor  # (N, T) bool, 1 on completion tokens

    def __len__(self) -> int:
        return self.input_ids.shape[0]


@dataclass
class _Cut:
    """What sources.source.micro_batches records on each micro-batch it cuts. Every batch type derives from it
    (an objective's own too, core/objectives/) and holds its sequences in `seqs`."""

    units: list | None = field(default=None, kw_only=True, compare=False, repr=False)  # named if its loss is not finite
    filler: bool = field(default=False, kw_only=True)  # a padding copy: it runs the collectives, trains nothing

    def n_units(self) -> int:
        """Objective units the batch holds: one per sequence unless the batch type says otherwise."""
        return len(self.seqs)

    def extra_seqs(self) -> tuple:
        """Sequences the loss also runs through the model besides `seqs` (none unless the batch type has some)."""
        return ()


@dataclass
class PairBatch(_Cut):
    """DPO: `seqs` holds B chosen sequences followed by B rejected ones (one forward pass)."""

    seqs: Seqs

    def n_units(self) -> int:
        return len(self.seqs) // 2


@dataclass
class BinaryBatch(_Cut):
    """KTO: B examples with desirable (True) / undesirable labels, plus mismatched sequences
    (prompt i with completion i+1) for the KL reference point z0."""

    seqs: Seqs
    labels: torch.Tensor  # (B,) bool
    kl_seqs: Seqs

    def extra_seqs(self) -> tuple:
        return (self.kl_seqs,)


@dataclass
class GroupBatch(_Cut):
    """GRPO: N completions with precomputed group-normalised advantages.
    `sampler_logps` (N, T-1) is present for online data (ratio_denominator=sampler)."""

    seqs: Seqs
    advantages: torch.Tensor  # (N,) float
    sampler_logps: torch.Tensor | None = None


Batch = PairBatch | BinaryBatch | GroupBatch


def to_device(obj, device: torch.device):
    """Move every tensor field (recursively through Seqs) to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if obj is None or not is_dataclass(obj):
        return obj
    return replace(obj, **{f.name: to_device(getattr(obj, f.name), device) for f in fields(obj)})


def n_units(batch: Batch) -> int:
    """How many objective units (pairs / examples / completions) a batch holds."""
    return batch.n_units()
