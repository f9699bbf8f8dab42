"""UserError: a mistake the user can fix (bad config, bad data). The CLI prints it as one line, exit 2."""
import sys


class UserError(Exception):
    """Raised for bad input; the message must name the problem (and file:line for data)."""


class RunFailed(Exception):
    """Raised when a run cannot continue (NaN loss, sampler timeout); the run dir is marked incomplete."""


class Preempted(RunFailed):
    """SIGTERM (SLURM preemption or time limit) stopped the run at a step boundary, after a checkpoint
    when checkpointing is configured; the CLI prints one line and exits 143 (128 + SIGTERM)."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, carrying where it landed (`at step N`, `after training`), so the CLI reports it from the
    exception itself. A KeyboardInterrupt and still caught as one."""

    def __init__(self, where: str):
        super().__init__(where)
        self.where = where


def cannot_write(path, e: BaseException) -> RunFailed:
    """A failed write (a full disk, a quota, a read-only mount) as one line naming the file."""
    return RunFailed(f"cannot write {path}: {getattr(e, 'strerror', None) or e}")


def fail(msg: str, code: int = 2):
    """The CLI's way out for a mistake the user can fix: one stderr line with the prefix, exit 2."""
    print(f"humanline: error: {msg}", file=sys.stderr)
    sys.exit(code)
