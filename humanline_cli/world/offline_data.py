"""Off-policy offline data from an "other model": rule-based or a second tiny policy.

Consumes the task name, the resolved `offline` cfg and the training prompts,
plus a seeded `random.Random` (source `rule`, `records`) or the replies
sampled from the other policy (source `model`, `model_records`; the sampling
lives in `make.sample_distinct`); produces the records of
`offline_pairs.jsonl`, `offline_groups.jsonl` and `offline_unpaired.jsonl`
(chat-message format). Both sources go through `assemble`, so they share the
labelling, pairing, grouping and unpaired logic.

Each prompt gets `n_per_prompt` replies (distinct for `rule`, distinct where
the other policy's samples allow for `model`), scored by the task's LABELLER
(never the judge):
- arithmetic: the strict verifier for style `plain`; for style `padded` the
  value check (`"082"` counts), since the strict verifier would score every
  padded reply 0 and leave nothing to learn from the shift;
- preference: `rewards.labeller`.
Pairs: one per prompt, chosen = the highest score, rejected = the lowest
(ties keep the other model's order and are still written; with the defaults
rule-based arithmetic never ties). Unpaired: every reply, desirable iff its
score is above its prompt's mean, or, when all tie, iff score >= 0.5.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path

from humanline_cli.world import arithmetic, preference, rewards


def _label_fn(task: str, style: str):
    if task == "arithmetic":
        return rewards.value_correct if style == "padded" else rewards.verify
    return rewards.labeller


def _user(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def _assistant(content: str) -> list[dict]:
    return [{"role": "assistant", "content": content}]


def prompt_records(prompt: str, replies: list[str], scores: list[float]) -> tuple[dict, dict, list[dict]]:
    """One prompt's (pair, group, unpaired rows) from its replies and their labeller scores."""
    best = max(range(len(replies)), key=lambda i: (scores[i], -i))
    worst = min(range(len(replies)), key=lambda i: (scores[i], i == best))
    pair = {
        "prompt": _user(prompt),
        "chosen": _assistant(replies[best]),
        "rejected": _assistant(replies[worst]),
        "score_chosen": scores[best],
        "score_rejected": scores[worst],
    }
    group = {"prompt": _user(prompt), "completions": [_assistant(r) for r in replies], "rewards": scores}
    mean, tied = sum(scores) / len(scores), len(set(scores)) == 1
    unpaired = [
        {"prompt": _user(prompt), "completion": _assistant(r), "label": bool(s >= 0.5 if tied else s > mean)}
        for r, s in zip(replies, scores)
    ]
    return pair, group, unpaired


def assemble(task: str, style: str, replies: Iterable[tuple[str, list[str]]]) -> dict[str, list[dict]]:
    """The three offline files' records from (prompt, replies) in order, labelled by the task's
    labeller (`style` picks arithmetic's). `replies` is consumed lazily, one prompt at a time."""
    label = _label_fn(task, style)
    pairs, groups, unpaired = [], [], []
    for prompt, texts in replies:
        pair, group, rows = prompt_records(prompt, texts, [float(label(prompt, r)) for r in texts])
        pairs.append(pair)
        groups.append(group)
        unpaired += rows
    return {"offline_pairs.jsonl": pairs, "offline_groups.jsonl": groups, "offline_unpaired.jsonl": unpaired}


def records(task: str, ocfg: dict, prompts: list[str], rng: random.Random) -> dict[str, list[dict]]:
    """Source `rule`: the task's rule-based `other_model`, drawing from `rng` prompt by prompt."""
    other = arithmetic.other_model if task == "arithmetic" else preference.other_model
    n, rate, style = int(ocfg["n_per_prompt"]), float(ocfg["correct_rate"]), ocfg["style"]
    return assemble(task, style, ((p, other(rng, p, n, rate, style)) for p in prompts))


def model_records(task: str, prompts: list[str], replies: list[list[str]]) -> dict[str, list[dict]]:
    """Source `model`: replies sampled from the other policy, one list per prompt (style `plain`)."""
    if len(prompts) != len(replies):
        raise ValueError(f"{len(prompts)} prompts but {len(replies)} reply lists")
    return assemble(task, "plain", zip(prompts, replies))


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def prompt_rows(prompts: list[str]) -> list[dict]:
    return [{"prompt": _user(p)} for p in prompts]
