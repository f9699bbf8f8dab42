"""The bundled world: a tiny tokenizer, a mediocre SFT starting policy,
off-policy offline data and reward functions, built locally on first use.

Consumes a plain-dict world cfg (`kind` plus optional overrides of
`defaults.DEFAULTS[kind]`) and a cache root; produces
`cache_root/<kind>-<hash12>/` holding `WORLD_FILES`. The folder name is a
hash of the fully-resolved cfg and `WORLD_VERSION`, so runs and tests reuse a
world and any changed knob names a new one. Bump `WORLD_VERSION` whenever a
change to this package changes what a build produces.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path

from .defaults import DEFAULTS, resolve

WORLD_VERSION = 1
WORLD_FILES = (
    "policy",
    "offline_pairs.jsonl",
    "offline_groups.jsonl",
    "offline_unpaired.jsonl",
    "prompts_train.jsonl",
    "prompts_eval.jsonl",
    "world.json",
)

__all__ = ["DEFAULTS", "WORLD_FILES", "WORLD_VERSION", "materialise", "resolve", "world_dir"]


def _hash(cfg: Mapping) -> str:
    canonical = json.dumps({"version": WORLD_VERSION, "cfg": cfg}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


def world_dir(cfg: Mapping, cache_root: str | os.PathLike) -> Path:
    full = resolve(cfg)
    return Path(cache_root) / f"{full['kind']}-{_hash(full)}"


def _complete(path: Path) -> bool:
    return all((path / name).exists() for name in WORLD_FILES)


def materialise(cfg: Mapping, cache_root: str | os.PathLike, progress: bool = True) -> Path:
    """Return the world's folder, building it first if missing.

    The build goes to a temporary sibling then is renamed into place, so a
    crash never leaves a half world; a per-world lock file makes a second
    process wait for the first build instead of repeating it.
    """
    full = resolve(cfg)
    root = Path(cache_root)
    target = root / f"{full['kind']}-{_hash(full)}"
    if _complete(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if _complete(target):  # another process built it while we waited
            return target
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


def _build(full: dict, tmp: Path, progress: bool) -> None:
    from .build import build  # deferred: world_dir() should stay cheap to import and call

    build(full, tmp, WORLD_VERSION, progress)
