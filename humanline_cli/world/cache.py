"""The content-addressed world cache: `materialise` returns `cache_root/<kind>-<hash12>/` holding
`WORLD_FILES`, building the world first (world/make.py) when it is missing, under a per-world lock."""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path

from humanline_cli.world import make
from humanline_cli.world.defaults import resolve
from humanline_cli.world.naming import WORLD_FILES, WORLD_VERSION, world_hash
from humanline_cli.world.stale import remove_stale_tmp


def _complete(path: Path) -> bool:
    return all((path / name).exists() for name in WORLD_FILES)


def materialise(cfg: Mapping, cache_root: str | os.PathLike, progress: bool = True) -> Path:
    """Return the world's folder, building it first if missing.

    The build goes to a temporary sibling then is renamed into place, so a
    crash never leaves a half world; a per-world lock file makes a second
    process wait for the first build instead of repeating it. A build that
    was killed (no `finally`) leaves its `.tmp-*` sibling behind: the next
    build removes those whose builder is gone (`remove_stale_tmp`). A
    cached world whose world.json records other build settings than the
    current code uses (`make.build_settings`) is rebuilt, with a note.
    """
    full = resolve(cfg)
    root = Path(cache_root)
    target = root / f"{full['kind']}-{world_hash(full)}"
    if _complete(target) and _built_otherwise(target) is None:
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if _complete(target):  # another process built it while we waited
            why = _built_otherwise(target)
            if why is None:
                return target
            print(f"humanline: note: world {target} {why}; building it again", file=sys.stderr, flush=True)
        remove_stale_tmp(root, target.name)
        tmp = root / f".tmp-{target.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            _build(full, tmp, progress)
            if target.exists():  # an incomplete leftover (not from us): replace it
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _built_otherwise(target: Path) -> str | None:
    """Why the complete world at `target` is not what the current code builds (its world.json's build settings
    differ from `make.build_settings()`), or None when it is."""
    try:
        info = json.loads((target / "world.json").read_text())
    except (OSError, ValueError):
        return "has an unreadable world.json"
    for key, now in make.build_settings().items():
        was = info.get(key) if isinstance(info, dict) else None
        if was != now:
            return f"was built with {key}={was} (the build now uses {now}, which gives other weights)"
    return None


def _build(full: dict, tmp: Path, progress: bool) -> None:
    make.build(full, tmp, WORLD_VERSION, progress)
