"""The bench's clocks: wall time that waits for the device (CUDA work is asynchronous), and the best
FLOP/s of one matmul shape, the peak a model's FLOP/s is reported against."""
from __future__ import annotations

import time

import torch


def _now(device) -> float:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def matmul_peak(m: int, k: int, n: int, device, dtype, seconds: float = 0.3) -> float:
    """Best FLOP/s of an (m x k) @ (k x n) matmul over three timing windows."""
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    best = 0.0
    for _ in range(3):
        t0, reps = _now(device), 0
        while True:
            a @ b
            reps += 1
            t = _now(device) - t0
            if t >= seconds / 3:
                break
        best = max(best, 2.0 * m * k * n * reps / t)
    return best
