"""Held-out evaluation: sample the trained and the starting policy on the same prompts, score both
with the task's judge, report the task metric and the win rate (ties = 1/2) with a 95% CI.

The starting policy is sampled once at setup (before training changes the weights), so no second
copy of a large model is needed at the end.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from .rewards.build import checked
from .sampling.base import SamplingParams

TIE_TOL = 1e-9


def win_rate(scores_a: list[float], scores_b: list[float]) -> tuple[float, tuple[float, float], list[float]]:
    """Win rate of a over b, ties counted half, with a 95% normal-approximation CI on the mean
    per-prompt outcome (o_i in {0, 1/2, 1}): mean +- 1.96 * sd / sqrt(n), sd with ddof=1, clipped to [0, 1]."""
    outcomes = [1.0 if a > b + TIE_TOL else 0.0 if b > a + TIE_TOL else 0.5 for a, b in zip(scores_a, scores_b)]
    n = len(outcomes)
    mean = sum(outcomes) / n
    sd = math.sqrt(sum((o - mean) ** 2 for o in outcomes) / (n - 1)) if n > 1 else 0.0
    half = 1.96 * sd / math.sqrt(n)
    return mean, (max(0.0, mean - half), min(1.0, mean + half)), outcomes


@dataclass
class Side:
    texts: list[str]
    scores: list[float]


class Evaluator:
    def __init__(self, rows: list[dict], encoder, judge, cfg, verifiable: bool, seed: int):
        self.prompts = [r["prompt"] for r in rows]
        self.answers = [r.get("answer") for r in rows] if any("answer" in r for r in rows) else None
        self.prompt_text = [encoder.prompt_text(p) for p in self.prompts]
        self.prompt_ids = [encoder.prompt_ids(p, f"eval prompt {i + 1}") for i, p in enumerate(self.prompts)]
        self.judge_name, self.judge = judge
        self.params = SamplingParams(n=1, temperature=cfg.temperature, top_p=cfg.top_p,
                                     max_new_tokens=cfg.max_new_tokens, seed=seed + 99991)
        self.verifiable = verifiable
        self.baseline: Side | None = None

    def sample(self, sampler) -> Side:
        out = sampler.generate(self.prompt_ids, self.params)
        scores = checked(self.judge_name, self.judge, self.prompt_text, out.texts, self.answers)
        return Side(out.texts, scores)

    def set_baseline(self, sampler) -> None:
        self.baseline = self.sample(sampler)

    def evaluate(self, sampler, samples_path: Path | None = None) -> dict:
        side = self.sample(sampler)
        wr, ci, outcomes = win_rate(side.scores, self.baseline.scores)
        n = len(side.scores)
        mean = sum(side.scores) / n
        base_mean = sum(self.baseline.scores) / n
        result = {
            "n_prompts": n,
            "win_rate": wr,
            "win_rate_ci": list(ci),
            "reward_mean": mean,
            "start_reward_mean": base_mean,
            "accuracy": mean if self.verifiable else None,
            "start_accuracy": base_mean if self.verifiable else None,
            "judge": self.judge_name,
            "temperature": self.params.temperature,
        }
        if samples_path is not None:
            with open(samples_path, "w") as f:
                for i in range(n):
                    f.write(json.dumps({"prompt": self.prompt_text[i], "policy": side.texts[i],
                                        "policy_score": side.scores[i], "start": self.baseline.texts[i],
                                        "start_score": self.baseline.scores[i], "outcome": outcomes[i]}) + "\n")
        return result
