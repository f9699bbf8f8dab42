"""The unverifiable, graded task: "sort my letters".

Consumes a `random.Random`; produces prompts (3-5 distinct lowercase letters
in random order, e.g. `"qdka"`), the noisy SFT teacher's replies and the
off-policy "other model"'s replies. The ideal reply is the letters in
alphabetical order separated by single spaces (`"a d k q"`), but only the
hidden judge in `rewards.py` knows that; the labeller is a biased proxy.
"""

from __future__ import annotations

import random
import string

LETTERS = string.ascii_lowercase


def random_prompt(rng: random.Random) -> str:
    return "".join(rng.sample(LETTERS, rng.randint(3, 5)))


def split_prompts(rng: random.Random, n_train: int, n_eval: int) -> tuple[list[str], list[str], set[str]]:
    """(train, eval, banned): prompts are drawn fresh; eval ones are banned
    from SFT and offline data. Letter *sets* are held out, not just strings."""
    eval_, seen = [], set()
    while len(eval_) < n_eval:
        p = random_prompt(rng)
        if "".join(sorted(p)) not in seen:
            seen.add("".join(sorted(p)))
            eval_.append(p)
    train, tseen = [], set()
    while len(train) < n_train:
        p = random_prompt(rng)
        key = "".join(sorted(p))
        if key not in seen and key not in tseen:
            tseen.add(key)
            train.append(p)
    return train, eval_, seen


def ideal(prompt: str) -> str:
    return " ".join(sorted(prompt))


def _foreign(rng: random.Random, prompt: str) -> str:
    return rng.choice([c for c in LETTERS if c not in prompt])


def teacher(rng: random.Random, prompt: str) -> str:
    """Noisy teacher: a mixture of plausible habits, most of them flawed.
    Copying the prompt order is its most common habit, so greedy decoding
    tends to copy while sampling still finds the sorted reply."""
    letters = list(prompt)
    srt = sorted(letters)
    u = rng.random()
    # copy-order habits (55%) open with the prompt's first letter, sorted
    # habits (45%) with its smallest, so greedy decoding mostly copies
    if u < 0.35:  # copies the prompt order
        return " ".join(letters)
    if u < 0.47:  # copies, one letter swapped for a foreign one
        letters[rng.randrange(len(letters))] = _foreign(rng, prompt)
        return " ".join(letters)
    if u < 0.55:  # copies, run together
        return "".join(letters)
    if u < 0.75:  # the ideal reply
        return " ".join(srt)
    if u < 0.85:  # sorted but run together
        return "".join(srt)
    if u < 0.93:  # sorted, forgets one letter (not the first: keeps the opening habit)
        srt.pop(rng.randrange(1, len(srt)))
        return " ".join(srt)
    # sorted with a letter repeated (long: the labeller likes it, the judge does not)
    i = rng.randrange(len(srt))
    return " ".join(srt[: i + 1] + [srt[i]] + srt[i + 1 :])


def other_model(rng: random.Random, prompt: str, n: int, correct_rate: float, style: str) -> list[str]:
    """Rule-based off-policy responder: the ideal reply (present in a prompt's
    set with probability min(1, n * correct_rate), as for arithmetic) or a
    random scramble: a random subset of the prompt letters plus up to two
    foreign ones, shuffled. Style `padded` separates letters with ", "."""
    from humanline_cli.world.arithmetic import n_correct

    sep = ", " if style == "padded" else " "
    out = [sep.join(sorted(prompt))] * n_correct(rng, n, correct_rate)
    while len(out) < n:
        picks = rng.sample(prompt, rng.randint(1, len(prompt)))
        picks += [_foreign(rng, prompt) for _ in range(rng.randint(0, 2))]
        rng.shuffle(picks)
        reply = sep.join(picks)
        if reply not in out and reply != sep.join(sorted(prompt)):
            out.append(reply)
    rng.shuffle(out)
    return out
