"""Load tokenizer, policy and reference (safetensors only; remote code only when opted in)."""
from __future__ import annotations

import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from .errors import UserError


def _where(path: str) -> str:
    return path if os.path.exists(path) else f"{path} (not a local dir; hub download needs network)"


def load_tokenizer(path: str, trust_remote_code: bool = False):
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load tokenizer from {_where(path)}: {str(e).splitlines()[0]}") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if tok.eos_token_id is None:
        raise UserError(f"tokenizer at {path} has no eos token; completions could never end")
    return tok


def load_policy(path: str, device: torch.device, trust_remote_code: bool = False) -> torch.nn.Module:
    """fp32 master weights on `device` (autocast handles bf16 compute); weights via safetensors."""
    hf_logging.disable_progress_bar()  # our own progress display is enough
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, use_safetensors=True, dtype=torch.float32, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load model from {_where(path)}: {str(e).splitlines()[0]}") from None
    model.config.use_cache = False
    return model.to(device).train()


def make_reference(policy: torch.nn.Module):
    """A frozen copy of the policy (the starting policy; humanline's sync updates it in place)."""
    from .reference import FrozenCopy

    return FrozenCopy(policy)
