"""Reward functions on plain text, for both tasks and both roles.

Consumes prompt CONTENT strings (e.g. `"37+45="`, `"qdka"`) and decoded
completions (special tokens stripped; may be empty or garbage); produces one
float per pair. `score(task, role, ...)` with role `labeller` (what training
may see) or `judge` (held-out evaluation). For arithmetic both are the strict
verifier. For preference the judge is a hidden weighted rubric and the
labeller a correlated but biased proxy (like a reward model vs a GPT judge).
"""

from __future__ import annotations

import hashlib
import re

_ARITH = re.compile(r"^(\d+)\+(\d+)=$")
_NUMBER = re.compile(r"^(0|[1-9][0-9]*)$")
_SPACED = re.compile(r"^[a-z]( [a-z])*$")
_LETTERS_SPACES = re.compile(r"^[a-z ]*$")


def verify(prompt: str, completion: str) -> float:
    """1.0 iff the stripped completion is a+b written normally (no leading zeros)."""
    m = _ARITH.match(prompt.strip())
    text = completion.strip()
    if m is None or _NUMBER.match(text) is None:
        return 0.0
    return float(int(text) == int(m.group(1)) + int(m.group(2)))


def value_correct(prompt: str, completion: str) -> float:
    """Format-blind check (`"082"` counts): labels the offline `padded` style."""
    m = _ARITH.match(prompt.strip())
    text = completion.strip()
    if m is None or not text.isdigit() or len(text) > 6:
        return 0.0
    return float(int(text) == int(m.group(1)) + int(m.group(2)))


def _parts(prompt: str, completion: str) -> dict[str, float]:
    """Criteria in [0, 1] shared by judge and labeller."""
    want = set(prompt.strip())
    ideal_len = max(1, 2 * len(want) - 1)
    text = completion.strip()
    letters = [c for c in text if "a" <= c <= "z"]
    cover = len(set(letters) & want) / max(1, len(want))
    # clean: share of written letters that are prompt letters used once
    seen, good = set(), 0
    for c in letters:
        good += c in want and c not in seen
        seen.add(c)
    clean = good / len(letters) if letters else 0.0
    # order: share of all letter pairs (i < j) in strictly ascending order;
    # squared so that a random arrangement earns little
    mine = [c for c in letters if c in want]
    pairs = [(x, y) for i, x in enumerate(mine) for y in mine[i + 1 :]]
    order = (sum(x < y for x, y in pairs) / len(pairs)) ** 2 if pairs else 0.0
    form = 1.0 if _SPACED.match(text) else (0.3 if text and _LETTERS_SPACES.match(text) else 0.0)
    length = max(0.0, 1.0 - abs(len(text) - ideal_len) / ideal_len)
    # labeller's length bias: more is better, saturating at twice the ideal
    longer = min(len(text), 2 * ideal_len) / (2 * ideal_len)
    return {"cover": cover, "clean": clean, "order": order, "form": form, "length": length, "longer": longer}


# The judge is a strict rubric: criteria multiply, each as (1 - w + w * part)
# ** power, so one badly missed criterion sinks the score (the ideal reply
# scores 1.0, copying the prompt order ~0.4, a foreign letter ~0.1).
JUDGE_CRITERIA = {
    "cover": (1.0, 2),
    "clean": (1.0, 2),
    "order": (0.85, 1),
    "form": (0.4, 1),
    "length": (0.6, 1),
}
# The labeller is additive, so it is lenient: it misses `clean` (repeats and
# foreign letters go unpunished), underweights `order`, prefers long replies
# and adds deterministic noise.
LABELLER_WEIGHTS = {"cover": 0.35, "order": 0.3, "form": 0.1, "longer": 0.25}
LABELLER_NOISE = 0.1


def _noise(prompt: str, completion: str) -> float:
    """Deterministic noise in [-1, 1] from (prompt, completion)."""
    digest = hashlib.blake2b(f"{prompt}\x00{completion}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**63 - 1.0


def judge(prompt: str, completion: str) -> float:
    parts = _parts(prompt, completion)
    out = 1.0
    for k, (w, power) in JUDGE_CRITERIA.items():
        out *= (1.0 - w + w * parts[k]) ** power
    return out


def labeller(prompt: str, completion: str) -> float:
    parts = _parts(prompt, completion)
    raw = sum(w * parts[k] for k, w in LABELLER_WEIGHTS.items())
    return min(1.0, max(0.0, raw + LABELLER_NOISE * _noise(prompt, completion)))


def score(task: str, role: str, prompts: list[str], completions: list[str]) -> list[float]:
    if role not in ("labeller", "judge"):
        raise ValueError(f"role must be 'labeller' or 'judge', not {role!r}")
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    if task == "arithmetic":
        fn = verify
    elif task == "preference":
        fn = judge if role == "judge" else labeller
    else:
        raise ValueError(f"task must be 'arithmetic' or 'preference', not {task!r}")
    return [float(fn(str(p), str(c))) for p, c in zip(prompts, completions)]


def subset(task: str, prompt: str) -> str | None:
    """The subset an eval prompt belongs to, where the task defines subsets (arithmetic: whether any
    column carries inside the operands' width, i.e. the ones digits at two digits); None for tasks without
    subsets."""
    if task != "arithmetic":
        return None
    from humanline_cli.world.arithmetic import carries

    return "carry" if carries(str(prompt)) else "no_carry"
