"""The converted-model cache (world/packaged.py) without converting: a killed conversion's temporary copy is removed
by the next conversion."""
from __future__ import annotations

import os
import subprocess
import sys

from humanline_cli.world import packaged


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_next_conversion_removes_a_killed_conversions_temp_copy(tmp_path, monkeypatch):
    target = tmp_path / "smollm2-0123456789abcdef"
    monkeypatch.setattr(packaged, "converted_dir", lambda name, root: target)

    def convert(name, out):  # the real conversion takes 20 s; the folders are what matter
        (out / "model.safetensors").write_text("weights")
        (out / packaged.DONE).write_text("{}\n")

    monkeypatch.setattr(packaged, "convert", convert)
    killed = tmp_path / f".tmp-{target.name}-{_dead_pid()}-deadbeef"  # kill -9 mid-conversion leaves this
    live = tmp_path / f".tmp-{target.name}-{os.getppid()}-cafecafe"       # a conversion still running: kept
    for d in (killed, live):
        d.mkdir()
        (d / "model.safetensors").write_text("half")
    assert packaged.materialise("smollm2", tmp_path, progress=False) == target
    assert (target / "model.safetensors").read_text() == "weights"
    assert sorted(p.name for p in tmp_path.glob(".tmp-*")) == [live.name]


def test_the_conversion_is_announced_at_its_real_length(tmp_path, monkeypatch, capsys):
    target = tmp_path / "smollm2-0123456789abcdef"
    monkeypatch.setattr(packaged, "converted_dir", lambda name, root: target)
    monkeypatch.setattr(packaged, "convert", lambda name, out: (out / packaged.DONE).write_text("{}\n"))
    packaged.materialise("smollm2", tmp_path, progress=True)
    first = capsys.readouterr().err.splitlines()[0]
    # 18-25 s measured on 2 cores, not the "about 2 min" once announced
    assert first == (f"humanline: converting {packaged.PACKAGED['smollm2'].label} into {target} (once per machine; "
                     "about 30 s on 2 CPU cores)")

