"""The one table of train/failures.py: how each exception ends a `humanline train` job (exit code, line), and the
failed.json record a rank writes for it. In-process, no training."""
from __future__ import annotations

import json

from humanline_cli.errors import Interrupted, Preempted, RunDirBusy, RunFailed, UserError
from humanline_cli.train.failures import Outcome, failure_record, outcome


def test_each_exception_has_one_exit_code_and_one_line(tmp_path):
    assert outcome(KeyboardInterrupt(), tmp_path) == Outcome(130, "interrupted before training")
    assert outcome(Interrupted("at step 3"), tmp_path).line == "humanline: interrupted at step 3"
    assert outcome(Preempted("stopped by SIGTERM after step 2 of 9; rerun"), tmp_path) == \
        Outcome(143, "stopped by SIGTERM after step 2 of 9; rerun")
    busy = outcome(RunDirBusy(f"{tmp_path} is in use by another job"), tmp_path)
    assert busy == Outcome(2, f"{tmp_path} is in use by another job", error=True)
    assert busy.line == f"humanline: error: {tmp_path} is in use by another job"
    assert outcome(RunFailed("loss is nan\n  at step 2"), tmp_path).message == \
        f"run failed ({tmp_path}): loss is nan at step 2"
    assert outcome(OSError(28, "No space left on device"), tmp_path).message == \
        f"run failed ({tmp_path}): [Errno 28] No space left on device"
    assert outcome(UserError("bad"), tmp_path).code == 2
    assert outcome(ValueError("a bug"), tmp_path) is None  # its traceback, exit 1


def test_the_line_says_failed_json_was_written_and_where_a_rank_was_interrupted(tmp_path):
    (tmp_path / "failed.json").write_text(json.dumps(failure_record(KeyboardInterrupt(), {"total": 1.0}, "at step 5")))
    assert outcome(KeyboardInterrupt(), tmp_path).line == "humanline: interrupted at step 5 (failed.json written)"
    assert outcome(Preempted("stopped"), tmp_path).line == "humanline: stopped (failed.json written)"
    assert failure_record(RunFailed("x"), {"total": 2.0}) == {"status": "failed", "error": "RunFailed: x",
                                                              "wall_clock_s": {"total": 2.0}}
