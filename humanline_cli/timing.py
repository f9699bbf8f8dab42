"""Wall-clock per phase (setup, sample, label, train, sync, push, eval, save)."""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

PHASES = ("setup", "sample", "label", "train", "sync", "push", "eval", "save")


class PhaseTimer:
    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.start = time.perf_counter()

    @contextmanager
    def phase(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()  # charge GPU work to the phase that queued it
            self.seconds[name] += time.perf_counter() - t

    def elapsed(self) -> float:
        return round(time.perf_counter() - self.start, 3)

    def report(self) -> dict[str, float]:
        out = {p: round(self.seconds.get(p, 0.0), 6) for p in PHASES}
        out["total"] = round(time.perf_counter() - self.start, 3)
        return out
