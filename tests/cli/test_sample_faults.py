"""`humanline sample` under bad conditions: a dir it did not make, out= naming a file, a read-only file system,
a full disk, SIGTERM and Ctrl-C. Each ends in one line (exit 2, or 143 / 130 saying a rerun resumes), never a
traceback, and never touches a stranger's files; a rerun of the same command resumes what was sampled."""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from humanline_cli.cli.sample import main_sample
from tests.helpers.cli import TINY_WORLD

ARGS = [*TINY_WORLD, "data.n=4", "data.limit=20", "threads=1"]


def _lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("humanline")]


def test_a_dir_it_did_not_make_is_refused_untouched(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "groups.jsonl").write_text('{"my": "own data"}\n')
    assert main_sample([*ARGS, f"out={out}"]) == 2
    assert _lines(capsys.readouterr().err) == [
        f"humanline: error: out={out} is not empty and was not made by humanline sample (no sampling.json); use a "
        f"new or empty out=DIR"]
    assert sorted(p.name for p in out.iterdir()) == ["groups.jsonl"]
    assert (out / "groups.jsonl").read_text() == '{"my": "own data"}\n'


def test_out_naming_a_file_is_one_line(tmp_path, capsys):
    out = tmp_path / "file.jsonl"
    out.write_text("x\n")
    assert main_sample([*ARGS, f"out={out}"]) == 2
    assert _lines(capsys.readouterr().err) == [f"humanline: error: out={out} is a file, not a directory; use another "
                                               f"out=DIR"]
    assert out.read_text() == "x\n"


def test_a_read_only_file_system_is_one_line(tmp_path, capsys, monkeypatch):
    def read_only(self, *a, **k):  # what mkdir meets on a read-only mount (root ignores chmod, so it is injected)
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    out = tmp_path / "ro" / "out"
    assert main_sample([*ARGS, f"out={out}"]) == 2
    assert _lines(capsys.readouterr().err) == [f"humanline: error: cannot create out={out}: Read-only file system"]


def test_a_full_disk_is_one_line_naming_the_file_and_a_rerun_resumes(cache_dir, tmp_path, capsys, monkeypatch,
                                                                       one_thread):
    import builtins

    out = tmp_path / "out"
    groups = out / "groups.jsonl"
    real_open, appends = builtins.open, []

    def filling_disk(file, mode="r", *a, **k):  # the first chunk fits; the second fills the disk half-way
        f = real_open(file, mode, *a, **k)
        if str(file) == str(groups) and "a" in mode:
            appends.append(file)
            if len(appends) == 2:
                real_write = f.write

                def write(text):
                    real_write(text[:40])
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

                f.write = write
        return f

    monkeypatch.setattr(builtins, "open", filling_disk)
    assert main_sample([*ARGS, f"out={out}", "chunk=8"]) == 2
    assert _lines(capsys.readouterr().err) == [
        f"humanline: error: cannot write {groups}: No space left on device; free the space (or fix the mount) and "
        f"rerun the same command to resume ({groups} keeps every prompt sampled so far)"]
    first = groups.read_text().splitlines(keepends=True)
    assert len(first) == 9 and not first[8].endswith("\n")  # 8 whole prompts and the 40 bytes that fitted
    assert not (out / "pairs.jsonl").exists() and not (out / "card.json").exists()
    monkeypatch.setattr(builtins, "open", real_open)  # space freed: the same command resumes
    assert main_sample([*ARGS, f"out={out}", "chunk=8"]) == 0
    rows = groups.read_text().splitlines(keepends=True)
    assert len(rows) == 20 and rows[:8] == first[:8] and all(json.loads(r)["prompt"] for r in rows)
    assert json.loads((out / "card.json").read_text())["counts"]["prompts"] == 20


@pytest.mark.parametrize("sig,code,said", [(signal.SIGTERM, 143, "stopped by SIGTERM"),
                                           (signal.SIGINT, 130, "interrupted (Ctrl-C)")], ids=["sigterm", "ctrl-c"])
def test_a_signal_mid_sampling_is_one_line_and_a_rerun_resumes(cache_dir, tmp_path, sig, code, said):
    out = tmp_path / "out"
    groups = out / "groups.jsonl"
    cmd = [sys.executable, "-m", "humanline_cli", "sample", *TINY_WORLD, "data.n=32", "data.limit=48", "threads=1",
           f"out={out}", "chunk=2"]
    # SIGINT's default handling: a pytest started from a background shell hands its children SIGINT ignored
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 300
    while not (groups.is_file() and groups.stat().st_size) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code and "Traceback" not in err, err[-3000:]
    assert _lines(err) == [f"humanline: sample {said}; rerun the same command to resume ({groups} keeps every "
                           f"prompt sampled so far)"]
    kept = len(groups.read_text().splitlines())
    assert 0 < kept < 48 and not (out / "card.json").exists()
    if sig == signal.SIGTERM:  # the rerun finishes the job
        r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        assert json.loads((out / "card.json").read_text())["counts"]["prompts"] == 48
