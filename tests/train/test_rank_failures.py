"""No hangs, no lost causes: a failure on ONE rank of a 2-rank gloo job ends every rank promptly, with
that rank's own one-line message in the console and in failed.json (exit 2 for a run that cannot go
on, 1 for a bug); a frozen rank ends the job after backend.timeout_s. The fault is injected on rank 1
by the tests' fault plugin (tests/faults/sitecustomize.py, HL_FAULT=rank:step:kind)."""
from __future__ import annotations

import json
import time

import pytest

from humanline_cli.train import failures
from tests.helpers.cli import FAST, TINY_WORLD, run_cli


def _fsdp_run(tmp_path, name: str, env: dict, extra=()):
    out = tmp_path / name
    t0 = time.monotonic()
    r = run_cli(["train", *TINY_WORLD, *FAST, "backend=cpu", "objective=dpo", "backend.strategy=fsdp",
                 "backend.nproc=2", f"hydra.run.dir={out}", *extra], tmp_path,
                env_extra=env, timeout=300)
    return r, out, time.monotonic() - t0


@pytest.mark.parametrize("kind,code,msg", [
    # rank 1's loss is NaN, rank 0's is not: the NaN check is agreed by both ranks (else rank 0 would
    # wait in the gradient reduce); the message is rank 1's, not "another rank's" nor gloo's
    ("nan", 2, "rank 1: loss is nan at step 2, micro-batch 1 of "),  # then its units
    # a bug on rank 1: exit 1 (Hydra's traceback path), its own message, not rank 0's "Connection closed"
    ("bug", 1, "rank 1: injected fault on this rank at step 2"),
])
def test_failure_on_rank_1_ends_the_job_with_its_message(tmp_path, cache_dir, fault_env, kind, code, msg):
    # backend.timeout_s=600 > run_cli's 300 s limit: the job can only end in time through the failure path
    # (the failing rank exits, the agent stops the other), never through a collective's timeout
    r, out, wall = _fsdp_run(tmp_path, kind, fault_env(rank=f"1:2:{kind}"), ["backend.timeout_s=600"])
    assert r.returncode == code, r.stderr[-3000:]
    assert msg in r.stderr
    assert "Connection closed by peer" not in r.stderr.splitlines()[-1]
    failed = json.loads((out / "failed.json").read_text())
    assert failed["rank"] == 1 and msg in failed["error"], failed
    assert failed["wall_clock_s"]["train"] > 0  # rank 1's own timers
    assert not (out / "summary.json").exists()
    assert not (out / failures.FAILURES).exists()  # the per-rank records are cleaned up


def test_a_frozen_rank_ends_the_job_after_backend_timeout_s(tmp_path, cache_dir, fault_env):
    """Rank 1 stops answering at step 2; rank 0's next collective fails after timeout_s=20 s, the
    agent stops rank 1, and the message says which timeout fired (exit 2, failed.json). (20 s, not
    less: on a busy CI machine one rank's setup can legitimately run seconds ahead of the other's.)"""
    r, out, wall = _fsdp_run(tmp_path, "hang", fault_env(rank="1:2:hang"), ["backend.timeout_s=20"])
    assert r.returncode == 2, r.stderr[-3000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("humanline: error: run failed") and "backend.timeout_s=20 s" in line, line
    failed = json.loads((out / "failed.json").read_text())
    assert failed["rank"] == 0 and "backend.timeout_s=20 s" in failed["error"]
    assert wall < 150, wall


def test_root_cause_prefers_the_rank_that_failed_over_ranks_that_saw_it_go(tmp_path, monkeypatch):
    """rank 0 recorded first but only a transport error (secondary); rank 1's NaN is the cause. With
    only secondary records, the earliest is reported."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job1")
    clock = iter([100.0, 101.0, 102.0])
    monkeypatch.setattr(failures.time, "time", lambda: next(clock))
    failures.record(tmp_path, 0, RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:713"))
    failures.record(tmp_path, 1, failures.RunFailed("loss is nan at step 2"))
    failures.record(tmp_path, 2, failures.PeerFailed("another rank's loss is not finite at step 2"))
    rec = failures.root_cause(tmp_path)
    assert (rec["rank"], rec["kind"], rec["message"]) == (1, "run", "loss is nan at step 2")
    assert failures.failed_json(rec)["error"] == "RunFailed: rank 1: loss is nan at step 2"
    assert isinstance(failures.as_exception(rec), failures.RunFailed)
    (failures.failures_dir(tmp_path) / "rank1.json").unlink()
    rec = failures.root_cause(tmp_path)
    assert (rec["rank"], rec["secondary"]) == (0, True)
    assert isinstance(failures.as_exception(rec), failures.RunFailed)  # a dead peer: the run failed, exit 2
    failures.clear(tmp_path)
    assert failures.root_cause(tmp_path) is None and not (tmp_path / failures.FAILURES).exists()
    assert failures.kind_of(failures.UserError("x")) == "user" and failures.kind_of(KeyError("x")) == "bug"


def test_bad_timeout_is_one_line(tmp_path, cache_dir):
    r = run_cli(["train", *TINY_WORLD, *FAST, "backend=cpu", "backend.timeout_s=0", f"hydra.run.dir={tmp_path / 'x'}"],
                tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == \
        "humanline: error: config key 'backend.timeout_s' must be > 0 seconds, got 0.0"


def test_a_rank_that_died_without_a_record_is_named(tmp_path, monkeypatch):
    """kill -9 leaves no record; when torch's ChildFailedError only saw a survivor exit, the rank with
    no record among those that recorded a transport error is the one named."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job2")
    failures.record(tmp_path, 0, RuntimeError("Connection closed by peer [127.0.0.1]:713"))

    class Seen:  # torch's ProcessFailure as the agent saw rank 0: a normal exit with code 2
        exitcode = 2

        def signal_name(self):
            return "<N/A>"

    rec = failures.killed(type("E", (), {"failures": {0: Seen()}})(), tmp_path, "job2", 2)
    assert rec["rank"] == 1 and rec["message"].startswith("ended without a word (kill -9")

    class Killed(Seen):
        exitcode = -9

        def signal_name(self):
            return "SIGKILL"

    rec = failures.killed(type("E", (), {"failures": {1: Killed()}})(), tmp_path, "job2", 2)
    assert rec["rank"] == 1 and rec["message"].startswith("killed by SIGKILL without a word")
    # what a rerun does, as this run dir stands: no checkpoint yet, then the newest one
    assert rec["message"].endswith("; rerun the same command to start over (no checkpoint was written)")
    for step in (4, 12):
        (tmp_path / "checkpoints" / f"step_{step}").mkdir(parents=True)
    (tmp_path / "checkpoints" / "damaged-step_16").mkdir()
    rec = failures.killed(type("E", (), {"failures": {1: Killed()}})(), tmp_path, "job2", 2)
    assert rec["message"].endswith("; rerun the same command to resume from checkpoints/step_12")
