"""Device, precision and seeding. CUDA runs keep fp32 master weights under bf16 autocast."""
from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass

import numpy as np
import torch

from .errors import UserError


@dataclass(frozen=True)
class Backend:
    device: torch.device
    autocast_dtype: torch.dtype | None  # None = full fp32

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def describe(self) -> str:
        prec = "fp32" if self.autocast_dtype is None else f"{self.autocast_dtype} autocast"
        return f"{self.device.type} ({prec}, {torch.get_num_threads()} CPU threads)"


def make_backend(device: str, precision: str, threads: int | None = None) -> Backend:
    if threads:
        torch.set_num_threads(int(threads))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("backend=cuda but torch sees no CUDA device (use backend=cpu or backend=auto)")
    if precision == "auto":
        precision = "bf16" if device == "cuda" else "fp32"
    if precision == "bf16" and device == "cpu":
        raise UserError("backend.precision=bf16 is only supported on cuda here; use fp32 on cpu")
    return Backend(torch.device(device), torch.bfloat16 if precision == "bf16" else None)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
