"""Faults: a run-dir lock, checkpoints that prove themselves, signals, full disks, bad numbers blamed on
their source, degenerate online rounds. Through the real CLI where the promise
is about the CLI (one line, exit code, files left), in-process where a piece can be checked alone."""
from __future__ import annotations

import errno
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from humanline_cli.errors import RunDirBusy
from humanline_cli.train.lock import RunDirLock
from tests.helpers.cli import BASE, run_cli


def _error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("humanline: error:")]


def _wait_for_rows(proc: subprocess.Popen, metrics: Path, n: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before {n} metrics rows"
        try:
            if metrics.read_text().count("\n") >= n:
                return
        except OSError:
            pass
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"no {n} metrics rows within {timeout} s")


# ---- 1. the run-dir lock ------------------------------------------------------------------------------

def test_lock_names_a_live_holder_and_takes_over_a_dead_ones(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from humanline_cli.train.lock import RunDirLock\n"
        f"lock = RunDirLock({str(tmp_path)!r}).acquire(); print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirBusy) as e:
            RunDirLock(tmp_path).acquire()
        assert f"pid {holder.pid} on {socket.gethostname()}" in str(e.value)
        assert (tmp_path / ".lock").read_text() == f"{holder.pid} {socket.gethostname()}\n"  # refused: untouched
    finally:
        holder.kill()  # kill -9: no clean release; the kernel drops the flock with the process
        holder.wait()
    assert (tmp_path / ".lock").read_text().startswith(str(holder.pid))  # a stale file of a dead pid
    with RunDirLock(tmp_path) as lock:
        assert lock.stale == f"pid {holder.pid} on {socket.gethostname()}"
        assert (tmp_path / ".lock").read_text() == f"{os.getpid()} {socket.gethostname()}\n"
    assert (tmp_path / ".lock").read_text() == ""  # released cleanly: nothing left to call stale
    with RunDirLock(tmp_path) as lock:
        assert lock.stale is None


def _tree(root: Path) -> dict:
    """Every file under `root`: its bytes and mtime (the lock file included: a refused job must not touch it)."""
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(root.rglob("*"))
            if p.is_file()}


def _hold_lock(run: Path) -> subprocess.Popen:
    """A process holding `run`'s lock, as a live job does from its first second (before anything else)."""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import time; from humanline_cli.train.lock import RunDirLock\n"
        f"lock = RunDirLock({str(run)!r}).acquire(); print('held', flush=True); time.sleep(120)")],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_refused_job_changes_no_byte_of_the_live_run_dir(cache_dir, tmp_path):
    """A second job with another lr into a run dir whose job holds the lock: exit 2 in one line, and the
    live run's dir keeps every byte and mtime: .hydra/config.yaml still says the first job's lr (the report
    groups runs by it), train.log, the lock file. The holder stands for a live job at any moment of its
    life, its first seconds included (when Hydra used to have rewritten .hydra/ before the lock refused)."""
    run = tmp_path / "run"
    args = ["train", *BASE, "train.steps=2", "train.save_model=false", "judge=none", f"hydra.run.dir={run}"]
    first = run_cli(args, tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    (run / "train.log").write_text("the live job's log\n")
    holder = _hold_lock(run)
    try:
        before = _tree(run)
        assert {".hydra/config.yaml", ".hydra/overrides.yaml", ".hydra/hydra.yaml", "resolved_config.json",
                ".lock"} <= set(before)
        time.sleep(0.01)  # an mtime any rewrite would change
        second = run_cli([*args, "train.lr=2e-5"], tmp_path, timeout=180)
    finally:
        holder.kill()
        holder.wait()
    lines = [ln for ln in second.stderr.splitlines() if ln.strip()]
    assert second.returncode == 2 and len(lines) == 1 and "is in use by another job" in lines[0], second.stderr[-2000:]
    after = _tree(run)
    assert after.keys() == before.keys()  # no file added (no .hydra of the refused job, no log)
    assert after == before, [k for k in before if after[k] != before[k]]
    assert "lr: 0.001" in (run / ".hydra" / "config.yaml").read_text()


def test_a_refused_sweep_job_changes_no_byte_of_the_live_run_dir(cache_dir, tmp_path):
    """Two sweeps into one hydra.sweep.dir: the second's job 0 lands in the first's job 0 dir while that job
    holds it. It is refused (named in the sweep's last line, exit 2), its other job runs, and the live job's
    dir keeps every byte and mtime."""
    sweep = tmp_path / "sweep"
    base = ["train", "-m", *BASE, "train.steps=2", "train.save_model=false", "judge=none",
            f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=job${hydra.job.num}"]
    first = run_cli([*base, "train.lr=1e-3"], tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    live = sweep / "job0"
    holder = _hold_lock(live)
    try:
        before = _tree(live)
        time.sleep(0.01)
        second = run_cli([*base, "train.lr=2e-5,3e-5"], tmp_path, timeout=300)
    finally:
        holder.kill()
        holder.wait()
    assert second.returncode == 2, second.stderr[-2000:]
    assert f"sweep job job0 failed: {live} is in use by another job" in second.stderr
    assert _error_lines(second.stderr)[-1].startswith("humanline: error: 1 of 2 sweep jobs failed")
    assert _tree(live) == before
    assert "lr: 3.0e-05" in (sweep / "job1" / ".hydra" / "config.yaml").read_text()  # the other job ran
    assert json.loads((sweep / "job1" / "summary.json").read_text())["status"] == "complete"


def test_two_concurrent_jobs_on_one_run_dir(cache_dir, tmp_path):
    """The same command twice at once: the second stops in one line naming the first (exit 2) and
    touches nothing; the first goes on alone (one metrics row per step, then Ctrl-C ends it)."""
    run = tmp_path / "run"
    args = ["train", *BASE, "train.steps=100000", "train.checkpoint_every=5", "train.save_model=false",
            f"hydra.run.dir={run}"]
    first = subprocess.Popen([sys.executable, "-m", "humanline_cli", *args], cwd=tmp_path,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             # SIGINT as a foreground job has it (a background shell leaves it ignored)
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    _wait_for_rows(first, run / "metrics.jsonl", 2)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()  # what the live job does not rewrite
              and "checkpoints" not in p.parts and p.suffix not in (".log", ".jsonl")}
    assert {p.name for p in before} >= {".lock", "config.yaml", "resolved_config.json"}
    second = run_cli(args, tmp_path, timeout=180)  # without a lock it would train on: a timeout is a failure
    assert first.poll() is None, "the first job ended before the second started: nothing was tested"
    lines = [ln for ln in second.stderr.splitlines() if ln.strip()]
    assert second.returncode == 2 and len(lines) == 1, second.stderr[-2000:]
    assert lines[0].startswith(f"humanline: error: {run} is in use by another job (pid {first.pid} on "
                               f"{socket.gethostname()}"), lines[0]
    assert {p: p.read_bytes() for p in before} == before  # .hydra and the lock untouched
    first.send_signal(signal.SIGINT)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 130, err[-3000:]
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1))  # one writer: no step twice


# ---- 2. checkpoints that prove themselves -------------------------------------------------------------

def _truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _empty(f: Path) -> None:
    f.write_bytes(b"")


def _zero_4k(f: Path) -> None:  # 4 KB zeroed inside the tensors: still a valid safetensors file
    data = bytearray(f.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 4096] = bytes(4096)
    f.write_bytes(bytes(data))


def _flip_bit(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[len(data) - 7] ^= 0x01
    f.write_bytes(bytes(data))


DAMAGE = {"truncated": (_truncate, "does not match its sha256"), "emptied": (_empty, "is empty"),
          "zeroed-4k": (_zero_4k, "does not match its sha256"), "bit-flipped": (_flip_bit, "does not match its sha256")}


@pytest.fixture(scope="module")
def three_checkpoints(tmp_path_factory):
    """A 6-step run with checkpoints at steps 2, 4, 6 (written once; each test copies it)."""
    import torch

    from tests.helpers.training import offline_parts, run_train, train_spec

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared machine
    run = tmp_path_factory.mktemp("ckpt") / "run"
    run_train(run, offline_parts(lora=False, moving=True), train_spec(6, True, every=2, keep=3))
    torch.set_num_threads(threads)
    return run


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("victim", ["tensors.safetensors", "state.json"])
def test_a_damaged_checkpoint_falls_back_to_the_newest_intact_one(three_checkpoints, tmp_path, damage, victim):
    import shutil

    from humanline_cli.train import checkpoint as C
    from humanline_cli.train import rundir as R

    run = tmp_path / "run"
    shutil.copytree(three_checkpoints, run)
    (run / R.RESOLVED).write_text(json.dumps({"seed": 0}))  # the config its checkpoints (which record none) ran
    ckpts = C.Checkpoints(run, 2)
    assert ckpts.steps() == [2, 4, 6] and all(C.verify(ckpts.root / f"step_{s}") is None for s in (2, 4, 6))
    hurt, reason = DAMAGE[damage]
    hurt(ckpts.root / "step_6" / victim)
    with pytest.raises(Exception) as e:  # never loaded silently, even past prepare_run_dir
        C.Checkpoints(run, 2).load(ckpts.root / "step_6", None, None, None, None)
    assert f"checkpoint {ckpts.root / 'step_6'} is damaged ({victim}" in str(e.value)
    said = []
    step = R.prepare_run_dir(run, {"seed": 0}, resume=True, say=said.append)
    assert step == 4 and ckpts.steps() == [2, 4] and (ckpts.root / "damaged-step_6" / victim).exists()
    assert len(said) == 1 and said[0].startswith(f"checkpoint(s) skipped as damaged: step_6: {victim}")
    assert reason in said[0] and "resuming from step_4 instead" in said[0], said
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]  # rewound to the checkpoint actually used


def test_nothing_intact_starts_over_and_says_so(three_checkpoints, tmp_path):
    import shutil

    from humanline_cli.train import checkpoint as C
    from humanline_cli.train import rundir as R

    run = tmp_path / "run"
    shutil.copytree(three_checkpoints, run)
    root = run / "checkpoints"
    _flip_bit(root / "step_6" / "tensors.safetensors")
    _empty(root / "step_4" / "state.json")
    (root / "step_2" / C.CHECKSUMS).unlink()  # as a checkpoint of an older humanline would be
    said = []
    assert R.prepare_run_dir(run, {"seed": 0}, resume=True, say=said.append) == 0
    size = (root / "damaged-step_6" / "tensors.safetensors").stat().st_size
    assert len(said) == 1 and said[0] == (
        f"no intact checkpoint in {root} (step_6: tensors.safetensors ({size} "
        f"bytes) does not match its sha256 (truncated or altered); step_4: state.json is empty; step_2: no "
        f"checksums.json (unfinished, or written by an older humanline)); starting over from step 0 (the damaged "
        f"ones are kept as checkpoints/damaged-step_<N>)")
    assert C.Checkpoints(run, 2).latest() is None and (run / "metrics.jsonl").read_text() == ""


# ---- 3. signals: SIGTERM (SLURM preemption) and Ctrl-C, one process and 2 gloo ranks -----------------

def _long_run(tmp_path: Path, extra: list[str]) -> tuple[subprocess.Popen, Path]:
    run = tmp_path / "run"
    args = ["train", *BASE, "train.steps=100000", "train.checkpoint_every=1000", "train.save_model=false",
            "backend=cpu", f"hydra.run.dir={run}", *extra]
    proc = subprocess.Popen([sys.executable, "-m", "humanline_cli", *args], cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # its own process group
    _wait_for_rows(proc, run / "metrics.jsonl", 3)
    return proc, run


def _humanline_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("humanline:") and not ln.startswith("humanline train")
            and not ln.startswith("humanline: note")]


@pytest.mark.parametrize("ranks", [1, 2])
def test_sigterm_checkpoints_at_the_step_boundary_and_says_resume(cache_dir, tmp_path, ranks):
    """SIGTERM to the job's process group (what SLURM does): the step in flight finishes, a checkpoint of
    it is written (checkpoint_every=1000 is not due), one line says a rerun resumes, exit 143."""
    from humanline_cli.train import checkpoint as C

    proc, run = _long_run(tmp_path, ["backend.strategy=ddp", "backend.nproc=2"] if ranks == 2 else [])
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "Traceback" not in err, err[-3000:]
    lines = _humanline_lines(err)
    assert len(lines) == 1, err[-3000:]
    m = re.fullmatch(r"humanline: stopped by SIGTERM after step (\d+) of 100000; checkpoint checkpoints/step_\1 "
                     r"written: rerun the same command to resume \(failed\.json written\)", lines[0])
    assert m, lines[0]
    step = int(m[1])
    ckpts = C.Checkpoints(run, 1000)
    assert ckpts.steps() == [step] and C.verify(ckpts.latest()) is None
    assert C.read_state(ckpts.latest())["step"] == step and C.read_state(ckpts.latest())["world_size"] == ranks
    logged = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, step + 1))  # the checkpoint's step is the last one done
    failed = json.loads((run / "failed.json").read_text())
    assert failed["status"] == "failed" and failed["error"].startswith("Preempted: ")
    assert not list((run / "checkpoints").glob(".tmp-*")) and not (run / "summary.json").exists()


def test_ctrl_c_under_ddp_is_exit_130_with_the_step(cache_dir, tmp_path):
    """Ctrl-C in a terminal signals the whole foreground process group: the launcher and both ranks."""
    proc, run = _long_run(tmp_path, ["backend.strategy=ddp", "backend.nproc=2"])
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    lines = _humanline_lines(err)
    assert len(lines) == 1, err[-3000:]
    m = re.fullmatch(r"humanline: interrupted at step (\d+) \(failed\.json written\)", lines[0])
    assert m, lines[0]
    logged = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1] <= int(m[1]) <= logged[-1] + 1
    failed = json.loads((run / "failed.json").read_text())
    assert failed["error"].startswith("KeyboardInterrupt") and failed["interrupted"] == f"at step {m[1]}"


# ---- 4. a full disk anywhere: one line naming the path, no temp files, failed.json if a byte fits ------

def _enospc(*a, **k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_full_disk_at_summary_and_failed_json(tmp_path, monkeypatch):
    from humanline_cli import atomic
    from humanline_cli.errors import RunFailed
    from humanline_cli.train import failures

    real_write_text = Path.write_text
    full = {"summary.json.tmp", "failed.json.tmp"}  # the temp files of atomic writes cannot be written
    monkeypatch.setattr(Path, "write_text",
                        lambda self, *a, **k: _enospc() if self.name in full else real_write_text(self, *a, **k))
    with pytest.raises(RunFailed) as e:
        atomic.write_json_atomic(tmp_path / "summary.json", {"status": "complete"})
    assert str(e.value) == f"cannot write {tmp_path / 'summary.json'}: No space left on device"
    # the full record does not fit, a short one does (written in place)
    note = failures.write_failed(tmp_path, {"status": "failed", "error": "RunFailed: x" * 100})
    assert note == "failed.json shortened (No space left on device)"
    assert json.loads((tmp_path / "failed.json").read_text()) == {"status": "failed", "error": ("RunFailed: x" * 100)[:200]}
    # not one byte fits: nothing is left, and the note says so
    monkeypatch.setattr("builtins.open", lambda path, mode="r", *a, **k: _enospc())
    (tmp_path / "failed.json").unlink()
    assert failures.write_failed(tmp_path, {"status": "failed"}) == (
        "failed.json could not be written (No space left on device)")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no summary.json.tmp, no failed.json(.tmp)


def test_full_disk_at_metrics_names_the_file(tmp_path):
    from humanline_cli.errors import RunFailed
    from humanline_cli.train.tracking import Tracker

    tracker = Tracker(tmp_path, {}, {"mode": "disabled"}, "t")
    tracker.log(1, {"loss": 0.5})
    tracker._f = SimpleNamespace(write=_enospc, flush=_enospc, close=_enospc)  # the disk fills up
    with pytest.raises(RunFailed) as e:
        tracker.log(2, {"loss": 0.4})
    assert str(e.value) == f"cannot write {tmp_path / 'metrics.jsonl'}: No space left on device"
    with pytest.raises(RunFailed) as e:
        _hist_full(tracker)
    assert str(e.value) == f"cannot write {tmp_path / 'logratios.jsonl'}: No space left on device"
    tracker.finish(1)  # closing the full file does not raise over the error being reported


def _hist_full(tracker):
    import builtins

    real = builtins.open
    builtins.open = lambda *a, **k: _enospc()
    try:
        tracker.log_histogram(2, [0] * 62)
    finally:
        builtins.open = real


def test_safetensors_full_disk_at_model_save_is_one_line(tmp_path):
    from safetensors import SafetensorError

    from humanline_cli.backend import Dist
    from humanline_cli.errors import RunFailed
    from humanline_cli.train.finish import save_model

    class Policy:
        def save_pretrained(self, path, **kwargs):
            Path(path).mkdir(parents=True)
            (Path(path) / "model.safetensors").write_bytes(b"half")
            raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    dest = tmp_path / "model"
    with pytest.raises(RunFailed) as e:
        save_model(SimpleNamespace(dist=Dist(), policy=Policy(), tokenizer=None), dest)
    assert str(e.value).startswith(f"cannot save the model to {dest}: Error while serializing")
    assert list(tmp_path.iterdir()) == []  # no model.tmp


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (the writers above are covered without)")
def test_a_real_full_disk_through_the_cli(cache_dir, tmp_path):
    """A 1 MB tmpfs: the 3.4 MB checkpoint does not fit (a warning naming it, training goes on), then the
    model save does not fit: one error line naming the model dir, exit 2, no temp dirs, failed.json."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)]).returncode != 0:
        pytest.skip("this root cannot mount a tmpfs (no CAP_SYS_ADMIN)")
    try:
        run = disk / "run"
        r = run_cli(["train", *BASE, "train.steps=2", "train.checkpoint_every=1", "eval.n_prompts=4",
                     f"hydra.run.dir={run}"], tmp_path)
        errors = _error_lines(r.stderr)
        assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert errors[0].startswith(f"humanline: error: run failed ({run}): cannot save the model to {run / 'model'}: ")
        assert "No space left on device" in errors[0] or "StorageFull" in errors[0], errors[0]
        warned = [ln for ln in r.stderr.splitlines() if "humanline: warning: checkpoint at step 1 not written to" in ln]
        assert len(warned) == 1, r.stderr[-3000:]
        left = sorted(str(p.relative_to(run)) for p in run.rglob("*") if ".tmp" in p.name or p.name.endswith(".old"))
        assert left == [] and not (run / "model").exists()
        assert json.loads((run / "failed.json").read_text())["status"] == "failed"
    finally:
        subprocess.run(["umount", str(disk)])


# ---- 5. bad numbers blamed on their source ------------------------------------------------------------

def test_huge_rewards_are_refused_at_their_line(tmp_path):
    from humanline_cli.data.examples import to_units
    from humanline_cli.data.files import load_rows
    from humanline_cli.errors import UserError

    row = {"prompt": "1+1=", "completions": ["2", "3", "4"], "rewards": [1.0, 0.0, 0.5]}
    bad = {**row, "rewards": [1.7e308, 1.7e308, 0]}  # finite, but the group's variance overflows to inf
    path = tmp_path / "g.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (row, row, bad, row)))
    rows, where = load_rows(str(path))
    with pytest.raises(UserError) as e:
        to_units(rows, where, "grpo")
    assert str(e.value) == (f"{path}:3: field 'rewards' is 1.7e+308, outside the sane range [-1e+06, 1e+06] "
                            f"(rescale the scores)")
    pairs = tmp_path / "p.jsonl"
    pairs.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c", "score_chosen": -2e6,
                                 "score_rejected": 0}) + "\n")
    with pytest.raises(UserError) as e:
        to_units(*load_rows(str(pairs)), "dpo")
    assert str(e.value).startswith(f"{pairs}:1: field 'score_chosen' is -2000000.0, outside the sane range")
    assert len(to_units(*load_rows(str(path), limit=2), "grpo")) == 2  # in range: accepted


def test_a_non_finite_loss_names_its_micro_batch_units(tmp_path):
    import torch

    from humanline_cli.core.humanline import ReferenceRule
    from humanline_cli.errors import RunFailed
    from humanline_cli.train.timing import PhaseTimer
    from humanline_cli.train.tracking import NullTracker
    from humanline_cli.train.trainer import train
    from tests.helpers.training import offline_parts, train_spec

    parts = offline_parts(lora=False, moving=False)
    seen = []
    real = parts.source.next_step

    def watch(step):
        data = real(step)
        seen.append(data)
        if step == 2:  # the step's only micro-batch gives a NaN loss
            with torch.no_grad():
                parts.policy.lm_head.weight.fill_(float("nan"))
        return data

    parts.source.next_step = watch
    with pytest.raises(RunFailed) as e:
        spec = train_spec(4, False, every=0)
        train(spec.train, spec.humanline, parts, objective=spec.objective_cfg,
              rule=ReferenceRule.from_spec(spec.humanline, spec.regime), tracker=NullTracker(), timer=PhaseTimer())
    units = seen[-1].micro_batches[0].units
    assert len(seen) == 2 and len(units) == 2
    assert str(e.value) == (f"loss is nan at step 2, micro-batch 1 of 1, units: prompt {units[0].prompt!r}; "
                            f"prompt {units[1].prompt!r} (check their scores, or try a lower train.lr)")


# ---- 6. degenerate online rounds do not pass as success ------------------------------------------------

def _tied_online_run(tmp_path, steps: int, max_skipped: float):
    import dataclasses

    from humanline_cli.core.humanline import ReferenceRule
    from humanline_cli.train.timing import PhaseTimer
    from humanline_cli.train.tracking import Tracker
    from humanline_cli.train.trainer import train
    from tests.helpers.training import offline_parts, online_source, train_spec

    parts = offline_parts(lora=False, moving=False)
    # a real online source whose labeller gives every sample the same score: DPO finds no pair in any round
    parts.source = online_source("dpo", ["1", "22", "333"],
                                 lambda prompts, completions, answers=None: [0.5] * len(completions))
    spec = train_spec(steps, False, every=0)
    spec.train = dataclasses.replace(spec.train, max_skipped_fraction=max_skipped)
    out = io.StringIO()
    console = Console(file=out, width=400)
    tracker = Tracker(tmp_path, {}, {"mode": "disabled"}, "t")
    try:
        last = train(spec.train, spec.humanline, parts, objective=spec.objective_cfg,
                     rule=ReferenceRule.from_spec(spec.humanline, spec.regime), tracker=tracker, timer=PhaseTimer(),
                     console=console)
    finally:
        tracker.finish()
    return last, [ln for ln in out.getvalue().splitlines() if ln.startswith("humanline")]


def test_every_score_tied_fails_the_run_once_too_many_steps_are_skipped(tmp_path):
    from humanline_cli.errors import RunFailed

    with pytest.raises(RunFailed) as e:
        _tied_online_run(tmp_path, steps=10, max_skipped=0.5)
    assert str(e.value) == ("6 of 10 steps skipped by step 6 (online rounds with no usable pair/example: every score "
                            "tied, or gaps below the data's min_gap), more than train.max_skipped_fraction=0.5 of the run")
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["skipped"], r["skipped_steps"], r["online/skipped_round"]) for r in rows] == [
        (s, 1.0, s, 1) for s in range(1, 7)]  # counted and logged, each round's own row
    assert all(r["online/dropped_prompts"] == 2 for r in rows)


def test_skipped_steps_within_the_allowance_are_counted_not_fatal(tmp_path):
    last, printed = _tied_online_run(tmp_path, steps=3, max_skipped=1.0)
    assert last == {"skipped_steps": 3}  # what summary.json's final_train_metrics reports
    assert len(printed) == 1 and printed[0].startswith("humanline: warning: step 1 skipped: its round gave no usable")


# ---- 7. smaller: the batch-size rule, long path components, the prefix ---------------------------------

@pytest.mark.parametrize("overrides,message", [
    (["train.batch_size=33", "train.micro_batch_size=3", "backend.strategy=ddp", "backend.nproc=2"],
     "train.batch_size (33) must be a multiple of backend.nproc x train.micro_batch_size = 2 x 3 = 6 (each rank "
     "trains batch_size / nproc units per step, in micro-batches of micro_batch_size)"),
    (["train.batch_size=32", "train.micro_batch_size=3"],
     "train.batch_size (32) must be a positive multiple of train.micro_batch_size (3)"),
    (["train.max_skipped_fraction=1.5"], "config key 'train.max_skipped_fraction' must be in [0, 1], got 1.5"),
    # under auto there is no micro-batch of the user's to name (not "2 x 15 = 30")
    (["train.batch_size=31", "backend.strategy=ddp", "backend.nproc=2"],
     "train.batch_size (31) must be a multiple of backend.nproc (2): each rank trains batch_size / nproc units per "
     "step"),
])
def test_config_rules_name_the_real_rule(overrides, message):
    from hydra import compose, initialize_config_module

    from humanline_cli.config import resolve
    from humanline_cli.errors import UserError

    with initialize_config_module(config_module="conf", version_base="1.3"), pytest.raises(UserError) as e:
        resolve(compose("train", overrides=overrides))
    assert str(e.value) == message


@pytest.mark.parametrize("backend", [[], ["backend.strategy=ddp", "backend.nproc=2"]])
def test_a_micro_batch_above_the_share_is_one_rule_for_one_process_and_ddp(backend):
    """A micro-batch larger than the units a rank trains per step is lowered to that share with a note, in one
    process as under DDP (the update does not depend on the split)."""
    from humanline_cli.config import compose_train, resolve

    ranks = 2 if backend else 1
    spec = resolve(compose_train(["train.batch_size=8", "train.micro_batch_size=16", *backend]))
    share = 8 // ranks
    assert spec.train.micro_batch_size == share and spec.train.accumulation == 1
    each = "each of 2 ranks trains" if backend else "the run trains"
    assert f"train.micro_batch_size=16 > the {share} units {each} per step: micro-batches of {share}" in spec.notes


def test_long_path_component_and_unquoted_unicode_are_one_line(tmp_path):
    long = tmp_path / ("a" * 300)
    r = run_cli(["train", f"hydra.run.dir={long}"], tmp_path, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"humanline: error: cannot write the run dir {long}: File name too long (set hydra.run.dir=...)"], r.stderr
    r = run_cli(["train", f"hydra.run.dir={tmp_path}/é"], tmp_path, timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(
        f"humanline: error: LexerNoViableAltException: hydra.run.dir={tmp_path}/é"), r.stderr
    assert lines[0].endswith("quote a value with spaces or non-ASCII characters: key='\"value\"'")
    assert not os.path.exists(long) and not (tmp_path / "é").exists()  # Path.exists raises: name too long


@pytest.mark.parametrize("error", [
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried "
                 "to allocate 1073741824 bytes.\nError code 12 (Cannot allocate memory)"),  # torch's words
    MemoryError(),
])
def test_out_of_memory_is_one_line_and_failed_json(tmp_path, monkeypatch, error):
    from hydra import compose, initialize_config_module

    from humanline_cli.config import resolve
    from humanline_cli.errors import RunFailed
    from humanline_cli.train import failures
    from humanline_cli.train import job as J

    def build_parts(*a, **k):
        raise error

    monkeypatch.setattr(J, "build_parts", build_parts)
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose("train", overrides=["wandb.mode=disabled"])
    with pytest.raises(RunFailed) as e:
        J.run_rank(resolve(cfg), J.Context(tmp_path / "run", tmp_path))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"out of memory ({type(error).__name__}") and msg.endswith(
        "lower train.micro_batch_size, or turn on train.gradient_checkpointing or LoRA, or use more ranks")
    assert json.loads((tmp_path / "run" / "failed.json").read_text())["error"] == f"RunFailed: {msg}"
    assert failures.out_of_memory(ValueError("out of memory")) is None  # only memory errors


def test_checksums_cover_fsdp_shards(tmp_path):
    """An FSDP2 checkpoint keeps the model and AdamW in shards/ (one file per rank): those files are
    summed too, so a damaged, missing or added shard is never loaded silently."""
    from humanline_cli.train import checkpoint as C

    ck = tmp_path / "step_4"
    (ck / "shards").mkdir(parents=True)
    for name, data in [("tensors.safetensors", b"t" * 64), ("state.json", b"{}"), ("shards/__0_0.distcp", b"a" * 64),
                       ("shards/__1_0.distcp", b"b" * 64), ("shards/.metadata", b"m" * 16)]:
        (ck / name).write_bytes(data)
    (ck / C.CHECKSUMS).write_text(json.dumps(C.checksums(ck)))
    assert C.verify(ck) is None
    (ck / "shards/__1_0.distcp").write_bytes(b"b" * 63 + b"c")  # one byte altered
    assert C.verify(ck) == "shards/__1_0.distcp (64 bytes) does not match its sha256 (truncated or altered)"
    (ck / "shards/__1_0.distcp").unlink()
    assert C.verify(ck) == "shards/__1_0.distcp is missing"



def test_sigterm_while_importing_ends_with_one_line(tmp_path):
    """SIGTERM before any command's own handler is in place (torch, transformers and Hydra still loading: seconds)
    ends as SIGTERM's default would, exit 143, with one line instead of none."""
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", "humanline_cli", "train", f"hydra.run.dir={tmp_path / 'run'}"],
                            cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    time.sleep(1.5)  # past the interpreter's start, well within the imports
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 143
    assert err == "humanline: stopped by SIGTERM outside training (nothing to checkpoint); rerun the same command\n"
    assert not (tmp_path / "run").exists()
