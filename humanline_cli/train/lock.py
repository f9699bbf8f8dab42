"""One job per run dir: an OS file lock (`fcntl.flock` on `<run_dir>/.lock`) held for the whole job.

Taken once, by the process that owns the run dir (the CLI process: it runs the job itself, or starts the
ranks and waits for them), before the run dir is checked, rewound or written, and released on any exit:
the kernel drops a flock when its holder's last descriptor closes, so a killed process (kill -9, OOM)
leaves no stale lock, only a stale `.lock` file whose pid is dead, which the next job takes over (and
says so). The file holds the holder's `pid host` so a refused job can name it. The descriptor is
close-on-exec (Python's default), so ranks, samplers and judges started by the holder do not inherit it.

A second job on a busy run dir stops with RunDirBusy (a UserError: one line, exit 2) and writes nothing.
On a file system without flock support (some NFS mounts) the lock cannot be taken: the job says so and
refuses, rather than run unprotected (`HUMANLINE_NO_RUN_LOCK=1` skips the lock, at the user's risk).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import time
from pathlib import Path

from humanline_cli.errors import RunDirBusy

LOCK = ".lock"


def _holder(text: str) -> tuple[int | None, str]:
    parts = text.split()
    pid = int(parts[0]) if parts and parts[0].isdigit() else None
    return pid, parts[1] if len(parts) > 1 else "?"


def _alive(pid: int | None, host: str) -> bool | None:
    """Whether `pid` on `host` still runs (None: another host, cannot tell from here)."""
    if pid is None:
        return False
    if host != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _holder_text(fd: int, tries: int = 20, wait_s: float = 0.025) -> str:
    """The busy lock file's `pid host`: a holder that has just taken the flock writes it a moment later, so an
    empty (or the previous holder's half-overwritten) file is read again for up to tries x wait_s."""

    for _ in range(tries):
        text = os.pread(fd, 256, 0).decode(errors="replace")
        if _holder(text)[0] is not None and text.endswith("\n"):
            return text
        time.sleep(wait_s)
    return text


class RunDirLock:
    """`with RunDirLock(run_dir) as lock:` holds the run dir for the job; `lock.stale` names a dead
    holder whose `.lock` file was taken over (None when the file was fresh)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK
        self.fd: int | None = None
        self.stale: str | None = None

    def acquire(self) -> RunDirLock:
        if os.environ.get("HUMANLINE_NO_RUN_LOCK") == "1":
            return self
        # opened without truncating: a refused job must not erase the holder's pid
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            busy = e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
            text = _holder_text(fd) if busy else ""
            os.close(fd)
            if busy:
                pid, host = _holder(text)
                holder = f"pid {pid} on {host}" if pid else "it has not written its pid yet"
                raise RunDirBusy(f"{self.path.parent} is in use by another job ({holder}, lock {self.path}); wait "
                                 f"for it to end or choose another hydra.run.dir") from None
            raise RunDirBusy(f"cannot lock {self.path}: {e.strerror} (a file system without flock? "
                             f"HUMANLINE_NO_RUN_LOCK=1 runs without the lock)") from None
        old = os.pread(fd, 256, 0).decode(errors="replace")
        if old.strip():
            pid, host = _holder(old)
            # the flock was free, so its holder is gone (or on another host sharing the file system
            # without working flock, which the message lets the user judge)
            self.stale = f"pid {pid} on {host}" + (" (still running?)" if _alive(pid, host) else "")
        mine = f"{os.getpid()} {socket.gethostname()}\n".encode()
        os.pwrite(fd, mine, 0)  # then cut the old tail: the file is never empty while held
        os.ftruncate(fd, len(mine))
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)  # a clean exit leaves no holder to report as stale
        os.close(self.fd)  # closing drops the flock
        self.fd = None

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
