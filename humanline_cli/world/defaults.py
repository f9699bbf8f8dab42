"""Default world configs, one per task, and the deep merge that fills a
partial cfg from them (done BEFORE hashing, so `{kind: arithmetic}` and the
full default dict name the same world)."""

from __future__ import annotations

import copy
from collections.abc import Mapping

_COMMON = {
    "seed": 0,
    "n_train_prompts": 4096,  # prompts for offline data and online training
    "n_eval_prompts": 256,  # held out of SFT and offline data
    # head_dim >= 32 is needed for vLLM to load the policy
    "model": {
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "head_dim": 32,
        "intermediate_size": 384,
    },
    # teacher: `noisy` (mediocre, right answers kept in support) or `clean`
    "sft": {
        "steps": 1200,
        "batch_size": 64,
        "lr": 3.0e-3,
        "warmup": 30,
        "weight_decay": 0.1,
        "teacher": "noisy",
    },
    # rule-based "other model": correct_rate = chance the right reply is in a
    # prompt's set (see arithmetic.n_correct); style `plain` or `padded`
    "offline": {"correct_rate": 0.5, "style": "plain", "n_per_prompt": 2},
}

DEFAULTS = {
    "arithmetic": {"kind": "arithmetic", **copy.deepcopy(_COMMON)},
    "preference": {"kind": "preference", **copy.deepcopy(_COMMON)},
}
# Preference sequences are ~1.6x longer and have no plateau to escape.
DEFAULTS["preference"]["sft"]["steps"] = 800


def deep_merge(base: Mapping, override: Mapping) -> dict:
    out = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def resolve(cfg: Mapping) -> dict:
    """Full cfg for `cfg['kind']`; rejects unknown kinds and keys (a typo
    would otherwise silently hash to a new world built from defaults)."""
    kind = cfg.get("kind")
    if kind not in DEFAULTS:
        raise ValueError(f"world kind must be one of {sorted(DEFAULTS)}, not {kind!r}")
    full = deep_merge(DEFAULTS[kind], cfg)
    _check_keys(DEFAULTS[kind], full, "world")
    if full["model"]["head_dim"] < 32:
        raise ValueError("world.model.head_dim must be >= 32 (vLLM cannot load smaller heads)")
    if full["offline"]["style"] not in ("plain", "padded"):
        raise ValueError(f"world.offline.style must be 'plain' or 'padded', not {full['offline']['style']!r}")
    if full["sft"]["teacher"] not in ("noisy", "clean"):
        raise ValueError(f"world.sft.teacher must be 'noisy' or 'clean', not {full['sft']['teacher']!r}")
    if full["offline"]["n_per_prompt"] < 2:
        raise ValueError("world.offline.n_per_prompt must be >= 2 (pairs need two replies)")
    return full


def _check_keys(ref: Mapping, got: Mapping, where: str) -> None:
    unknown = sorted(set(got) - set(ref))
    if unknown:
        raise ValueError(f"unknown key(s) in {where}: {unknown}; known: {sorted(ref)}")
    for key, value in ref.items():
        if isinstance(value, Mapping):
            if not isinstance(got[key], Mapping):
                raise TypeError(f"{where}.{key} must be a mapping")
            _check_keys(value, got[key], f"{where}.{key}")
