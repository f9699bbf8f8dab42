"""`humanline bench async_rounds=N`: online training rounds per second, synchronous (data.async_lag=0: sample,
label, train one after the other) against asynchronous (data.async_lag=1: the sampler in its own process,
sampling round r+1 while round r trains), and the bound an overlap could reach, max(sample, train) per round.

Each round is one optimizer step (data.generate_every=1). Round 1 is not timed (the sampler process starts
and the first round has nothing to overlap with); rounds 2..N are, from the start of round 2's data fetch
to the end of round N's step. The bound comes from the synchronous run's own phases over the same rounds:
sample + label + push per round against train + sync per round. The user's overrides (objective=kto,
threads=1, data.n=..., task=...) apply to both runs.
"""
from __future__ import annotations

import io
import tempfile
from pathlib import Path

from humanline_cli.bench.clock import EndClock, _now
from humanline_cli.errors import UserError

SAMPLE_PHASES = ("sample", "label", "push")
TRAIN_PHASES = ("train", "sync")


def _spec(overrides: list[str], rounds: int, lag: int):
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from humanline_cli.config import compose_error, validate

    user = [o for o in overrides if o.split("=")[0] not in ("data", "data.async_lag")]
    mine = ["data=online", f"data.async_lag={lag}", "data.generate_every=1", f"train.steps={rounds}",
            "train.log_every=1000000", "train.save_model=false", "train.checkpoint_every=0", "eval.every=0",
            "eval.n_prompts=1"]
    try:
        with initialize_config_module(config_module="conf", version_base="1.3"):
            cfg = compose("train", overrides=[*user, *mine])
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        raise UserError(compose_error(e)) from None
    return validate(cfg)


class _RoundClock:
    """Wraps the online source: the start of each step's data fetch and the phase seconds then."""

    def __init__(self, source, timer, device):
        self.source, self.timer, self.device = source, timer, device
        self.starts: list[float] = []
        self.phases: list[dict] = []

    def next_step(self, step: int):
        self.starts.append(_now(self.device))
        self.phases.append(dict(self.timer.seconds))
        return self.source.next_step(step)

    def __getattr__(self, name):
        return getattr(self.source, name)


def _run(spec) -> dict:
    from rich.console import Console

    from humanline_cli.train.build import build_parts
    from humanline_cli.train.timing import PhaseTimer
    from humanline_cli.train.trainer import train

    with tempfile.TemporaryDirectory() as tmp:
        timer = PhaseTimer()
        parts = build_parts(spec, timer, Path(tmp))
        try:
            device = parts.backend.device
            parts.source = clock = _RoundClock(parts.source, timer, device)
            tracker = EndClock(spec.train.steps, device)
            train(spec, parts, tracker, timer, Console(file=io.StringIO()))
            end = dict(timer.seconds)
        finally:
            parts.close()
    timed = spec.train.steps - 1
    seconds = tracker.end - clock.starts[1]
    delta = {k: end.get(k, 0.0) - clock.phases[1].get(k, 0.0) for k in end}
    return {"rounds_timed": timed, "seconds": seconds, "round_s": seconds / timed, "rounds_per_s": timed / seconds,
            "phase_s_per_round": {k: v / timed for k, v in sorted(delta.items()) if v}}


def async_bench(overrides: list[str], rounds: int, console) -> dict:
    if rounds < 3:
        raise UserError("bench: async_rounds must be >= 3 (round 1 is not timed)")
    specs = [_spec(overrides, rounds, lag) for lag in (0, 1)]  # both validated before any work
    out: dict = {"objective": specs[0].objective, "task": specs[0].task, "threads": specs[0].threads,
                 "rounds": rounds}
    for lag, spec in enumerate(specs):
        console.print(f"[dim]bench async: data.async_lag={lag}, {rounds} rounds[/]")
        out[f"lag{lag}"] = _run(spec)
    per = out["lag0"]["phase_s_per_round"]
    sample = sum(per.get(k, 0.0) for k in SAMPLE_PHASES)
    train = sum(per.get(k, 0.0) for k in TRAIN_PHASES)
    bound = max(sample, train)
    out.update(sample_s_per_round=sample, train_s_per_round=train, bound_round_s=bound,
               lag1_over_bound=out["lag1"]["round_s"] / bound, speedup=out["lag0"]["round_s"] / out["lag1"]["round_s"])
    return out


def print_async(res: dict, console) -> None:
    from rich.table import Table

    t = Table(title=f"humanline bench async: {res['objective']} on {res['task']}, {res['threads']} training "
                    f"thread(s) + the sampler process's, rounds 2..{res['rounds']} timed (a round = one step)")
    for col in ("data.async_lag", "s/round", "rounds/s", "sample s/round", "train s/round", "wait s/round"):
        t.add_column(col, justify="left" if col == "data.async_lag" else "right")
    for lag in (0, 1):
        r = res[f"lag{lag}"]
        per = r["phase_s_per_round"]
        t.add_row(f"lag {lag}", f"{r['round_s']:.3f}", f"{r['rounds_per_s']:.3f}",
                  f"{sum(per.get(k, 0.0) for k in SAMPLE_PHASES):.3f}",
                  f"{sum(per.get(k, 0.0) for k in TRAIN_PHASES):.3f}", f"{per.get('wait_for_sample', 0.0):.3f}")
    t.add_row("bound", f"{res['bound_round_s']:.3f}", f"{1 / res['bound_round_s']:.3f}", "", "", "")
    console.print(t)
    console.print(f"lag 1 / bound: {res['lag1_over_bound']:.3f}x; lag 0 / lag 1 (speed-up): {res['speedup']:.3f}x")
