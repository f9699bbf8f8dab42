"""SIGTERM and Ctrl-C during a job, on every rank.

SIGTERM is what SLURM sends before it preempts a job or at its time limit (`--signal`), and what torch's
elastic agent forwards to every rank when the launching process gets one. During training it only sets
a flag (`StopSignal.requested`); at the next step boundary every rank agrees to stop (one tiny
collective per step under DDP/FSDP, so no rank stops alone), a checkpoint of that step is written
when `train.checkpoint_every > 0`, and the run ends with `Preempted`: one line saying the run can be
resumed by rerunning the same command, exit 143, `failed.json`. Outside the training loop (setup,
final eval, model save) SIGTERM raises `Preempted` at once: there is no step to save.

Ctrl-C raises KeyboardInterrupt as Python does; inside the training loop `StepMarker` turns it into
`Interrupted("at step N")`, so rank 0 can record the step in failed.json for the launching process to
report (no frame is read). The job creates both objects and hands them to the loop.

A rank that ends without Python's exit (os._exit after a failure, SIGTERM's default action when a peer failed)
releases its semaphores first (`release_semaphores`, `die_by_sigterm`).
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading

from humanline_cli.errors import Interrupted, Preempted, ignore_ctrl_c


class StopSignal:
    """`with StopSignal() as stop:` handles SIGTERM in this (main) thread; the previous handler comes
    back on exit. `stop.arm(True)` while the training loop can stop at a step boundary."""

    def __init__(self, peer_failed=None):
        self.peer_failed = peer_failed  # () -> bool: another rank recorded a failure (DDP/FSDP)
        self.requested = False
        self.armed = False
        self._old = None

    def _handler(self, signum, frame) -> None:
        if self.peer_failed is not None and self.peer_failed():
            # torch's agent stops the other ranks with SIGTERM when one fails: that is no preemption, die
            # as SIGTERM's default would (no checkpoint wait; the failing rank's record names the cause)
            die_by_sigterm()
            return
        self.requested = True
        if not self.armed:
            raise Preempted("stopped by SIGTERM outside training (nothing to checkpoint); rerun the same command "
                            "(it resumes from the last checkpoint, or starts over where none was written)")

    def arm(self, on: bool) -> None:
        self.armed = on

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)
            self._old = None


class StepMarker:
    """The step in flight: the loop sets `at.step = step` at the top of each step inside `with at:`, and a
    Ctrl-C there becomes `Interrupted("at step N")`, which carries the step to whoever reports it. The
    job owns the marker and reads it after a failure: under DDP, Ctrl-C can reach this rank just after a
    peer's exit broke the step's collective, i.e. while the loop's error unwinds, outside the `with`;
    the step is still the one in flight (`unwinding`)."""

    def __init__(self):
        self.step: int | None = None
        self.unwinding = False

    def __enter__(self) -> StepMarker:
        self.unwinding = False
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:  # a second Ctrl-C (the agent forwards one) can land while this one unwinds
            self.unwinding = True
        if exc_type is KeyboardInterrupt:
            ignore_ctrl_c()
            if self.step is not None:
                raise Interrupted(f"at step {self.step}") from exc
        return False


def interrupted_where(e: BaseException, trained: bool = False, at: StepMarker | None = None) -> str:
    """Where a KeyboardInterrupt landed: the step it carries (StepMarker), the step of a loop that was
    unwinding from an error when it landed (`at`), else after or before training."""
    seen = e
    while seen is not None:  # a second Ctrl-C raised while the first (carrying its step) was unwinding
        if isinstance(seen, Interrupted):
            return seen.where
        seen = seen.__context__
    if not trained and at is not None and at.unwinding and at.step is not None:
        return f"at step {at.step}"
    return "after training" if trained else "before training"


def release_semaphores() -> None:
    """Before a rank ends without Python's exit (os._exit, or SIGTERM's default action): run
    multiprocessing's non-negative-priority exit finalizers, the first stage of its own atexit hook
    (util._exit_function), which close this rank's queues and unlink their named semaphores (the sampler
    process's, data.async_lag); children are neither terminated nor joined here. Without it the launcher's
    resource tracker prints a 'leaked semaphore objects' warning after the job's one error line. Never raises."""
    with contextlib.suppress(Exception):
        from multiprocessing import util

        util._run_finalizers(0)


def die_by_sigterm() -> None:
    """End this rank as SIGTERM's default action would (killed by the signal), after releasing its semaphores:
    a rank the agent stops because a peer failed is no preemption (the failing rank's record names the cause)."""
    release_semaphores()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
