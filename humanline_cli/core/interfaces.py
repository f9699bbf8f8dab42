"""The contracts between the training loop and its parts, and the data types that cross them:

- `Reference`: what log-ratios are measured against (core/reference.py: a frozen copy, two LoRA kinds, a cache
  around a fixed one);
- `Source`: where each optimizer step's micro-batches come from (sources/: offline files, online rounds);
  `StepData` is one step of it;
- `Sampler`: what generates completions (sampling/: transformers, vLLM; world/: a frozen sampler for the
  bundled world's offline data); `SamplingParams` in, `Completions` out.

The loop, the checkpoint and the builder call these methods and nothing else of their parts (no probing).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from humanline_cli.core.batches import Seqs


class Reference(Protocol):
    model: torch.nn.Module  # the module its log-probs run through (its own copy, or a LoRA policy's peft model)

    def logps(self, seqs: Seqs) -> torch.Tensor:
        """(N, T-1) per-token log-probs of `seqs`, without gradient."""

    def sync(self, policy: torch.nn.Module) -> None:
        """Take the policy's weights (humanline sync, online round reset); a reference that cannot move raises."""

    def mix(self, policy: torch.nn.Module, alpha: float) -> None:
        """ref <- alpha * policy + (1 - alpha) * ref (correction=trdpo); only a full frozen copy can, others raise."""

    def n_params(self) -> int:
        """Parameters the reference adds to the run (0: none of its own)."""

    def step_stats(self) -> dict:
        """Metrics it adds to each logged step ({}: none; the log-prob cache: its hit fraction since the last call)."""


@dataclass
class StepData:
    micro_batches: list            # batches for one optimizer step
    new_round: bool = False        # online: the first step of a sampling round
    # online: the round's completion tokens per optimizer step it serves (objective.aggregation=dapo divides by it)
    round_tokens_per_step: float | None = None
    info: dict = field(default_factory=dict)


class Source(Protocol):
    def next_step(self, step: int) -> StepData: ...

    def describe(self) -> str: ...

    def state_dict(self) -> dict:
        """Everything a resumed run needs to continue the same stream of steps (checkpoints)."""

    def load_state_dict(self, state: dict) -> None: ...

    def sample_tokens_per_s(self) -> float | None:
        """Generated tokens per second of sampling so far (None: the source samples nothing, or not yet)."""

    def close(self) -> None: ...


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
