"""Attention on CPU under bf16 autocast: short sequences attend in float32.

torch's CPU flash-attention kernel (what transformers' "sdpa" reaches on CPU) runs its bf16 BACKWARD far slower than
its float32 one at short query lengths, and faster at long ones. Forward and backward of one layer of SmolLM2's
shape (9 query heads, 3 key/value heads, head dim 64, ~512 tokens a batch, one thread, torch 2.13, Intel Xeon with
AMX), bf16 over float32 time: 32 tokens 3.8x, 92 2.5x, 128 1.96x, 160 1.74x, 192 1.04x, 256 1.01x, 384 0.84x, 512
0.72x (its bf16 forward is the faster one throughout). So "sdpa_cpu" (the model's attention implementation where
`use_float32_short_attention` set it) computes a call with fewer than FLOAT32_BELOW query positions in float32 (the
query and key arrive in float32 from the rotary embedding; autocast would cast them to bf16) and returns bf16: a
bf16 DPO step of SmolLM2 on 92-token rows spends about half the time in attention. Longer calls, and every call off
the CPU or outside 16-bit compute, run transformers' sdpa unchanged. The choice depends on shapes only, never on grad
mode, so a policy and its reference compute alike and a sync still makes every log-ratio exactly 0."""
from __future__ import annotations

import torch

NAME = "sdpa_cpu"
FLOAT32_BELOW = 192  # query positions: below this the bf16 backward of the CPU kernel is the slower one


def sdpa_cpu(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attention_mask: torch.Tensor | None, **kwargs):
    """transformers' sdpa_attention_forward, in float32 for a short 16-bit call on CPU (the module docstring)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    low = _low_dtype(query)
    if low is None or query.shape[2] >= FLOAT32_BELOW:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():  # an additive mask: its dtype follows
        attention_mask = attention_mask.float()
    with torch.autocast("cpu", enabled=False):  # autocast would cast the float32 inputs back to bf16
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                              **kwargs)
    return out.to(low), weights  # what the 16-bit kernel would have returned


def _low_dtype(query: torch.Tensor) -> torch.dtype | None:
    """The 16-bit dtype a CPU attention call would compute in: the query's own, or autocast's (which casts the
    float32 query that rotary embeddings leave); None off the CPU or in float32/float64."""
    if query.device.type != "cpu":
        return None
    if query.dtype in (torch.bfloat16, torch.float16):
        return query.dtype
    if query.dtype == torch.float32 and torch.is_autocast_enabled("cpu"):
        low = torch.get_autocast_dtype("cpu")
        return low if low in (torch.bfloat16, torch.float16) else None
    return None


def _register() -> None:
    """NAME in transformers' attention and attention-mask registries (idempotent): the mask is sdpa's."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionInterface.register(NAME, sdpa_cpu)
        AttentionMaskInterface.register(NAME, sdpa_mask)


def use_float32_short_attention(model: torch.nn.Module) -> bool:
    """Switch `model` (a transformers model using "sdpa") to NAME; whether it did. Call before copying the model
    (the reference), so both compute alike."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False
    _register()
    model.set_attn_implementation(NAME)
    return model.config._attn_implementation == NAME
