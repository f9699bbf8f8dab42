"""Benchmark accuracy of the trained policy on math problems with reference answers (MATH-500 for the math
recipe): `eval.math500.*` in summary.json.

Per problem i (N problems), a greedy completion g_i and n completions s_i1..s_in at eval.math500.temperature;
each scored c = 1 if math-verify finds the reference answer's value in it, else 0 (rewards/verifier.py, the
same verifier the math task trains and judges with):

    greedy_accuracy  = (1/N) sum_i c(g_i)
    sampled_accuracy = (1/N) sum_i (1/n) sum_j c(s_ij)          (= pass@1, the unbiased estimate from n samples)
    pass_at_n        = (1/N) sum_i [max_j c(s_ij) = 1]
    *_se             = sd over problems of the per-problem score (ddof 1) / sqrt(N)

A completion from which math-verify extracts no answer at all counts as wrong and is counted in
*_n_unparsed (a model that never writes a final answer shows there, not as a silent 0).
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

from humanline_cli.backend import wait_for_rank0
from humanline_cli.core.interfaces import SamplingParams
from humanline_cli.errors import UserError
from humanline_cli.rewards.verifier import math_verdicts
from humanline_cli.sources.source import Shard

SEED_OFFSET = 7919  # the benchmark's sampling seeds differ from the main evaluation's (seed + 99991)


def load_problems(rows: list[dict], where: Callable[[int], str], cfg) -> tuple[list[str], list[str]]:
    """(user messages, reference answers) from the rows; a row without the problem or answer column (or with
    an empty one) is one error naming its file and line."""
    prompts, answers = [], []
    for i, row in enumerate(rows):
        for key, col in (("problem_column", cfg.problem_column), ("answer_column", cfg.answer_column)):
            value = row.get(col)
            if value is None or (isinstance(value, str) and not value.strip()):
                what = "no field" if col not in row else "an empty field"
                raise UserError(f"{where(i)}: {what} {col!r} (eval.math500.{key}; the row has {sorted(row)})")
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise UserError(f"{where(i)}: field {col!r} must be text or a number, got {type(value).__name__}")
        prompts.append(cfg.template.replace("{problem}", str(row[cfg.problem_column])))
        answers.append(str(row[cfg.answer_column]))
    return prompts, answers


def _mean_se(xs: list[float]) -> tuple[float, float]:
    n = len(xs)
    mean = sum(xs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    return mean, sd / math.sqrt(n)


class Math500Eval:
    """`cfg` is schema.Math500Config; `max_new_tokens` its resolved budget (eval.max_new_tokens when unset).
    Under DDP/FSDP (`shard`) each rank generates its share of the problems, rank 0 scores, every rank
    returns the result (as the main Evaluator does). `tempered_logps`: the run's log-prob mode, which a vLLM
    engine fixes at start and checks on every sampled request (only texts are read here)."""

    def __init__(self, prompts: list[str], answers: list[str], where: Callable[[int], str], encoder, cfg,
                 max_new_tokens: int, seed: int, source: str, shard: Shard = Shard(), tempered_logps: bool = False):
        self.prompts, self.answers, self.cfg, self.source, self.shard = prompts, answers, cfg, source, shard
        self.prompt_ids = [encoder.prompt_ids(p, where(i)) for i, p in enumerate(prompts)]
        seed = seed + SEED_OFFSET
        self.greedy = SamplingParams(n=1, temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens, seed=seed) \
            if cfg.greedy else None
        self.sampled = SamplingParams(n=cfg.n_samples, temperature=cfg.temperature, top_p=cfg.top_p,
                                      max_new_tokens=max_new_tokens, seed=seed,
                                      tempered_logps=tempered_logps) if cfg.n_samples > 0 else None

    def _generate(self, sampler, params: SamplingParams) -> list[str]:
        """params.n texts per problem, problem-major, in problem order on every rank."""
        mine = self.shard.share(len(self.prompt_ids))
        out = sampler.generate([self.prompt_ids[i] for i in mine], params, indices=mine)
        return [t for part in self.shard.gather(out.texts) for t in part]  # contiguous shares, rank order

    def evaluate(self, sampler, samples_path: Path | None = None) -> dict:
        greedy = self._generate(sampler, self.greedy) if self.greedy is not None else None
        sampled = self._generate(sampler, self.sampled) if self.sampled is not None else None
        result = self._score(greedy, sampled, samples_path) if self.shard.rank == 0 else None
        wait_for_rank0()  # math-verify over every completion runs on rank 0 alone
        return self.shard.gather(result)[0]

    def _score(self, greedy: list[str] | None, sampled: list[str] | None, samples_path: Path | None) -> dict:
        N, c = len(self.prompts), self.cfg
        result = {"prompts": self.source, "n": N, "max_new_tokens": (self.greedy or self.sampled).max_new_tokens,
                  "greedy_accuracy": None, "greedy_accuracy_se": None, "greedy_n_unparsed": None,
                  "sampled_accuracy": None, "sampled_accuracy_se": None, "sampled_n_unparsed": None,
                  "pass_at_1": None, "pass_at_n": None, "n_samples": c.n_samples,
                  "temperature": c.temperature if c.n_samples else None, "top_p": c.top_p if c.n_samples else None}
        g_scores = g_parsed = s_scores = s_parsed = None
        if greedy is not None:
            g_scores, g_parsed = math_verdicts(greedy, self.answers)
            mean, se = _mean_se(g_scores)
            result.update(greedy_accuracy=mean, greedy_accuracy_se=se, greedy_n_unparsed=g_parsed.count(False))
        if sampled is not None:
            n = c.n_samples
            s_scores, s_parsed = math_verdicts(sampled, [a for a in self.answers for _ in range(n)])
            per = [sum(s_scores[i * n:(i + 1) * n]) / n for i in range(N)]
            mean, se = _mean_se(per)
            result.update(sampled_accuracy=mean, sampled_accuracy_se=se, sampled_n_unparsed=s_parsed.count(False),
                          pass_at_1=mean, pass_at_n=sum(p > 0 for p in per) / N)
        result["n_unparsed"] = (result["greedy_n_unparsed"] or 0) + (result["sampled_n_unparsed"] or 0)
        if samples_path is not None:
            n = c.n_samples
            with open(samples_path, "w") as f:
                for i in range(N):
                    rec = {"prompt": self.prompts[i], "answer": self.answers[i]}
                    if greedy is not None:
                        rec.update(greedy=greedy[i], greedy_correct=g_scores[i], greedy_parsed=g_parsed[i])
                    if sampled is not None:
                        rec.update(samples=sampled[i * n:(i + 1) * n], correct=s_scores[i * n:(i + 1) * n],
                                   parsed=s_parsed[i * n:(i + 1) * n])
                    f.write(json.dumps(rec) + "\n")
        return result


def summary_text(m: dict) -> str:
    """`greedy 0.625 (1 unparsed), sampled 0.641 ± 0.050 (4 x 8 at T 0.7, pass@4 0.750, 3 unparsed)`."""
    parts = []
    if m.get("greedy_accuracy") is not None:
        parts.append(f"greedy {m['greedy_accuracy']:.3f} ({m['greedy_n_unparsed']} unparsed)")
    if m.get("sampled_accuracy") is not None:
        parts.append(f"sampled {m['sampled_accuracy']:.3f} ± {m['sampled_accuracy_se']:.3f} ({m['n_samples']} x "
                     f"{m['n']} at T {m['temperature']:g}, pass@{m['n_samples']} {m['pass_at_n']:.3f}, "
                     f"{m['sampled_n_unparsed']} unparsed)")
    return ", ".join(parts)


def summary_line(m: dict) -> str:
    return f"math500 ({m['n']} problems from {m['prompts']}): {summary_text(m)}"
