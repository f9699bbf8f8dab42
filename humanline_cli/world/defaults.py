"""Default world configs, one per task, and the deep merge that fills a
partial cfg from them (done BEFORE hashing, so `{kind: arithmetic}` and the
full default dict name the same world)."""

from __future__ import annotations

import copy
from collections.abc import Mapping

from humanline_cli.world.arithmetic import CARRY_DROP, DIGITS

_COMMON = {
    "seed": 0,
    # `chat` (`<|user|>PROMPT<|assistant|>REPLY`) or `plain` (`PROMPT REPLY`, the prototype's format);
    # left out of the hash at `chat` (naming.hash_view)
    "format": "chat",
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
    # the "other model" that writes the offline data. source `rule`: rule-based
    # (correct_rate = chance the right reply is in a prompt's set, see
    # arithmetic.n_correct; style `plain` or `padded`). source `model`: T=1
    # samples of a second tiny policy trained by `other_sft` (see
    # make.other_policy; correct_rate does not apply, style must be plain).
    # `source` and `other_sft` are left out of a rule world's hash (see
    # naming.hash_view), so rule worlds keep their names.
    "offline": {
        "source": "rule",
        "correct_rate": 0.5,
        "style": "plain",
        "n_per_prompt": 2,
        # the other model's recipe (its own seed "<seed>:other:*"): the clean
        # teacher, stopped once its loss is below stop_loss, i.e. just past
        # arithmetic's ones-digit plateau (at most half the policy's SFT steps);
        # why: see make.other_policy
        "other_sft": {
            "steps": 600,
            "batch_size": 64,
            "lr": 3.0e-3,
            "warmup": 30,
            "weight_decay": 0.1,
            "teacher": "clean",
            "stop_loss": 0.3,
        },
    },
}

DEFAULTS = {
    "arithmetic": {"kind": "arithmetic", **copy.deepcopy(_COMMON)},
    "preference": {"kind": "preference", **copy.deepcopy(_COMMON)},
}
# Preference sequences are ~1.6x longer and have no plateau to escape.
DEFAULTS["preference"]["sft"]["steps"] = 800
DEFAULTS["preference"]["offline"]["other_sft"]["steps"] = 400
# Arithmetic's noisy teacher forgets a carry this often (see arithmetic.teacher);
# at the default it is left out of the world's hash (naming.hash_view).
DEFAULTS["arithmetic"]["sft"]["carry_drop"] = CARRY_DROP
# Operand width: `ab+cd=` (2) or `abc+def=` (3, where the teacher drops each carry independently, so its
# errors fall geometrically with the number of carries); at 2 it is left out of the world's hash.
DEFAULTS["arithmetic"]["digits"] = DIGITS


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
    if full["format"] not in ("chat", "plain"):
        raise ValueError(f"world.format must be 'chat' or 'plain', not {full['format']!r}")
    if full["format"] == "plain" and kind != "arithmetic":  # only arithmetic's prompts end in a marker ("=")
        raise ValueError("world.format=plain needs the arithmetic task (preference prompts have no end marker)")
    if kind == "arithmetic" and not 0.0 <= full["sft"]["carry_drop"] <= 1.0:
        raise ValueError(f"world.sft.carry_drop must be in [0, 1], not {full['sft']['carry_drop']!r}")
    if kind == "arithmetic" and full["digits"] not in (2, 3):
        raise ValueError(f"world.digits must be 2 or 3, not {full['digits']!r}")
    if full["offline"]["n_per_prompt"] < 2:
        raise ValueError("world.offline.n_per_prompt must be >= 2 (pairs need two replies)")
    if full["offline"]["source"] not in ("rule", "model", "policy"):
        raise ValueError(f"world.offline.source must be 'rule', 'model' or 'policy', not {full['offline']['source']!r}")
    if full["offline"]["source"] in ("model", "policy") and full["offline"]["style"] != "plain":
        raise ValueError("world.offline.style=padded needs world.offline.source=rule (a model writes its own format)")
    if full["offline"]["other_sft"]["teacher"] not in ("noisy", "clean"):
        raise ValueError(
            f"world.offline.other_sft.teacher must be 'noisy' or 'clean', not {full['offline']['other_sft']['teacher']!r}"
        )
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
