"""How a failure ends a `humanline train` job: the one table from an exception to (exit code, one line)
(`outcome`), failed.json (its one writer, its records, reading it back), an out-of-memory error as one line, and the
protocol below for a distributed job.

When one rank of a distributed job fails, every rank ends and the job reports THAT rank's message.

Why a file per rank: a rank that raises never reaches the other ranks' collectives, so they learn
about it only as a transport error (gloo: "Connection closed by peer"; NCCL: a collective that waits
until the process-group timeout). The failing rank therefore writes its own one-line cause here
(`<run_dir>/.failures/<job id>/rank<N>.json`) BEFORE it exits, then leaves with os._exit (no
destroy_process_group, which can itself wait on peers); torch's elastic agent sees a non-zero exit
and stops the other ranks (SIGTERM, SIGKILL after 30 s). Whoever reports the job (the launching
process, or rank 0 under an external torchrun) picks the root cause: the earliest record that is not
a consequence of another rank's death (a transport error or a collective timeout), else the earliest.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from humanline_cli.atomic import write_json_atomic
from humanline_cli.errors import Interrupted, PeerFailed, Preempted, RankCrashed, RunFailed, UserError, one_line
from humanline_cli.train.signals import interrupted_where

FAILURES = ".failures"
EXIT = {"user": 2, "run": 2, "bug": 1}  # the CLI's codes: bad input / a run that cannot go on -> 2, a bug -> 1
# substrings of torch.distributed errors that only say a PEER went away or stopped answering
SECONDARY = ("connection closed by peer", "connection reset by peer", "timed out", "timeout", "broken pipe",
             "nccl communicator was aborted", "process group watchdog")


def job_id() -> str:
    """The id every rank of this job shares: torch's elastic run id (our launcher's uuid, torchrun's)."""
    return os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT", "job")


def failures_dir(run_dir: Path, job: str | None = None) -> Path:
    return Path(run_dir) / FAILURES / (job or job_id())


def kind_of(e: BaseException) -> str:
    """user (bad input), run (cannot go on: NaN, a peer that died or froze) or bug."""
    if isinstance(e, UserError):
        return "user"
    return "run" if isinstance(e, RunFailed) or is_secondary(e) else "bug"


def is_secondary(e: BaseException) -> bool:
    """A torch.distributed error that reports another rank's death or silence, not a cause of its own."""
    try:
        from torch.distributed import DistError
    except ImportError:  # pragma: no cover - torch without distributed
        DistError = ()  # noqa: N806
    if isinstance(e, Preempted):  # SIGTERM: the agent's after another rank failed, or SLURM's to every rank
        return True
    text = str(e).lower()
    return isinstance(e, (DistError, PeerFailed)) or (isinstance(e, RuntimeError) and any(s in text for s in SECONDARY))


def record(run_dir: Path, rank: int, e: BaseException, wall_clock_s: dict | None = None,
           timeout_s: float | None = None) -> None:
    """Write this rank's failure (atomically: a reader never sees half a record). Never raises: a
    failure to record must not hide the failure itself."""
    kind, msg = kind_of(e), one_line(e)
    secondary = is_secondary(e)
    timed_out = secondary and any(s in msg.lower() for s in ("timed out", "timeout"))
    if timed_out and timeout_s is not None:
        msg = (f"a collective waited longer than backend.timeout_s={timeout_s:g} s (another rank is frozen or "
               f"died): {msg}")
    rec = {"rank": rank, "kind": kind, "type": type(e).__name__, "message": msg, "secondary": secondary,
           "timeout": timed_out, "time": time.time(), "wall_clock_s": wall_clock_s or {}}
    if kind == "bug":
        rec["traceback"] = "".join(traceback.format_exception(e))[-4000:]
    _write(failures_dir(run_dir) / f"rank{rank}.json", rec)


def record_interrupt(run_dir: Path, rank: int, where: str) -> None:
    """This rank got Ctrl-C (`where`: "at step N", ...). A rank the others' exit reaches first sees only a
    peer gone; this record lets rank 0 still report the interruption. Never raises."""
    _write(failures_dir(run_dir) / f"interrupted{rank}.json", {"rank": rank, "interrupted": where})


def _write(path: Path, rec: dict) -> None:
    """A record, atomically (a reader never sees half of one); never raises."""
    with contextlib.suppress(OSError, RunFailed):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, rec)


def interrupted(run_dir: Path, job: str | None = None) -> str | None:
    """Where Ctrl-C landed, as the lowest rank that recorded it says; None when no rank did. `job`: the
    launching process's run id (it has no TORCHELASTIC_RUN_ID of its own; the ranks do)."""
    d = failures_dir(run_dir, job)
    for p in sorted(d.glob("interrupted*.json")) if d.is_dir() else []:
        try:
            return json.loads(p.read_text())["interrupted"]
        except (OSError, ValueError, KeyError):
            continue
    return None


def root_cause(run_dir: Path, job: str | None = None) -> dict | None:
    """The record to report: the earliest primary failure, else the earliest of all; None if none."""
    d = failures_dir(run_dir, job)
    recs = []
    for p in sorted(d.glob("rank*.json")) if d.is_dir() else []:
        try:
            recs.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    if not recs:
        return None
    primary = [r for r in recs if not r.get("secondary")]
    return min(primary or recs, key=lambda r: r["time"])


def rerun_hint(run_dir: Path) -> str:
    """What rerunning the command does for this run dir: resume from its newest checkpoint, or start over."""
    ckpts = Path(run_dir) / "checkpoints"
    steps = sorted(int(p.name[5:]) for p in ckpts.glob("step_*") if p.name[5:].isdigit()) if ckpts.is_dir() else []
    if steps:
        return f"rerun the same command to resume from checkpoints/step_{steps[-1]}"
    return "rerun the same command to start over (no checkpoint was written)"


def killed(child_failed, run_dir: Path, job: str, world: int) -> dict | None:
    """A record for a rank that died without writing one (kill -9, the OOM killer, a lost machine),
    when the others only saw it go: the rank torch's ChildFailedError saw die by a signal other than
    the agent's own SIGTERM, else the ranks with no record (the agent reports only the first exit it
    polls, which may be a survivor's)."""
    what = f"without a word (kill -9, out of host memory, a lost machine); {rerun_hint(run_dir)}"
    for rank, f in sorted(getattr(child_failed, "failures", {}).items()):
        if f.exitcode < 0 and f.signal_name() not in ("SIGTERM", "SIGINT"):
            return _silent(rank, f"killed by {f.signal_name()} {what}")
    d = failures_dir(run_dir, job)
    recorded = {int(p.stem.removeprefix("rank")) for p in d.glob("rank*.json")} if d.is_dir() else set()
    silent = [r for r in range(world) if r not in recorded]
    if recorded and silent:
        return _silent(silent[0], f"ended {what}" if len(silent) == 1 else
                       f"ended {what} (so did ranks {', '.join(map(str, silent[1:]))})")
    return None


def _silent(rank: int, message: str) -> dict:
    return {"rank": rank, "kind": "run", "type": "RunFailed", "secondary": False, "time": 0.0, "message": message,
            "wall_clock_s": {}}


def clear(run_dir: Path, job: str | None = None) -> None:
    shutil.rmtree(failures_dir(run_dir, job), ignore_errors=True)
    with contextlib.suppress(OSError):
        (Path(run_dir) / FAILURES).rmdir()  # only when no other job's records are left


FAILED_JSON = "failed.json"


def write_failed(run_dir: Path, obj: dict) -> str | None:
    """The one writer of <run_dir>/failed.json: a rank's own failure, and the launching process's correction once
    the ranks ended (another rank's root cause, or the step a Ctrl-C landed in). Nothing when the run dir does not
    exist (the job failed before making it). Whatever the disk allows: the full record; else (a full disk) as short
    a record as fits, written in place; else nothing. Returns None when the full record was written (or there is
    no run dir), else a note for the error line saying what happened. Never raises: the failure being recorded
    comes first."""
    path = Path(run_dir) / FAILED_JSON
    if not path.parent.is_dir():
        return None
    try:
        write_json_atomic(path, obj)
        return None
    except RunFailed as e:
        why = str(e.__cause__.strerror if isinstance(e.__cause__, OSError) and e.__cause__.strerror else e)
    short = json.dumps({"status": "failed", "error": str(obj.get("error", ""))[:200]})
    for text in (short, '{"status":"failed"}'):
        try:
            with open(path, "w") as f:
                f.write(text)
            return f"failed.json shortened ({why})"
        except OSError:
            with contextlib.suppress(OSError):
                path.unlink()
    return f"failed.json could not be written ({why})"


def failed_json(rec: dict) -> dict:
    """failed.json's content for a rank's record (the same keys a one-process failure writes, plus rank)."""
    return {"status": "failed", "error": f"{rec['type']}: rank {rec['rank']}: {rec['message']}", "rank": rec["rank"],
            "wall_clock_s": rec.get("wall_clock_s", {})}


def interrupted_json(where: str, wall_clock_s: dict | None = None) -> dict:
    """failed.json's content for a job a Ctrl-C ended: `where` is the step it landed in ("at step 4")."""
    return {"status": "failed", "error": "KeyboardInterrupt", "interrupted": where,
            **({"wall_clock_s": wall_clock_s} if wall_clock_s is not None else {})}


def as_exception(rec: dict) -> BaseException:
    """The exception the launching process raises for a rank's record (the CLI maps it to exit 2 or 1)."""
    msg = f"rank {rec['rank']}: {rec['message']}"
    if rec["type"] == "Preempted":  # every rank stopped on SIGTERM at the same step: not one rank's failure
        return Preempted(rec["message"])
    if rec["kind"] == "user":
        return UserError(msg)
    if rec["kind"] == "run":
        return RunFailed(msg)
    return RankCrashed(f"{msg} (rank {rec['rank']}'s traceback is above)")


# ------------------------------------------------------------------ the one table
@dataclass(frozen=True)
class Outcome:
    """How a job ended: the process's exit code and what to say (None: nothing more); `error`: the message
    is an error (printed after "humanline: error: "; a sweep names the job and goes on)."""

    code: int
    message: str | None = None
    error: bool = False

    @property
    def line(self) -> str | None:
        if self.message is None:
            return None
        return f"humanline: error: {self.message}" if self.error else f"humanline: {self.message}"


def outcome(e: BaseException, run_dir: Path | None) -> Outcome | None:
    """How exception `e` ends the job: exit code and line. None for a bug (its traceback, exit 1).

    | exception                         | exit | line                                        |
    | KeyboardInterrupt (Interrupted)   | 130  | interrupted at step N / before / after training |
    | Preempted (SIGTERM)               | 143  | stopped by SIGTERM ...; rerun to resume     |
    | UserError (bad input, busy dir)   | 2    | error: <the problem>                        |
    | RunFailed, OSError (NaN, disk)    | 2    | error: run failed (<run dir>): <cause>      |
    | anything else                     | 1    | Python's traceback                          |
    A line ends with "(failed.json written)" where the rank recorded the failure."""
    failed = read_failed(run_dir)
    note = " (failed.json written)" if failed is not None else ""
    if isinstance(e, KeyboardInterrupt):
        # under DDP/FSDP the step is rank 0's (it recorded it in failed.json); in one process, the exception's
        where = (failed or {}).get("interrupted") or (e.where if isinstance(e, Interrupted) else None) \
            or interrupted_where(e)
        return Outcome(130, f"interrupted {where}{note}")
    if isinstance(e, Preempted):  # SIGTERM (SLURM): the whole process is going away, a sweep included
        return Outcome(143, f"{e}{note}")
    if isinstance(e, UserError):
        return Outcome(EXIT["user"], str(e), error=True)
    if isinstance(e, (RunFailed, OSError)):
        return Outcome(EXIT["run"], f"run failed ({run_dir}): {one_line(e)}", error=True)
    return None


def failure_record(e: BaseException, wall_clock_s: dict, where: str | None = None) -> dict:
    """failed.json for a job `e` ended (`where`: the step a Ctrl-C landed in)."""
    if where is not None:
        return interrupted_json(where, wall_clock_s)
    return {"status": "failed", "error": f"{type(e).__name__}: {e}", "wall_clock_s": wall_clock_s}


def read_failed(run_dir: Path | None) -> dict | None:
    """<run_dir>/failed.json as a rank wrote it; None where there is none (or it cannot be read)."""
    try:
        return json.loads((Path(run_dir) / FAILED_JSON).read_text()) if run_dir is not None else None
    except (OSError, ValueError):
        return None


def out_of_memory(e: BaseException) -> RunFailed | None:
    """Out of memory (host RAM under a ulimit or cgroup, or a GPU's) as one RunFailed line, else None."""
    import torch

    oom_types = tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                                  getattr(torch.cuda, "OutOfMemoryError", None)) if t is not None)
    text = one_line(e) if str(e).strip() else ""
    if not (isinstance(e, (MemoryError, *oom_types)) or (
            isinstance(e, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower()))):
        return None
    text = text if len(text) <= 160 else text[:157] + "..."
    return RunFailed(f"out of memory ({type(e).__name__}{': ' + text if text else ''}): lower "
                     f"train.micro_batch_size, or turn on train.gradient_checkpointing or LoRA, or use more ranks")
