"""The sampler interface shared by the transformers and vLLM samplers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass
class Completions:
    """n completions per prompt, prompt-major: completion j of prompt i is at i * n + j.

    token_ids end at (and include) the first EOS; a completion that hit max_new_tokens has none.
    logps are the sampler model's raw (temperature-free) per-token log-probs of those ids.
    """

    n: int
    token_ids: list[list[int]]
    logps: list[list[float]]
    texts: list[str]

    @property
    def n_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 16
    seed: int = 0


class Sampler(Protocol):
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Completions: ...

    def push_weights(self, policy) -> None:
        """Make the sampler generate from `policy`'s current weights."""

    def close(self) -> None: ...


def cut_at_eos(ids: list[int], eos_id: int, pad_id: int | None = None) -> list[int]:
    """Keep tokens up to and including the first EOS; drop padding after it."""
    out = []
    for t in ids:
        out.append(t)
        if t == eos_id:
            break
    return out
