"""A generated task's prompt files (task.generator; the paths gen://prompts_train.jsonl, gen://prompts_eval.jsonl):
the generator of `kind` (world/chat_arithmetic.py, world/chat_sentiment.py) checks the cfg and draws the rows;
this module names the folder `<cache_root>/<kind>-<hash12>/` by the checked cfg and the generator's VERSION, and
writes `prompts_train.jsonl`, `prompts_eval.jsonl` and `task.json` into a temporary sibling renamed into place."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path

from humanline_cli.errors import UserError

FILES = ("prompts_train.jsonl", "prompts_eval.jsonl", "task.json")


def generator(cfg: Mapping):
    """The module generating task.generator.kind's rows."""
    match cfg.get("kind"):
        case "chat_arithmetic":
            from humanline_cli.world import chat_arithmetic

            return chat_arithmetic
        case "chat_sentiment":
            from humanline_cli.world import chat_sentiment

            return chat_sentiment
    raise UserError(f"config key 'task.generator.kind': unknown generator {cfg.get('kind')!r} "
                    "(chat_arithmetic | chat_sentiment)")


def task_dir(cfg: Mapping, cache_root: str | os.PathLike) -> Path:
    gen = generator(cfg)
    key = json.dumps({"version": gen.VERSION, "cfg": gen.check(cfg)}, sort_keys=True, separators=(",", ":"))
    return Path(cache_root) / f"{gen.NAME}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def materialise(cfg: Mapping, cache_root: str | os.PathLike) -> Path:
    """The task's folder, written first when missing (milliseconds; atomic by rename)."""
    target, gen = task_dir(cfg, cache_root), generator(cfg)
    if all((target / f).is_file() for f in FILES):
        return target
    train, eval_ = gen.generate(cfg)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".tmp-{target.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        for name, rows in (("prompts_train.jsonl", train), ("prompts_eval.jsonl", eval_)):
            (tmp / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tmp / "task.json").write_text(json.dumps({"version": gen.VERSION, "cfg": gen.check(cfg)}, indent=2) + "\n")
        try:
            os.rename(tmp, target)
        except OSError:  # another process wrote the same content first
            if not all((target / f).is_file() for f in FILES):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
