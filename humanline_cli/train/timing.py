"""Wall-clock per phase (setup, world (the bundled world's build, within setup), sample, label, train,
sync, push, eval, save, checkpoint).

Asynchronous online rounds (data.async_lag > 0) add `wait_for_sample` (the trainer blocked on a round
not sampled yet) and `wait_for_trainer` (the sampler process idle, waiting for the next request); their
`sample` is the child's time, overlapped with `train`, so the phases then sum to more than `total`, and
`sampler_start` (the trainer waiting for the child's start, once). report() lists these only when a run
has them: a synchronous run's report is unchanged.

A resumed run continues the interrupted run's timers (`state_dict` / `load_state_dict`): each phase
and the total then count the time spent up to the checkpoint plus this process's own.
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

PHASES = ("setup", "world", "sample", "label", "train", "sync", "push", "eval", "save", "checkpoint")
ASYNC_PHASES = ("wait_for_sample", "wait_for_trainer", "sampler_start")
MODEL_PHASES = ("model",)  # a packaged model's conversion check (model=smollm2): reported when it ran


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

    def add(self, name: str, seconds: float) -> None:
        """Time spent elsewhere (a sampler process) or measured by the caller."""
        self.seconds[name] += seconds

    def elapsed(self) -> float:
        return round(time.perf_counter() - self.start, 3)

    def report(self) -> dict[str, float]:
        out = {p: round(self.seconds.get(p, 0.0), 6) for p in PHASES}
        out.update({p: round(self.seconds[p], 6) for p in (*MODEL_PHASES, *ASYNC_PHASES) if p in self.seconds})
        out["total"] = round(time.perf_counter() - self.start, 3)
        return out

    def state_dict(self) -> dict:
        """The cumulative seconds per phase and in total, so far."""
        return {"seconds": dict(self.seconds), "total": time.perf_counter() - self.start}

    def load_state_dict(self, state: dict) -> None:
        """Add an interrupted run's time to this one's (the phases this process already timed, such as
        its own setup, are kept: the run really spent that time too)."""
        for name, s in state["seconds"].items():
            self.seconds[name] += float(s)
        self.start -= float(state["total"])
