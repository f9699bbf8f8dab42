"""Fault injection for tests that need a fault inside another process (a rank, a sampler process).

Python imports `sitecustomize` at start-up from the first folder on sys.path that holds one: a test puts
this folder on PYTHONPATH (tests/conftest.py `fault_env`), and every process of the run it starts (the CLI,
each rank torch's launcher spawns, each sampler process) patches the package here, before any of its code
runs. The package itself has no fault hook. Inert unless one of these is set:

  HL_FAULT=rank:step:kind          on that rank, as step `step` starts (when the source is asked for it):
                                   user | run | bug raise UserError / RunFailed / RuntimeError; hang freezes
                                   (a rank that stops answering); kill SIGKILLs the rank; nan makes that
                                   step's loss NaN
  HL_SAMPLER_FAULT=kind@round[:rank]  in the sampler process (data.async_lag), when round `round` is asked
                                   for: kill (SIGKILL, after the rounds already sampled reached the parent),
                                   hang, raise (the sampler reports an error); `:rank` only that rank's
"""
from __future__ import annotations

import os
import signal
import time


def _rank_fault(spec: str) -> None:
    rank, step, kind = spec.split(":")
    step = int(step)

    def mine() -> bool:  # asked at fault time: torch's launcher sets RANK in a rank after it starts
        return int(os.environ.get("RANK", "0")) == int(rank)
    import humanline_cli.train.build as build
    import humanline_cli.train.trainer as trainer
    from humanline_cli.errors import RunFailed, UserError

    now = {"step": 0}

    def at_step(n: int) -> None:
        now["step"] = n
        if n != step or not mine():
            return
        msg = f"injected fault on this rank at step {n}"
        match kind:
            case "user":
                raise UserError(msg)
            case "run":
                raise RunFailed(msg)
            case "bug":
                raise RuntimeError(msg)
            case "hang":
                while True:
                    time.sleep(60)
            case "kill":  # kill -9 of this rank: no Python cleanup, no record (a lost machine, the OOM killer)
                os.kill(os.getpid(), signal.SIGKILL)

    real_build = build.build_parts

    def build_parts(*args, **kwargs):
        parts = real_build(*args, **kwargs)
        next_step = parts.source.next_step

        def faulty_next_step(n, *a, **kw):
            at_step(n)
            return next_step(n, *a, **kw)

        parts.source.next_step = faulty_next_step
        return parts

    build.build_parts = build_parts
    if kind == "nan":
        real_loss = trainer.compute_loss

        def compute_loss(*args, **kwargs):
            loss, metrics = real_loss(*args, **kwargs)
            return (loss * float("nan") if now["step"] == step and mine() else loss), metrics

        trainer.compute_loss = compute_loss


def _sampler_fault(spec: str) -> None:
    what, _, rank = spec.partition(":")
    kind, _, key = what.partition("@")
    import humanline_cli.sampling.rounds_worker as worker

    real_child = worker._child

    def _child(child_spec, requests, results):
        if not rank or int(rank) == child_spec.rank:
            real_get = requests.get

            def get(*args, **kwargs):
                msg = real_get(*args, **kwargs)
                if msg is None or str(msg[0]) != key:
                    return msg
                if kind == "kill":
                    results.close()
                    results.join_thread()  # the rounds already sampled reach the parent first
                    os.kill(os.getpid(), signal.SIGKILL)
                while kind == "hang":
                    time.sleep(1.0)  # alive and silent: the parent's timeout must end the run
                results.put(("error", msg[0], f"RuntimeError: injected sampler fault at round {msg[0]}"))
                return None  # the sampler stops, as after an error of its own
            requests.get = get
        return real_child(child_spec, requests, results)

    # the sampler process is spawned with `_child` as its target, pickled by name: the name must lead to
    # this function, in the parent and in the child (which runs this file at its own start-up)
    _child.__module__, _child.__qualname__ = worker.__name__, "_child"
    worker._child = _child


if os.environ.get("HL_FAULT"):
    _rank_fault(os.environ["HL_FAULT"])
if os.environ.get("HL_SAMPLER_FAULT"):
    _sampler_fault(os.environ["HL_SAMPLER_FAULT"])
