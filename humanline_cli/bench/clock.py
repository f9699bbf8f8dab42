"""The bench's clocks: wall time that waits for the device (CUDA work is asynchronous), the per-step
timing record of one run (ours or TRL's), and the best FLOP/s of one matmul shape, the peak a model's
FLOP/s is reported against."""
from __future__ import annotations

import contextlib
import io
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from humanline_cli.sources.source import SourceWrapper


def _now(device) -> float:
    if device is not None and torch.device(device).type == "cuda":
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
        while (t := _now(device) - t0) < seconds / 3 or not reps:
            a @ b
            reps += 1
        best = max(best, 2.0 * m * k * n * reps / t)
    return best


@dataclass
class Run:
    """Per-step wall times and sizes of the timed steps of one run."""

    seconds: list[float] = field(default_factory=list)
    units: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    kl_tokens: list[int] = field(default_factory=list)
    completions: list[int] = field(default_factory=list)  # sequences per step (online GRPO rows)
    positions: list[int] = field(default_factory=list)  # decoder positions per step (the project's runs)
    cache_hit_fraction: float | None = None  # reference-cache hits over the run's steps (cached rows)
    precision: str | None = None  # what TRL's trainer computed in (its TrainingArguments' bf16): TRL's rows


def collect(starts: list[float], end: float, sizes: list[tuple], warmup: int, precision: str | None = None) -> Run:
    bounds = [*starts, end]
    run = Run(precision=precision)
    for k in range(warmup, len(starts)):
        run.seconds.append(bounds[k + 1] - bounds[k])
        u, t, kl, *seqs = sizes[k]
        run.units.append(u)
        run.tokens.append(t)
        run.kl_tokens.append(kl)
        run.completions.extend(seqs)
    return run


class EndClock:
    """Stands in for tracking.Tracker: the last step's log call marks the end of the run."""

    def __init__(self, last_step: int, device):
        self.last_step, self.device, self.end = last_step, device, None

    def log(self, step: int, metrics: dict) -> None:
        if step == self.last_step:
            self.end = _now(self.device)

    def log_histogram(self, step: int, counts) -> None:
        pass


class StepClock(SourceWrapper):
    """Wraps a run's source: each next_step call marks the start of a step and records its units (an online step's
    from the round: data.generate_every=1 makes a round one step), tokens, KL tokens and sequences; with `policy`,
    the positions its decoder runs on."""

    def __init__(self, source, device, units_per_step: int = 0, policy=None):
        super().__init__(source)
        self.device, self.units_per_step, self.policy = device, units_per_step, policy
        self.starts: list[float] = []
        self.sizes: list[tuple[int, ...]] = []
        self.positions: list[int] = []

    def next_step(self, step: int):
        self.starts.append(_now(self.device))
        data = self.source.next_step(step)
        mbs = data.micro_batches
        online = "online/units" in data.info
        self.sizes.append((data.info["online/units"] if online else self.units_per_step,
                           sum(int(mb.seqs.attention_mask.sum()) for mb in mbs),
                           sum(int(x.attention_mask.sum()) for mb in mbs for x in mb.extra_seqs()),
                           *[sum(mb.seqs.input_ids.shape[0] for mb in mbs)] * online))
        if self.policy is not None:  # the layout is built once per batch and kept for the forwards
            self.positions.append(sum(self.policy.processed_tokens(mb.seqs) for mb in mbs))
        return data


def compose(overrides: list[str], extra=()):
    """The resolved run spec of the train config composed from `overrides` and then `extra`."""
    from humanline_cli.config import compose_train, resolve

    return resolve(compose_train([*overrides, *extra]))


def load_model(spec, device):
    """(policy, model path) as the project's run loads them: the bundled world and a packaged model built first
    if they are not cached."""
    from humanline_cli.models import load_policy
    from humanline_cli.train.build import model_paths, prepare_model, prepare_world

    prepare_world(spec)
    prepare_model(spec)
    model_path, _ = model_paths(spec)
    return load_policy(model_path, device, spec.model_cfg.trust_remote_code), model_path


@contextlib.contextmanager
def built(spec):
    """(parts, timer, run dir) of a run built from `spec` (build_parts: its micro-batch fitted to this machine's
    memory), in a temporary run dir, closed after."""
    from humanline_cli.train.build import build_parts
    from humanline_cli.train.timing import PhaseTimer

    with tempfile.TemporaryDirectory() as tmp:
        timer = PhaseTimer()
        parts = build_parts(spec, timer, Path(tmp))
        try:
            yield parts, timer, Path(tmp)
        finally:
            parts.close()


def train_loop(parts, timer, tracker) -> None:
    """The real loop (trainer.train) over the built parts, its console output dropped."""
    from rich.console import Console

    from humanline_cli.core.humanline import ReferenceRule
    from humanline_cli.train.trainer import train

    spec = parts.spec
    train(spec.train, spec.humanline, parts, objective=spec.objective_cfg,
          rule=ReferenceRule.from_spec(spec.humanline, spec.regime, spec.correction),
          correction=spec.correction, tracker=tracker, timer=timer,
          console=Console(file=io.StringIO()), eval_every=spec.eval_cfg.every)
