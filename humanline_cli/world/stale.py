"""The cache's leftovers: `.tmp-<name>-<pid>-<hex>` folders of builds (worlds, converted models) that were killed
before their `finally` ran. Consumes the cache root; removes those no live process and no lock holder owns."""
from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_tmp(root: Path, holding: str) -> list[Path]:
    """Remove `.tmp-<name>-<pid>-<hex>` dirs left by killed builds; called while holding the lock of the folder
    `holding` (a world, a converted model). A dir is stale when its builder's pid is not alive and no one holds
    its folder's lock (ours, for `holding`; for others a non-blocking try of theirs, so a build in progress
    elsewhere, even on another host sharing the cache, is never touched)."""
    removed = []
    for tmp in root.glob(".tmp-*"):
        name, _, rest = tmp.name[len(".tmp-"):].rpartition("-")  # rest: the uuid part
        name, _, pid = name.rpartition("-")
        if not tmp.is_dir() or not name or not pid.isdigit() or _pid_alive(int(pid)):
            continue
        if name == holding:
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
            continue
        lock_path = root / f".{name}.lock"
        if not lock_path.exists():
            continue
        with open(lock_path, "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # that world is being built right now
                continue
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    return removed
