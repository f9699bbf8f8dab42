"""The verifiable task: addition of two d-digit numbers (world.digits, 2 by default).

Consumes a `random.Random`; produces prompt strings (`"37+45="`, operands
zero-padded so every prompt of a world has the same length: 2d + 2 characters),
the noisy SFT teacher's answers and the off-policy "other model"'s answers used
for offline data. Everything that reads a prompt takes the width from it. The
verifier itself lives in `rewards.py`.
"""

from __future__ import annotations

import random


DIGITS = 2  # operand width (world.digits)


def all_prompts(digits: int = DIGITS) -> list[str]:
    n = 10**digits
    return [f"{a:0{digits}d}+{b:0{digits}d}=" for a in range(n) for b in range(n)]


def split_prompts(rng: random.Random, n_train: int, n_eval: int,
                  digits: int = DIGITS) -> tuple[list[str], list[str], list[str]]:
    """(train, eval, sft): eval is held out of both SFT and offline data."""
    pool = all_prompts(digits)
    rng.shuffle(pool)
    if n_eval + n_train > len(pool):
        raise ValueError(f"arithmetic has only {len(pool)} problems; asked for {n_train} + {n_eval}")
    eval_ = pool[:n_eval]
    rest = pool[n_eval:]
    return rest[:n_train], eval_, rest


def operands(prompt: str) -> tuple[int, int]:
    a, b = prompt.rstrip("=").split("+")
    return int(a), int(b)


def answer(prompt: str) -> str:
    a, b = operands(prompt)
    return str(a + b)


CARRY_DROP = 0.6  # the noisy teacher's default (world.sft.carry_drop)


def carries(prompt: str) -> list[int]:
    """The columns i (0 = ones) whose sum carries into column i + 1 inside the operands' width; the carry out
    of the top column only writes the answer's leading 1, which the teacher never forgets."""
    a, b = operands(prompt)
    width = len(prompt.split("+")[0])
    out, carry = [], 0
    for i in range(width - 1):
        carry = (a // 10**i % 10 + b // 10**i % 10 + carry) >= 10
        if carry:
            out.append(i)
    return out


def teacher(rng: random.Random, prompt: str, carry_drop: float = CARRY_DROP) -> str:
    """Noisy teacher: forgets each carry independently `carry_drop` of the time
    (60%; the answer loses 10^(i+1) for a carry out of column i, so problems with
    more carries are wrong more often), and when it forgets none is off by one 20%
    of the time. Its mistakes are *plausible*, so the student keeps the right answer
    in its support (alignment can sharpen it). Two digits have at most one such
    carry (the ones'), so there it is one draw per carry problem."""
    a, b = operands(prompt)
    dropped = [i for i in carries(prompt) if rng.random() < carry_drop]
    if dropped:
        return str(a + b - sum(10 ** (i + 1) for i in dropped))  # the other digits are right, those carries lost
    if rng.random() < 0.2:
        return str(max(0, a + b + rng.choice((-1, 1))))
    return str(a + b)


def dropped_carry(prompt: str) -> str | None:
    """The noisy teacher's typical mistake on a carry problem (every carry lost), or
    None for a problem without a carry."""
    a, b = operands(prompt)
    cs = carries(prompt)
    return str(a + b - sum(10 ** (i + 1) for i in cs)) if cs else None


def n_correct(rng: random.Random, n: int, correct_rate: float) -> int:
    """How many of n distinct responses are correct: the correct string is
    unique, so at most one; it is present with probability min(1, n * rate),
    which keeps the per-response correct fraction at `correct_rate` whenever
    correct_rate <= 1/n (e.g. n=2, rate=0.5: every pair is correct vs wrong)."""
    return int(rng.random() < min(1.0, n * correct_rate))


def other_model(rng: random.Random, prompt: str, n: int, correct_rate: float, style: str) -> list[str]:
    """Rule-based off-policy responder: the right answer or a uniformly random
    wrong number in [0, 2 * 10^d - 2] (errors the policy never makes); style `padded`
    writes every answer as d + 1 zero-padded digits (a format the policy never writes)."""
    target = sum(operands(prompt))
    width = len(prompt.split("+")[0])
    values = [target] * n_correct(rng, n, correct_rate)
    wrong = rng.sample([v for v in range(2 * 10**width - 1) if v != target], n - len(values))
    values += wrong
    rng.shuffle(values)
    fmt = f"{{:0{width + 1}d}}" if style == "padded" else "{:d}"
    return [fmt.format(v) for v in values]
