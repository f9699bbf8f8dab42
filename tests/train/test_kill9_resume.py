"""Kill -9 and rerun == never stopped, through the real CLI: a run killed with SIGKILL at a random step
and rerun with the same command ends with the same eval numbers, metrics rows, samples and model bytes
as an uninterrupted run (offline and online, with and without humanline)."""
from __future__ import annotations

import json
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.cli import BASE, ONLINE, run_cli, spawn_cli
from tests.helpers.runs import run_outputs


def _kill_at(proc: subprocess.Popen, run: Path, step: int, timeout: float = 300) -> None:
    """SIGKILL once metrics.jsonl has a row for `step` (a checkpoint exists by then)."""
    deadline = time.time() + timeout
    metrics = run / "metrics.jsonl"
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (rc {proc.returncode}) before step {step}")
        try:
            steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines() if x.endswith("}")]
        except (OSError, ValueError):
            steps = []
        if steps and max(steps) >= step:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return
        time.sleep(0.005)
    proc.kill()
    raise AssertionError(f"step {step} never came")


def _kill_trial(tmp_path: Path, extra: list[str], kills: int = 1, steps: int = 12, every: int = 2,
                choices: list[int] | None = None):
    args = ["train", *BASE, *extra, f"train.steps={steps}", f"train.checkpoint_every={every}"]
    straight_dir, cut_dir = tmp_path / "straight", tmp_path / "cut"
    straight = spawn_cli([*args, f"hydra.run.dir={straight_dir}"], tmp_path / "straight.log")  # alongside
    kill_steps = sorted(random.sample(choices or range(every + 1, steps), kills))
    for k in kill_steps:
        _kill_at(spawn_cli([*args, f"hydra.run.dir={cut_dir}"], tmp_path / "cut.log"), cut_dir, k)
        assert not (cut_dir / "summary.json").exists(), f"killed too late (step {k})"
    final = run_cli([*args, f"hydra.run.dir={cut_dir}"], tmp_path)
    assert final.returncode == 0, final.stderr[-3000:]
    assert straight.wait(timeout=300) == 0, (tmp_path / "straight.log").read_text()[-3000:]
    resumed = [ln for ln in final.stderr.splitlines() if "resuming" in ln]
    assert len(resumed) == 1, final.stderr[-3000:]
    from_step = int(resumed[0].split("from step ")[1].split()[0])
    assert from_step % every == 0 and 0 < from_step <= kill_steps[-1], (resumed, kill_steps)
    a, b = run_outputs(straight_dir), run_outputs(cut_dir)
    where = f"(killed at step(s) {kill_steps}, resumed from {from_step})"
    assert b["metrics.jsonl"][-1] == a["metrics.jsonl"][-1], where
    assert b["eval"] == a["eval"], where
    assert b == a, where  # every row, histogram, sample and weight
    assert json.loads((cut_dir / "summary.json").read_text())["resumed_from_step"] == from_step
    return a


def test_kill9_offline_resumes_exactly(cache_dir, tmp_path):
    a = _kill_trial(tmp_path, ["objective=dpo"])
    assert a["eval"]["reward_mean"] > 0.0 and a["eval"]["win_rate"] != 0.5  # a non-trivial comparison


def test_kill9_offline_humanline_twice_with_mid_run_eval(cache_dir, tmp_path):
    a = _kill_trial(tmp_path, ["objective=kto", "+humanline=true", "eval.every=5"], kills=2)
    assert [r["step"] for r in a["metrics.jsonl"] if "eval/win_rate" in r] == [5, 10]


@pytest.mark.slow
def test_kill9_online_resumes_exactly(cache_dir, tmp_path):
    # rounds of 2 steps, checkpoints every 3: killed just after step 3 or 9, it resumes in mid-round
    a = _kill_trial(tmp_path, ["objective=grpo", *ONLINE], every=3, choices=[4, 10])
    assert a["samples.jsonl"].count("\n") == 6 * 8 * 4


@pytest.mark.slow
def test_kill9_online_humanline_resumes_exactly(cache_dir, tmp_path):
    _kill_trial(tmp_path, ["objective=dpo", "+humanline=true", *ONLINE], every=3, choices=[4, 5, 7, 8, 10, 11])
