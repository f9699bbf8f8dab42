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

import copy
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

__all__ = ["DEFAULTS", "WORLD_FILES", "WORLD_VERSION", "hash_view", "materialise", "resolve", "world_dir"]


# Keys that only a model-sourced offline set reads: a rule world leaves them out
# of its hash (and world.json), so it keeps the name it had before they existed.
MODEL_SOURCE_KEYS = ("source", "other_sft")
# Knobs added after worlds were named, and the value every earlier world had: at that value
# they are left out of the hash, so those worlds keep their names.
LATER_KNOBS = {("format",): "chat", ("sft", "carry_drop"): 0.6}


def hash_view(full: Mapping) -> dict:
    """The part of a resolved cfg that names (and describes) the world: all of it,
    less `offline.source`/`offline.other_sft` in a rule world, where they do nothing, and
    less the knobs added after worlds were named at the value earlier worlds had (LATER_KNOBS).
    So rule worlds keep their pre-`source` names (no WORLD_VERSION bump) and tuning
    `other_sft` never renames one."""
    view = copy.deepcopy(dict(full))
    for (*parents, key), old in LATER_KNOBS.items():
        node = view
        for name in parents:
            node = node[name]
        if node.get(key, old) == old:
            node.pop(key, None)
    if view["offline"]["source"] == "rule":
        view["offline"] = {k: v for k, v in view["offline"].items() if k not in MODEL_SOURCE_KEYS}
    return view


def _hash(full: Mapping) -> str:
    canonical = json.dumps(
        {"version": WORLD_VERSION, "cfg": hash_view(full)}, sort_keys=True, separators=(",", ":")
    )
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
    process wait for the first build instead of repeating it. A build that
    was killed (no `finally`) leaves its `.tmp-*` sibling behind: the next
    build removes those whose builder is gone (`_remove_stale_tmp`).
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
        _remove_stale_tmp(root, target.name)
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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _remove_stale_tmp(root: Path, holding: str) -> list[Path]:
    """Remove `.tmp-<world>-<pid>-<hex>` dirs left by killed builds; called while holding the lock
    of world `holding`. A dir is stale when its builder's pid is not alive and no one holds its
    world's lock (ours, for `holding`; for other worlds a non-blocking try of theirs, so a build in
    progress elsewhere, even on another host sharing the cache, is never touched)."""
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


def _build(full: dict, tmp: Path, progress: bool) -> None:
    from .build import build  # deferred: world_dir() should stay cheap to import and call

    build(full, tmp, WORLD_VERSION, progress)
