"""A run records the code it started on: the commit, whether the checkout was dirty, and the start time, read
before setup and kept across a resume, so a run can be dated against a registration's commit."""
from __future__ import annotations

import json
import subprocess
from datetime import datetime
from pathlib import Path

from humanline_cli.train import provenance
from tests.helpers.cli import FAST, TINY_WORLD, run_in_process

REPO = Path(provenance.__file__).resolve().parents[2]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout


def test_record_start_keeps_the_first_attempt_on_resume_and_replaces_it_on_a_fresh_start(tmp_path):
    first = {"git_commit": "a" * 40, "git_dirty": False, "started_at": "2026-01-01T00:00:00+00:00"}
    second = {"git_commit": "b" * 40, "git_dirty": True, "started_at": "2026-01-02T00:00:00+00:00"}
    assert provenance.record_start(tmp_path, first, fresh=True) == first
    assert provenance.record_start(tmp_path, second, fresh=False) == first  # resumed: the first start stands
    assert json.loads((tmp_path / "started.json").read_text()) == first
    assert provenance.record_start(tmp_path, second, fresh=True) == second  # resume=false: a new run
    assert provenance.read_start(tmp_path) == second
    (tmp_path / "started.json").write_text('{"git_commit": ')  # torn by a crash: this attempt's record instead
    assert provenance.record_start(tmp_path, first, fresh=False) == first
    assert provenance.read_start(tmp_path / "missing") == {}


def test_code_state_reads_this_checkout():
    state = provenance.code_state()
    assert state["git_commit"] == _git("rev-parse", "HEAD").strip()
    assert state["git_dirty"] is bool(_git("status", "--porcelain").strip())
    assert datetime.fromisoformat(state["started_at"]).tzinfo is not None


def test_summary_carries_the_commit_dirty_flag_and_start_read_before_setup(tmp_path, monkeypatch):
    states = iter([{"git_commit": "c" * 40, "git_dirty": True, "started_at": "2026-03-04T05:06:07+00:00"}])
    real = provenance.code_state
    # the first call (the run's start) is the one the summary keeps; later calls read the real checkout
    monkeypatch.setattr(provenance, "code_state", lambda: next(states, None) or real())
    run_dir = tmp_path / "run"
    run_in_process(run_dir, tmp_path, ["task=arithmetic", *TINY_WORLD, *FAST, "objective=grpo", "data=online",
                                       f"world_cache={tmp_path / 'cache'}", "judge=none"])
    s = json.loads((run_dir / "summary.json").read_text())
    assert (s["git_commit"], s["git_dirty"], s["started_at"]) == ("c" * 40, True, "2026-03-04T05:06:07+00:00")
    assert s["git_commit_at_end"] == _git("rev-parse", "HEAD").strip()
    assert json.loads((run_dir / "started.json").read_text())["git_commit"] == "c" * 40
    import torch

    m = s["machine"]  # the CPU kernel set changes float32 results: it is recorded with them
    assert m["cpu_kernels"] == torch.backends.cpu.get_cpu_capability() and m["torch_threads"] == 1
