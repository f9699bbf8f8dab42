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

from humanline_cli.backend import wait_for_rank0
from humanline_cli.core.interfaces import SamplingParams
from humanline_cli.rewards.scorers import checked
from humanline_cli.sources.source import Shard

TIE_TOL = 1e-9


def outcome_ci(outcomes: list[float]) -> tuple[float, tuple[float, float]]:
    """Mean per-prompt outcome (o_i in {0, 1/2, 1}) with a 95% normal-approximation CI:
    mean +- 1.96 * sd / sqrt(n), sd with ddof=1, clipped to [0, 1]."""
    n = len(outcomes)
    if n == 0:
        return math.nan, (math.nan, math.nan)
    mean = sum(outcomes) / n
    sd = math.sqrt(sum((o - mean) ** 2 for o in outcomes) / (n - 1)) if n > 1 else 0.0
    half = 1.96 * sd / math.sqrt(n)
    return mean, (max(0.0, mean - half), min(1.0, mean + half))


def win_rate(scores_a: list[float], scores_b: list[float]) -> tuple[float, tuple[float, float], list[float]]:
    """Win rate of a over b from pointwise judge scores, ties counted half, with outcome_ci's CI."""
    outcomes = [1.0 if a > b + TIE_TOL else 0.0 if b > a + TIE_TOL else 0.5 for a, b in zip(scores_a, scores_b)]
    mean, ci = outcome_ci(outcomes)
    return mean, ci, outcomes


@dataclass
class Side:
    texts: list[str]
    scores: list[float] | None  # None under a pairwise judge (it scores pairs, not replies)
    token_ids: list[list[int]] | None = None  # the replies' tokens where they were sampled here (not restored)


class Evaluator:
    """`judge` is a pointwise scorer (name, fn(prompts, replies, answers) -> scores) or, with
    `pairwise`, an LLM judge (rewards/llm_judge.py, rewards/alpaca.py): its `name`, and compare(prompts, replies_a,
    replies_b) giving a result with per-pair `outcomes`, `totals()`, `sections()` and `save(samples_path)`.
    `tempered_logps`: the run's log-prob mode (objective.tempered_logps), which a vLLM engine fixes at start
    and checks on every request; the evaluation reads only texts, so it asks for the engine's mode."""

    def __init__(self, rows: list[dict], encoder, judge, cfg, verifiable: bool, seed: int, pairwise=None,
                 subsets: list[str | None] | None = None, shard: Shard = Shard(), tempered_logps: bool = False):
        self.shard = shard  # under DDP/FSDP: this rank's place (generation is sharded, rank 0 judges)
        self.prompts = [r["prompt"] for r in rows]
        self.answers = [r.get("answer") for r in rows] if any("answer" in r for r in rows) else None
        self.prompt_text = [encoder.prompt_text(p) for p in self.prompts]
        self.prompt_ids = [encoder.prompt_ids(p, f"eval prompt {i + 1}") for i, p in enumerate(self.prompts)]
        self.pairwise = pairwise
        self.judge_name, self.judge = judge if pairwise is None else (pairwise.name, None)
        self.params = SamplingParams(n=1, temperature=cfg.temperature, top_p=cfg.top_p,
                                     max_new_tokens=cfg.max_new_tokens, seed=seed + 99991, tempered_logps=tempered_logps)
        self.verifiable = verifiable and pairwise is None
        self.baseline: Side | None = None
        # greedy next to sampled (pointwise judges only: an LLM judge would pay twice)
        self.greedy_params = None
        if cfg.greedy and cfg.temperature > 0 and pairwise is None:
            self.greedy_params = SamplingParams(n=1, temperature=0.0, top_p=1.0, max_new_tokens=cfg.max_new_tokens,
                                                seed=seed + 99991)
        self.greedy_baseline: Side | None = None
        self.subsets = subsets if subsets and any(s is not None for s in subsets) else None
        # measures against a frozen starting model (eval/start_checks.StartChecks), attached once the policy exists
        self.start_checks = None

    def sample(self, sampler, params: SamplingParams | None = None) -> Side:
        """Each rank generates its share of the prompts (seeds per prompt index: the same replies as one
        process), the replies are gathered in prompt order, rank 0 alone judges them and every rank gets
        the scores (a reward model or an API judge runs once, not once per rank)."""
        mine = self.shard.share(len(self.prompt_ids))
        out = sampler.generate([self.prompt_ids[i] for i in mine], params or self.params, indices=mine)
        texts = [t for part in self.shard.gather(out.texts) for t in part]  # contiguous shares, rank order
        if self.pairwise is not None:
            return Side(texts, None)
        scores = checked(self.judge_name, self.judge, self.prompt_text, texts, self.answers) \
            if self.shard.rank == 0 else None
        wait_for_rank0()  # the other ranks wait for the judge outside the training group's timeout
        tokens = out.token_ids if self.shard.world_size == 1 else None  # start checks run in one process only
        return Side(texts, self.shard.gather(scores)[0], tokens)

    def set_baseline(self, sampler) -> None:
        self.baseline = self.sample(sampler)
        if self.greedy_params is not None:
            self.greedy_baseline = self.sample(sampler, self.greedy_params)

    def set_baseline_texts(self, texts: list[str]) -> None:
        """A baseline given as replies (e.g. a benchmark's reference outputs), one per eval prompt; scored
        by a pointwise judge like sampled ones. A file has one reply per prompt: no greedy comparison."""
        if len(texts) != len(self.prompt_text):
            raise ValueError(f"{len(texts)} baseline replies for {len(self.prompt_text)} prompts")
        scores = None
        if self.pairwise is None:
            scores = checked(self.judge_name, self.judge, self.prompt_text, texts, self.answers) \
                if self.shard.rank == 0 else None
            wait_for_rank0()
            scores = self.shard.gather(scores)[0]
        self.baseline, self.greedy_params, self.greedy_baseline = Side(list(texts), scores), None, None

    def evaluate(self, sampler, samples_path: Path | None = None) -> dict:
        """The main result (eval.temperature) at the top level, as the summary contract has it, and
        the same numbers under `sampled` and, with eval.greedy, `greedy`; per-subset where the task
        defines subsets."""
        side = self.sample(sampler)
        if self.pairwise is not None:  # rank 0 calls the judge (minutes of API calls); every rank returns its result
            result = self._pairwise(side, samples_path) if self.shard.rank == 0 else None
            wait_for_rank0()
            return self.shard.gather(result)[0]
        result = self._pointwise(side, self.baseline, samples_path, self.params.temperature)
        if self.start_checks is not None:  # the sampled replies: the KL's estimate needs draws from the policy
            result.update(self.start_checks.measure(self.prompt_ids, self.prompt_text, side.token_ids, side.texts,
                                                    self.baseline.texts))
        result["sampled"] = self._mode_summary(result, side, self.baseline)
        if self.greedy_params is not None:
            if self.greedy_baseline is None:  # a baseline restored without its greedy half
                raise RuntimeError("greedy baseline missing")
            g_side = self.sample(sampler, self.greedy_params)
            # per-prompt greedy scores too, for the report's prompt x seed bootstrap
            g = self._pointwise(g_side, self.greedy_baseline,
                                samples_path.with_name("eval_samples_greedy.jsonl") if samples_path else None, 0.0)
            result["greedy"] = self._mode_summary(g, g_side, self.greedy_baseline)
        return result

    def _mode_summary(self, r: dict, side: Side, base: Side) -> dict:
        out = {k: r[k] for k in ("win_rate", "win_rate_ci", "reward_mean", "start_reward_mean", "accuracy",
                                 "start_accuracy", "temperature")}
        if self.subsets is not None:
            out["subsets"] = {}
            for name in sorted({s for s in self.subsets if s is not None}):
                idx = [i for i, s in enumerate(self.subsets) if s == name]
                mean = sum(side.scores[i] for i in idx) / len(idx)
                start = sum(base.scores[i] for i in idx) / len(idx)
                key = "accuracy" if self.verifiable else "reward_mean"
                out["subsets"][name] = {"n": len(idx), key: mean, f"start_{key}": start}
        return out

    def _pointwise(self, side: Side, base: Side, samples_path: Path | None, temperature: float) -> dict:
        wr, ci, outcomes = win_rate(side.scores, base.scores)
        n = len(side.scores)
        mean = sum(side.scores) / n
        base_mean = sum(base.scores) / n
        result = {
            "n_prompts": n,
            "win_rate": wr,
            "win_rate_ci": list(ci),
            "reward_mean": mean,
            "start_reward_mean": base_mean,
            "accuracy": mean if self.verifiable else None,
            "start_accuracy": base_mean if self.verifiable else None,
            "judge": self.judge_name,
            "temperature": temperature,
        }
        if samples_path is not None:
            with open(samples_path, "w") as f:
                for i in range(n):
                    f.write(json.dumps({"prompt": self.prompt_text[i], "policy": side.texts[i],
                                        "policy_score": side.scores[i], "start": base.texts[i],
                                        "start_score": base.scores[i], "outcome": outcomes[i]}) + "\n")
        return result

    def _pairwise(self, side: Side, samples_path: Path | None) -> dict:
        """LLM judge: A = the trained policy, B = the start; unparsable pairs are counted, not tied."""
        res = self.pairwise.compare(self.prompt_text, side.texts, self.baseline.texts)
        got = [o for o in res.outcomes if o is not None]
        wr, ci = outcome_ci(got)
        result = {
            "n_prompts": len(side.texts),
            "win_rate": wr if got else None,
            "win_rate_ci": list(ci) if got else [None, None],
            "reward_mean": None,
            "start_reward_mean": None,
            "accuracy": None,
            "start_accuracy": None,
            "judge": self.judge_name,
            "temperature": self.params.temperature,
            "judge_usage": res.totals(),
            **res.sections(),  # judge=alpaca_eval: its WR and LC
        }
        if samples_path is not None:
            res.save(samples_path)  # judge=alpaca_eval: its own annotations file, next to the samples
        if samples_path is not None:
            with open(samples_path, "w") as f:
                for i, rec in enumerate(res.records):
                    f.write(json.dumps({"prompt": self.prompt_text[i], "policy": side.texts[i],
                                        "start": self.baseline.texts[i], "outcome": res.outcomes[i],
                                        "judge": rec}) + "\n")
        return result


def flat_metrics(ev: dict, prefix: str = "eval/") -> dict:
    """Numbers of an evaluation result, nested keys joined with '/', for metrics.jsonl and wandb."""
    out = {}
    for k, v in ev.items():
        if isinstance(v, dict):
            out.update(flat_metrics(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"{prefix}{k}"] = v
    return out
