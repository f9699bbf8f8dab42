"""The run dir's lock names the job holding it, even when that job took the lock a moment ago."""
from __future__ import annotations

import fcntl
import os
import threading

import pytest

from humanline_cli.errors import RunDirBusy
from humanline_cli.train.lock import LOCK, RunDirLock


def _held_empty(run_dir):
    """A lock file another job has just flocked but not yet written its `pid host` into."""
    run_dir.mkdir()
    fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def test_a_holder_that_writes_its_pid_a_moment_late_is_named(tmp_path):
    fd = _held_empty(tmp_path / "run")
    late = threading.Timer(0.1, lambda: os.pwrite(fd, b"4242 otherhost\n", 0))
    late.start()
    try:
        with pytest.raises(RunDirBusy) as e:
            RunDirLock(tmp_path / "run").acquire()
    finally:
        late.join()
        os.close(fd)
    assert str(e.value) == (f"{tmp_path / 'run'} is in use by another job (pid 4242 on otherhost, lock "
                            f"{tmp_path / 'run' / LOCK}); wait for it to end or choose another hydra.run.dir")


def test_a_holder_that_never_writes_its_pid_is_not_named_pid_question_mark(tmp_path):
    fd = _held_empty(tmp_path / "run")
    try:
        with pytest.raises(RunDirBusy) as e:
            RunDirLock(tmp_path / "run").acquire()
    finally:
        os.close(fd)
    assert str(e.value) == (f"{tmp_path / 'run'} is in use by another job (it has not written its pid yet, lock "
                            f"{tmp_path / 'run' / LOCK}); wait for it to end or choose another hydra.run.dir")


def test_the_holder_rewrites_a_longer_stale_line_without_a_tail(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / LOCK).write_text("99999999 a-much-longer-previous-hostname.example\n")
    with RunDirLock(tmp_path / "run") as lock:
        assert (tmp_path / "run" / LOCK).read_text() == f"{os.getpid()} {os.uname().nodename}\n"
        assert lock.stale.startswith("pid 99999999 on a-much-longer-previous-hostname.example")
