"""Token log-probs from a causal LM and masked reductions. Leaf module: tensors in, tensors out.

`token_logps` never builds the full (N, T, V) logits. It runs the model's decoder to the final
hidden states, keeps only the positions whose next token is a completion token, and applies the
LM head to chunks of those positions: gather - logsumexp in float32, one chunk of logits alive at
a time in the forward and (through per-chunk activation checkpointing) in the backward too.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from .batches import Seqs

# Float32 elements in one chunk's logits (2**25 = 128 MiB): 261 tokens at a 128k vocabulary,
# the whole batch at once for a small one. The backward holds about four such buffers.
LOGITS_PER_CHUNK = 2**25

# Config attributes by which a model's forward transforms `lm_head(hidden)` (Gemma 2/3 soft-capping,
# Cohere's logit_scale, Granite's logits_scaling, Falcon-H1's lm_head_multiplier, MiniCPM's width
# scaling...). The chunked path would skip that transform, so such models take the full-logits path.
_HEAD_EXTRAS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier",
                "lm_head_multiplier", "dim_model_base", "mup_width_multiplier")


def token_logps(model: torch.nn.Module, seqs: Seqs, chunk_size: int | None = None) -> torch.Tensor:
    """log p(x_t | x_<t) for t = 1..T-1, shape (N, T-1), float32, zero where the completion mask is 0.

    input_ids/attention_mask (N, T) -> hidden states (N, T, H) from `model.get_decoder()` -> the M
    positions with completion_mask 1 -> `model.get_output_embeddings()` on chunks of `chunk_size`
    of them (default: LOGITS_PER_CHUNK // vocab), logits cast to float32 per chunk (bf16 autocast
    included), log p = logit[target] - logsumexp(logits). With grad enabled each chunk is
    checkpointed, so the backward recomputes one chunk's logits at a time (one extra head matmul,
    no (N, T, V) buffer). The decoder and head are called as modules, so hooks on them (LoRA layers,
    a wrapper's forward hooks on lm_head) fire as in `model(...)`.

    Falls back to the full-logits path (`_full_logits_token_logps`) when the model does not expose a
    separate decoder and output embedding (e.g. a DDP wrapper), is an FSDP2 root (whose pre-forward
    hook gathers the head), is a peft prompt-learning model (virtual tokens live in its forward), or
    its config declares a logit transform listed in _HEAD_EXTRAS.
    """
    split = _decoder_and_head(model)
    if split is None:
        return _full_logits_token_logps(model, seqs)
    decoder, head = split
    out = decoder(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask, use_cache=False)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    rows, cols = seqs.loss_mask[:, 1:].nonzero(as_tuple=True)  # position t predicts token t+1
    h = hidden[rows, cols]  # (M, H)
    targets = seqs.input_ids[rows, cols + 1]  # (M,)
    size = chunk_size or max(1, LOGITS_PER_CHUNK // _vocab_size(model))
    grad = torch.is_grad_enabled()
    pieces = []
    for start in range(0, max(len(targets), 1), size):  # one (empty) chunk keeps an empty batch in the graph
        h_c, t_c = h[start : start + size], targets[start : start + size]
        if grad:
            pieces.append(checkpoint(_chunk_logps, head, h_c, t_c, use_reentrant=False, preserve_rng_state=False))
        else:
            pieces.append(_chunk_logps(head, h_c, t_c))
    picked = torch.cat(pieces)
    logps = torch.zeros(seqs.input_ids.shape[0], seqs.input_ids.shape[1] - 1, dtype=torch.float32,
                        device=picked.device)
    return logps.index_put((rows, cols), picked)


def _chunk_logps(head: torch.nn.Module, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(C, H) hidden states, (C,) targets -> (C,) float32 log-probs."""
    logits = head(h).float()
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _full_logits_token_logps(model: torch.nn.Module, seqs: Seqs) -> torch.Tensor:
    """The reference path: the model's own forward, the full (N, T, V) logits cast to float32."""
    logits = model(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask, use_cache=False).logits
    logits = logits[:, :-1].float()
    targets = seqs.input_ids[:, 1:]
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    logps = picked - torch.logsumexp(logits, dim=-1)
    return logps * completion_mask(seqs)


def _decoder_and_head(model: torch.nn.Module):
    """(decoder, lm_head) modules when `model(x).logits == lm_head(decoder(x).last_hidden_state)`, else None."""
    if _is_fsdp_root(model):
        return None
    peft_cfg = getattr(model, "active_peft_config", None)
    if peft_cfg is not None and getattr(peft_cfg, "is_prompt_learning", False):
        return None
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if any(getattr(text_config, key, None) is not None for key in _HEAD_EXTRAS):
        return None
    get_decoder = getattr(model, "get_decoder", None)
    get_head = getattr(model, "get_output_embeddings", None)
    if not (callable(get_decoder) and callable(get_head)):
        return None
    decoder, head = get_decoder(), get_head()
    if not isinstance(decoder, torch.nn.Module) or not isinstance(head, torch.nn.Module) or decoder is model:
        return None
    return decoder, head


def _is_fsdp_root(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return False
    return isinstance(model, FSDPModule)


def _vocab_size(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(getattr(text_config, "vocab_size", None) or 2**17)


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
