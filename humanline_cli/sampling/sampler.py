"""The sampler interface shared by the transformers and vLLM samplers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass
class Completions:
    """n completions per prompt, prompt-major: completion j of prompt i is at i * n + j.

    token_ids end at (and include) the first EOS; a completion that hit max_new_tokens has none.
    logps are the sampler model's per-token log-probs of those ids: raw, log_softmax(logits), or with
    SamplingParams.tempered_logps log_softmax(logits / temperature) (greedy: always raw).
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
    tempered_logps: bool = False  # logps of softmax(logits / temperature) (objective.tempered_logps), else raw


class Sampler(Protocol):
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams,
                 indices: list[int] | None = None) -> Completions:
        """n completions per prompt. Completion j of the prompt whose index (in the whole request, e.g.
        the round's prompt list; default its position here) is i draws its randomness from
        sample_seed(params.seed, i, j) alone, so any split of the prompts over calls or ranks gives
        the same completions as one call."""


    def push_weights(self, policy) -> None:
        """Make the sampler generate from `policy`'s current weights."""

    def sleep(self) -> None:
        """Free what the sampler holds on the accelerator until the next push or generate (vLLM on CUDA)."""

    def close(self) -> None: ...


def cut_at_eos(ids: list[int], eos_id: int, pad_id: int | None = None) -> list[int]:
    """Keep tokens up to and including the first EOS; drop padding after it."""
    out = []
    for t in ids:
        out.append(t)
        if t == eos_id:
            break
    return out


_MASK63 = (1 << 63) - 1


def sample_seed(seed: int, index: int, sample: int) -> int:
    """A 63-bit seed for completion `sample` of prompt `index` under base seed `seed` (a splitmix64
    finaliser over the three numbers): distinct inputs give unrelated streams, and the seed does not
    depend on which other prompts share the call or the rank."""
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + sample * 0x94D049BB133111EB) & (2**64 - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 31)) & _MASK63
