"""Natural-language arithmetic for a real instruct model: "What is 27 + 82?", answered in chat.

Consumes a task generator cfg (schema.TaskGeneratorConfig: digits, op, n_train, n_eval, seed); produces its
train and eval rows ({"prompt": "What is 27 + 82?", "answer": "109"}, train and eval prompts disjoint), which
world/generated.py writes into `<cache_root>/chat_arithmetic-<hash12>/`.
The judge and labeller are the verifier's `final_number` method: the last number in the reply is the answer.

Difficulty: `digits` (operands of exactly that many digits; `digits_b`, when set, the second operand's) and `op`
(add, sub with a non-negative result, mul, mixed: one of the three per prompt, or add_sub: + or -).
`instruction` (e.g. "Answer with the number only.") follows each question: it moves a reply's
format into the prompt, so that what training changes is the arithmetic. SmolLM2-135M-Instruct's start
accuracy per setting is in docs/results.md.
"""
from __future__ import annotations

import random
from collections.abc import Mapping

from humanline_cli.errors import UserError

NAME = "chat_arithmetic"
VERSION = 1  # bump when a change here changes what a build writes
OPS = {"add": "+", "sub": "-", "mul": "*"}
MIXES = {"mixed": tuple(OPS), "add_sub": ("add", "sub")}  # each prompt draws one of these


def check(cfg: Mapping) -> dict:
    """The cfg as a plain dict, or a one-line UserError naming the bad key."""
    full = {k: cfg[k] for k in ("kind", "digits", "op", "n_train", "n_eval", "seed")}
    if cfg.get("instruction"):  # only when set, so the folders of tasks without one keep their names
        full["instruction"] = str(cfg["instruction"])
    if cfg.get("digits_b") is not None:  # likewise
        full["digits_b"] = int(cfg["digits_b"])
    if cfg.get("carry") is False:  # likewise
        full["carry"] = False
    if full["kind"] != "chat_arithmetic":
        raise UserError(f"config key 'task.generator.kind': unknown generator {full['kind']!r} (chat_arithmetic)")
    if full["op"] not in (*OPS, *MIXES):
        raise UserError(f"config key 'task.generator.op': {full['op']!r} is not one of add, sub, mul, mixed, add_sub")
    for key in ("digits", "digits_b"):
        if key in full and not 1 <= int(full[key]) <= 9:
            raise UserError(f"config key 'task.generator.{key}': {full[key]} is outside 1..9")
    if int(full["n_train"]) < 1 or int(full["n_eval"]) < 1:
        raise UserError("config keys 'task.generator.n_train' and 'n_eval' must be at least 1")
    space = _space(full)
    if full["n_train"] + full["n_eval"] > space * 9 // 10:  # room to draw distinct prompts without a long search
        raise UserError(f"task.generator: {full['n_train']} + {full['n_eval']} prompts do not fit in the "
                        f"{space} distinct {full['digits']}-digit {full['op']} problems (at most 90% of them)")
    return full


def _space(full: dict) -> int:
    """How many distinct problems the cfg draws from."""
    (lo, hi), (lo_b, hi_b) = _bounds(int(full["digits"])), _bounds(int(full.get("digits_b", full["digits"])))
    ops = MIXES.get(full["op"], (full["op"],))
    if full.get("carry") is False:
        if full.get("digits_b") != 1 or not set(ops) <= {"add", "sub"}:
            raise UserError("config key 'task.generator.carry': false needs digits_b 1 and op add, sub or add_sub")
        # each ones digit u is equally common among first operands: u + b < 10 leaves 10 - u choices of b, b <= u
        # leaves u + 1, so 55 of the 100 (u, b) pairs per operation
        return (hi - lo + 1) // 10 * 55 * len(ops)
    same = (lo, hi) == (lo_b, hi_b)  # a - b and b - a are one problem only when both come from one range
    return (hi - lo + 1) * (hi_b - lo_b + 1) * len(ops) // (2 if full["op"] == "sub" and same else 1)


def _carries(a: int, b: int, op: str) -> bool:
    return a % 10 + b % 10 >= 10 if op == "add" else a % 10 < b % 10


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


def _operands(prompt: str) -> tuple[int, int, str]:
    a, op, b = prompt.removeprefix("What is ").split("?", 1)[0].split()
    return int(a), int(b), {v: k for k, v in OPS.items()}[op]


def generate(cfg: Mapping) -> tuple[list[dict], list[dict]]:
    """(train rows, eval rows): distinct prompts, seeded by cfg['seed'], eval drawn first then train."""
    full = check(cfg)
    rng = random.Random(f"chat_arithmetic:{full['seed']}")
    seen: dict[str, str] = {}
    while len(seen) < full["n_eval"] + full["n_train"]:
        prompt, answer = problem(rng, int(full["digits"]), full["op"], full.get("instruction", ""), full.get("digits_b"))
        if full.get("carry") is False and _carries(*_operands(prompt)):
            continue
        seen.setdefault(prompt, answer)
    rows = [{"prompt": p, "answer": a} for p, a in seen.items()]
    return rows[full["n_eval"]:], rows[:full["n_eval"]]
