"""AdamW with linear warm-up then constant (the paper) or cosine decay."""
from __future__ import annotations

import math

import torch


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def lr_factor(step: int, total: int, warmup_ratio: float, schedule: str) -> float:
    """Multiplier for optimizer step `step` (0-based): linear warm-up over ceil(ratio*total) steps."""
    warmup = math.ceil(warmup_ratio * total)
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return 1.0


def make_scheduler(opt, total: int, warmup_ratio: float, schedule: str):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total, warmup_ratio, schedule))
