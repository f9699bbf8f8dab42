"""A world's name: `<kind>-<hash12>`, a hash of the fully-resolved cfg and `WORLD_VERSION`, so runs and
tests reuse a world and any changed knob names a new one. Bump `WORLD_VERSION` whenever a change to this
package changes what a build produces."""
from __future__ import annotations

import copy
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

from humanline_cli.world.defaults import resolve

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


# Keys that only a model-sourced offline set reads: a rule world leaves them out
# of its hash (and world.json), so it keeps the name it had before they existed.
MODEL_SOURCE_KEYS = ("source", "other_sft")
# Knobs added after worlds were named, and the value every earlier world had: at that value
# they are left out of the hash, so those worlds keep their names.
LATER_KNOBS = {("format",): "chat", ("sft", "carry_drop"): 0.6, ("digits",): 2}


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
    elif view["offline"]["source"] == "policy":  # the starting policy samples: no other model to train
        view["offline"] = {k: v for k, v in view["offline"].items() if k != "other_sft"}
    return view


def world_hash(full: Mapping) -> str:
    canonical = json.dumps(
        {"version": WORLD_VERSION, "cfg": hash_view(full)}, sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


def world_dir(cfg: Mapping, cache_root: str | os.PathLike) -> Path:
    full = resolve(cfg)
    return Path(cache_root) / f"{full['kind']}-{world_hash(full)}"
