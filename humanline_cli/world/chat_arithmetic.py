"""Natural-language arithmetic for a real instruct model: "What is 27 + 82?", answered in chat.

Consumes a task generator cfg (schema.TaskGeneratorConfig: digits, op, n_train, n_eval, seed) and a cache
root; produces `<cache_root>/chat_arithmetic-<hash12>/` with `prompts_train.jsonl` and `prompts_eval.jsonl`
(rows {"prompt": "What is 27 + 82?", "answer": "109"}, train and eval prompts disjoint) and `task.json`,
written to a temporary sibling and renamed into place. The task's paths `gen://NAME` point into that folder.
The judge and labeller are the verifier's `final_number` method: the last number in the reply is the answer.

Difficulty: `digits` (operands of exactly that many digits; `digits_b`, when set, the second operand's) and `op`
(add, sub with a non-negative result, mul, mixed: one of the three per prompt, or add_sub: + or -).
`instruction` (e.g. "Answer with the number only.") follows each question: it moves a reply's
format into the prompt, so that what training changes is the arithmetic. SmolLM2-135M-Instruct's start
accuracy per setting is in docs/results.md.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path

from humanline_cli.errors import UserError

SCHEME = "gen://"
VERSION = 1  # bump when a change here changes what a build writes
OPS = {"add": "+", "sub": "-", "mul": "*"}
MIXES = {"mixed": tuple(OPS), "add_sub": ("add", "sub")}  # each prompt draws one of these
FILES = ("prompts_train.jsonl", "prompts_eval.jsonl", "task.json")


def check(cfg: Mapping) -> dict:
    """The cfg as a plain dict, or a one-line UserError naming the bad key."""
    full = {k: cfg[k] for k in ("kind", "digits", "op", "n_train", "n_eval", "seed")}
    if cfg.get("instruction"):  # only when set, so the folders of tasks without one keep their names
        full["instruction"] = str(cfg["instruction"])
    if cfg.get("digits_b") is not None:  # likewise
        full["digits_b"] = int(cfg["digits_b"])
    if full["kind"] != "chat_arithmetic":
        raise UserError(f"config key 'task.generator.kind': unknown generator {full['kind']!r} (chat_arithmetic)")
    if full["op"] not in (*OPS, *MIXES):
        raise UserError(f"config key 'task.generator.op': {full['op']!r} is not one of add, sub, mul, mixed, add_sub")
    for key in ("digits", "digits_b"):
        if key in full and not 1 <= int(full[key]) <= 9:
            raise UserError(f"config key 'task.generator.{key}': {full[key]} is outside 1..9")
    if int(full["n_train"]) < 1 or int(full["n_eval"]) < 1:
        raise UserError("config keys 'task.generator.n_train' and 'n_eval' must be at least 1")
    (lo, hi), (lo_b, hi_b) = _bounds(int(full["digits"])), _bounds(int(full.get("digits_b", full["digits"])))
    ops = len(MIXES.get(full["op"], (full["op"],)))
    same = (lo, hi) == (lo_b, hi_b)  # a - b and b - a are one problem only when both come from one range
    space = (hi - lo + 1) * (hi_b - lo_b + 1) * ops // (2 if full["op"] == "sub" and same else 1)
    if full["n_train"] + full["n_eval"] > space // 2:  # room to draw distinct prompts without a long search
        raise UserError(f"task.generator: {full['n_train']} + {full['n_eval']} prompts do not fit in the "
                        f"{space} distinct {full['digits']}-digit {full['op']} problems (at most half of them)")
    return full


def _bounds(digits: int) -> tuple[int, int]:
    return (0 if digits == 1 else 10 ** (digits - 1)), 10 ** digits - 1


def problem(rng: random.Random, digits: int, op: str, instruction: str = "", digits_b: int | None = None
            ) -> tuple[str, str]:
    """(prompt, answer) of one problem; the second operand has `digits_b` digits (None: `digits`); sub puts
    the larger operand first; `instruction` follows the question after a space."""
    lo, hi = _bounds(digits)
    lo_b, hi_b = _bounds(digits if digits_b is None else digits_b)
    a, b = rng.randint(lo, hi), rng.randint(lo_b, hi_b)
    op = rng.choice(list(MIXES[op])) if op in MIXES else op
    if op == "sub" and b > a:
        a, b = b, a
    value = {"add": a + b, "sub": a - b, "mul": a * b}[op]
    question = f"What is {a} {OPS[op]} {b}?"
    return (f"{question} {instruction}" if instruction else question), str(value)


def generate(cfg: Mapping) -> tuple[list[dict], list[dict]]:
    """(train rows, eval rows): distinct prompts, seeded by cfg['seed'], eval drawn first then train."""
    full = check(cfg)
    rng = random.Random(f"chat_arithmetic:{full['seed']}")
    seen: dict[str, str] = {}
    while len(seen) < full["n_eval"] + full["n_train"]:
        prompt, answer = problem(rng, int(full["digits"]), full["op"], full.get("instruction", ""), full.get("digits_b"))
        seen.setdefault(prompt, answer)
    rows = [{"prompt": p, "answer": a} for p, a in seen.items()]
    return rows[full["n_eval"]:], rows[:full["n_eval"]]


def task_dir(cfg: Mapping, cache_root: str | os.PathLike) -> Path:
    full = check(cfg)
    key = json.dumps({"version": VERSION, "cfg": full}, sort_keys=True, separators=(",", ":"))
    return Path(cache_root) / f"chat_arithmetic-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def materialise(cfg: Mapping, cache_root: str | os.PathLike) -> Path:
    """The task's folder, written first when missing (milliseconds; atomic by rename)."""
    target = task_dir(cfg, cache_root)
    if all((target / f).is_file() for f in FILES):
        return target
    train, eval_ = generate(cfg)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".tmp-{target.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        for name, rows in (("prompts_train.jsonl", train), ("prompts_eval.jsonl", eval_)):
            (tmp / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tmp / "task.json").write_text(json.dumps({"version": VERSION, "cfg": check(cfg)}, indent=2) + "\n")
        try:
            os.rename(tmp, target)
        except OSError:  # another process wrote the same content first
            if not all((target / f).is_file() for f in FILES):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
