"""Off-policy offline data from a rule-based "other model".

Consumes the task name, the resolved `offline` cfg, the training prompts and
a seeded `random.Random`; produces the records of `offline_pairs.jsonl`,
`offline_groups.jsonl` and `offline_unpaired.jsonl` (chat-message format).

Each prompt gets `n_per_prompt` distinct replies from the task's
`other_model`, scored by the task's LABELLER (never the judge):
- arithmetic: the strict verifier for style `plain`; for style `padded` the
  value check (`"082"` counts), since the strict verifier would score every
  padded reply 0 and leave nothing to learn from the shift;
- preference: `rewards.labeller`.
Pairs: one per prompt, chosen = the highest score, rejected = the lowest
(ties keep the other model's order and are still written; with the defaults
arithmetic never ties). Unpaired: every reply, desirable iff its score is
above its prompt's mean, or, when all tie, iff score >= 0.5.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from . import arithmetic, preference, rewards


def _label_fn(task: str, style: str):
    if task == "arithmetic":
        return rewards.value_correct if style == "padded" else rewards.verify
    return rewards.labeller


def _user(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def _assistant(content: str) -> list[dict]:
    return [{"role": "assistant", "content": content}]


def records(task: str, ocfg: dict, prompts: list[str], rng: random.Random) -> dict[str, list[dict]]:
    other = arithmetic.other_model if task == "arithmetic" else preference.other_model
    label = _label_fn(task, ocfg["style"])
    pairs, groups, unpaired = [], [], []
    for prompt in prompts:
        replies = other(rng, prompt, int(ocfg["n_per_prompt"]), float(ocfg["correct_rate"]), ocfg["style"])
        scores = [float(label(prompt, r)) for r in replies]
        best = max(range(len(replies)), key=lambda i: (scores[i], -i))
        worst = min(range(len(replies)), key=lambda i: (scores[i], i == best))
        pairs.append(
            {
                "prompt": _user(prompt),
                "chosen": _assistant(replies[best]),
                "rejected": _assistant(replies[worst]),
                "score_chosen": scores[best],
                "score_rejected": scores[worst],
            }
        )
        groups.append(
            {"prompt": _user(prompt), "completions": [_assistant(r) for r in replies], "rewards": scores}
        )
        mean, tied = sum(scores) / len(scores), len(set(scores)) == 1
        for r, s in zip(replies, scores):
            unpaired.append(
                {
                    "prompt": _user(prompt),
                    "completion": _assistant(r),
                    "label": bool(s >= 0.5 if tied else s > mean),
                }
            )
    return {"offline_pairs.jsonl": pairs, "offline_groups.jsonl": groups, "offline_unpaired.jsonl": unpaired}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def prompt_rows(prompts: list[str]) -> list[dict]:
    return [{"prompt": _user(p)} for p in prompts]
