"""Nothing half-written: a model save that fails (disk full) leaves no temp dir and keeps the old model,
a save replaces the old model whole, and the next world build removes temp dirs of killed builds."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from humanline_cli.backend import Dist
from humanline_cli.errors import RunFailed
from tests.helpers.cli import tiny_world_cfg

# ---- a failed save leaves no temp dir; a killed world build's temp dir is cleaned ---------------------

class _Saver:
    """A policy/tokenizer stand-in: writes one file, then fails like a full disk if told to."""

    def __init__(self, name: str, fail: bool):
        self.name, self.fail = name, fail

    def save_pretrained(self, path, **kwargs):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / self.name).write_text("new")
        if self.fail:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _parts(fail_policy=False, fail_tokenizer=False):
    return SimpleNamespace(dist=Dist(), policy=_Saver("model.safetensors", fail_policy),
                           tokenizer=_Saver("tokenizer.json", fail_tokenizer))


@pytest.mark.parametrize("fail", ["policy", "tokenizer"])
def test_disk_full_save_cleans_its_temp_dir_and_keeps_the_old_model(tmp_path, fail):
    from humanline_cli.train.finish import save_model

    dest = tmp_path / "model"
    dest.mkdir()
    (dest / "model.safetensors").write_text("old")
    with pytest.raises(RunFailed) as e:
        save_model(_parts(fail_policy=fail == "policy", fail_tokenizer=fail == "tokenizer"), dest)
    assert str(e.value) == f"cannot save the model to {dest}: No space left on device"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no model.tmp, no model.old
    assert sorted(p.name for p in dest.iterdir()) == ["model.safetensors"]
    assert (dest / "model.safetensors").read_text() == "old"


def test_save_replaces_the_old_model_whole(tmp_path):
    from humanline_cli.train.finish import save_model

    dest = tmp_path / "model"
    dest.mkdir()
    (dest / "stale.bin").write_text("old")
    save_model(_parts(), dest)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert sorted(p.name for p in dest.iterdir()) == ["model.safetensors", "tokenizer.json"]


def test_disk_full_lora_save_cleans_both_temp_dirs(tmp_path, monkeypatch):
    from humanline_cli.core import lora
    from humanline_cli.train.finish import save_model

    def full_disk(model, tok, dest, state=None):  # save_merged stages in <dest>.tmp; fail half-way like a full disk
        staging = Path(str(dest) + ".tmp")
        staging.mkdir()
        (staging / "model.safetensors").write_text("half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(lora, "save_merged", full_disk)
    parts = _parts()
    parts.policy.peft_config = {"default": None}
    dest = tmp_path / "model"
    dest.mkdir()
    (dest / "model.safetensors").write_text("old")
    with pytest.raises(RunFailed, match="No space left on device"):
        save_model(parts, dest)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert (dest / "model.safetensors").read_text() == "old"


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_next_world_build_removes_stale_temp_dirs(tmp_path, monkeypatch):
    import fcntl

    import humanline_cli.world.cache as world
    from humanline_cli.world.cache import materialise
    from humanline_cli.world.naming import WORLD_FILES, world_dir

    def fast_build(full, tmp, progress):  # the real build takes seconds; the files are what matter
        for name in WORLD_FILES:
            (tmp / name).mkdir() if name == "policy" else (tmp / name).write_text("{}\n")

    monkeypatch.setattr(world, "_build", fast_build)
    cfg = tiny_world_cfg()
    target = world_dir(cfg, tmp_path).name
    dead, alive = _dead_pid(), os.getppid()
    stale = tmp_path / f".tmp-{target}-{dead}-deadbeef"
    live = tmp_path / f".tmp-{target}-{alive}-cafecafe"                  # a live builder pid: left alone
    other_free = tmp_path / f".tmp-preference-0123456789ab-{dead}-00000001"  # another world, lock free
    other_busy = tmp_path / f".tmp-preference-ba9876543210-{dead}-00000002"  # another world being built
    for d in (stale, live, other_free, other_busy):
        d.mkdir()
        (d / "half-written").write_text("x")
    (tmp_path / ".preference-0123456789ab.lock").write_text("")
    busy_lock = open(tmp_path / ".preference-ba9876543210.lock", "w")
    fcntl.flock(busy_lock, fcntl.LOCK_EX)
    try:
        out = materialise(cfg, tmp_path, progress=False)
    finally:
        busy_lock.close()
    assert out == tmp_path / target and all((out / n).exists() for n in WORLD_FILES)
    assert not stale.exists() and not other_free.exists()
    assert live.is_dir() and other_busy.is_dir()
    assert sorted(p.name for p in tmp_path.glob(".tmp-*")) == sorted([live.name, other_busy.name])
