"""Format rewards of the authors' math recipe (kawine/open-r1-humanline, open-r1's `format` and `tag_count`),
and the weighted sum they train on: 8 x accuracy + 1 x format + 1 x tag_count.

Completion texts in, one float per completion out. The expected shape of a completion is
"<think>\\n" reasoning "\\n</think>\\n<answer>\\n" answer "\\n</answer>" (the system prompt asks for it).
"""
from __future__ import annotations

import re
from collections.abc import Callable

from humanline_cli.schema import REWARD_COMPONENTS

# reasoning and answer may be empty or span lines; "</answer>" must end its line (or the text): what follows
# on later lines is allowed, as in the recipe (a multi-line `$` after the closing tag)
_SHAPE = re.compile(r"<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>(?=\n|\Z)", re.DOTALL)

# tag_count: a quarter for each of these that occurs exactly once
_TAGS = ("<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>")

def format_reward(text: str) -> float:
    """1.0 if the text starts with the think block followed by the answer block (see _SHAPE), else 0.0."""
    return 1.0 if _SHAPE.match(text) else 0.0


def tag_count_reward(text: str) -> float:
    """0.25 per tag in _TAGS that occurs exactly once: a partial credit on the way to the format."""
    return sum((0.25 for tag in _TAGS if text.count(tag) == 1), 0.0)


def weighted(weights: dict[str, float], accuracy: Callable[[list[str], list | None], list[float]]
             ) -> Callable[[list[str], list | None], list[float]]:
    """(completions, answers) -> sum_k weights[k] * reward_k per completion, k in REWARD_COMPONENTS
    (accuracy: `accuracy`, the verifier's 1.0 right / 0.0 wrong); a component is computed only when weighted."""
    def score(completions: list[str], answers: list | None) -> list[float]:
        per_text = {"format": format_reward, "tag_count": tag_count_reward}
        total = [0.0] * len(completions)
        for name in REWARD_COMPONENTS:
            w = weights.get(name, 0.0)
            if not w:
                continue
            rewards = accuracy(completions, answers) if name == "accuracy" else [per_text[name](c) for c in completions]
            total = [t + w * r for t, r in zip(total, rewards)]
        return total

    return score
