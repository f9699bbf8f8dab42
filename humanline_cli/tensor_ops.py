"""Token log-probs from a causal LM and masked reductions. Leaf module: tensors in, tensors out."""
from __future__ import annotations

import torch

from .batches import Seqs


def token_logps(model: torch.nn.Module, seqs: Seqs) -> torch.Tensor:
    """log p(x_t | x_<t) for t = 1..T-1, shape (N, T-1), float32, zero where loss_mask is 0.

    Uses gather - logsumexp rather than a full log_softmax so the (N, T, V) float32 copy is never
    materialised for large vocabularies.
    """
    logits = model(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask, use_cache=False).logits
    logits = logits[:, :-1].float()
    targets = seqs.input_ids[:, 1:]
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    logps = picked - torch.logsumexp(logits, dim=-1)
    return logps * completion_mask(seqs)


def completion_mask(seqs: Seqs) -> torch.Tensor:
    """Float mask (N, T-1) aligned with token_logps: 1 where the predicted token is a completion token."""
    return seqs.loss_mask[:, 1:].float()


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence sum over tokens: (N, T) -> (N,)."""
    return (x * mask).sum(-1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over every masked token of the batch: (N, T) -> scalar (0 if the mask is empty)."""
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def seq_masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence token mean: (N, T) -> (N,) (0 for an empty sequence)."""
    return (x * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
