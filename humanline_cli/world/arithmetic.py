"""The verifiable task: two-digit addition.

Consumes a `random.Random`; produces prompt strings (`"37+45="`, operands
zero-padded so every prompt is 6 characters), the noisy SFT teacher's
answers and the off-policy "other model"'s answers used for offline data.
The verifier itself lives in `rewards.py`.
"""

from __future__ import annotations

import random


def all_prompts() -> list[str]:
    return [f"{a:02d}+{b:02d}=" for a in range(100) for b in range(100)]


def split_prompts(rng: random.Random, n_train: int, n_eval: int) -> tuple[list[str], list[str], list[str]]:
    """(train, eval, sft): eval is held out of both SFT and offline data."""
    pool = all_prompts()
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


def teacher(rng: random.Random, prompt: str, carry_drop: float = CARRY_DROP) -> str:
    """Noisy teacher: on carry problems forgets the carry `carry_drop` of the time
    (60%), otherwise is off by one 20% of the time. Its mistakes are *plausible*, so
    the student keeps the right answer in its support (alignment can sharpen it)."""
    a, b = operands(prompt)
    if (a % 10) + (b % 10) >= 10 and rng.random() < carry_drop:
        return str(a + b - 10)  # the ones digit is right, the carry into tens is lost
    if rng.random() < 0.2:
        return str(max(0, a + b + rng.choice((-1, 1))))
    return str(a + b)


def dropped_carry(prompt: str) -> str | None:
    """The noisy teacher's typical mistake on a carry problem (the carry into the tens
    lost), or None for a problem without a carry."""
    a, b = operands(prompt)
    return str(a + b - 10) if (a % 10) + (b % 10) >= 10 else None


def n_correct(rng: random.Random, n: int, correct_rate: float) -> int:
    """How many of n distinct responses are correct: the correct string is
    unique, so at most one; it is present with probability min(1, n * rate),
    which keeps the per-response correct fraction at `correct_rate` whenever
    correct_rate <= 1/n (e.g. n=2, rate=0.5: every pair is correct vs wrong)."""
    return int(rng.random() < min(1.0, n * correct_rate))


def other_model(rng: random.Random, prompt: str, n: int, correct_rate: float, style: str) -> list[str]:
    """Rule-based off-policy responder: the right answer or a uniformly random
    wrong number in [0, 198] (errors the policy never makes); style `padded`
    writes every answer as 3 zero-padded digits (a format the policy never writes)."""
    target = sum(operands(prompt))
    values = [target] * n_correct(rng, n, correct_rate)
    wrong = rng.sample([v for v in range(199) if v != target], n - len(values))
    values += wrong
    rng.shuffle(values)
    fmt = "{:03d}" if style == "padded" else "{:d}"
    return [fmt.format(v) for v in values]
