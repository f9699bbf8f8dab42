"""task=chat_sentiment: lexicon scorers (VADER trains, AFINN judges) and the generated prompts, then a tiny
online GRPO run end to end whose round scores are VADER's and whose evaluation is AFINN's win rate against the
starting policy, and experiment=smollm2_sentiment_pairs' DPO on the starting policy's own best-vs-worst
replies."""
from __future__ import annotations

import json

import numpy as np
import pytest

from humanline_cli.errors import UserError
from humanline_cli.rewards.lexicon import afinn, scorer, vader
from humanline_cli.rewards.scorers import make_scorer
from humanline_cli.world import chat_sentiment, generated
from tests.helpers.cli import run_cli
from tests.helpers.models import build_tiny_qwen, build_tiny_sentiment_llama


def test_afinn_is_the_mean_word_valence_and_vader_reads_negation():
    # AFINN-111: good +3, bad -3, love +3; 5 words, (3 + 3) / 5 = 1.2; 3 words, (3 - 3) / 3 = 0
    assert afinn("good people love this place") == pytest.approx(6 / 5)
    assert afinn("good but bad") == 0.0 and afinn("") == 0.0 and afinn("the table") == 0.0
    assert vader("") == 0.0 and -1.0 <= vader("I hate this awful day") < 0 < vader("What a lovely day!") <= 1.0
    assert vader("This is not good.") < 0 < vader("This is good.")  # VADER's negation rule
    # AFINN lists the phrase "not good" at -2: -2 / 4 words; "good" alone +3 / 3 words
    assert (afinn("This is not good."), afinn("This is good.")) == (pytest.approx(-0.5), pytest.approx(1.0))


def test_make_scorer_names_the_lexicon_and_scores_chat_messages():
    name, score = make_scorer({"kind": "lexicon", "lexicon": "afinn"}, key="task.judge")
    assert name == "lexicon:afinn"
    assert score(["p", "p"], ["good good", [{"role": "assistant", "content": "bad"}]]) == [3.0, -3.0]
    with pytest.raises(UserError, match="unknown lexicon"):
        scorer("sentiwordnet")


def test_chat_sentiment_prompts_are_seeded_disjoint_and_bounded(tmp_path):
    cfg = {"kind": "chat_sentiment", "n_train": 120, "n_eval": 40, "seed": 0, "digits": 2, "op": "add"}
    train, eval_ = chat_sentiment.generate(cfg)
    assert (len(train), len(eval_)) == (120, 40) and chat_sentiment.generate(cfg) == (train, eval_)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in eval_}
    assert chat_sentiment.generate({**cfg, "seed": 1}) != (train, eval_)
    d = generated.materialise(cfg, tmp_path)
    assert d.name.startswith("chat_sentiment-") and (d / "prompts_eval.jsonl").read_text().count("\n") == 40
    with pytest.raises(UserError, match="160 distinct"):
        chat_sentiment.check({**cfg, "n_train": 121})


def test_chat_sentiment_trains_on_vader_and_is_judged_by_afinn(tmp_path):
    policy, _ = build_tiny_qwen(tmp_path / "models")
    run = tmp_path / "run"
    r = run_cli(["train", "task=chat_sentiment", "objective=grpo", "data=online", f"model.name_or_path={policy}",
                 f"world_cache={tmp_path / 'cache'}", "task.generator.n_train=16", "task.generator.n_eval=8",
                 "data.prompts_per_round=4", "data.n=2", "data.max_new_tokens=8", "train.steps=2",
                 "train.batch_size=4", "threads=1", "eval.n_prompts=8", "eval.max_new_tokens=8",
                 "train.max_length=128", "train.max_prompt_length=80", f"hydra.run.dir={run}"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 4 * 2  # two rounds of 4 prompts x 2 samples
    for s in samples:  # the training reward is VADER's compound score of the reply
        assert s["score"] == pytest.approx(vader(s["completion"] if isinstance(s["completion"], str)
                                                 else s["completion"][-1]["content"]), abs=1e-12)
    ev = json.loads((run / "summary.json").read_text())["eval"]
    assert ev["judge"] == "lexicon:afinn" and ev["accuracy"] is None and ev["n_prompts"] == 8
    rows = [json.loads(x) for x in (run / "eval_samples.jsonl").read_text().splitlines()]
    assert len(rows) == 8
    assert ev["reward_mean"] == pytest.approx(sum(x["policy_score"] for x in rows) / 8, abs=1e-12)
    assert 0.0 <= ev["win_rate"] <= 1.0


def test_chat_sentiment_evaluates_kl_to_start_and_the_start_as_judge(tmp_path):
    """lr 1e-30 leaves every float32 weight as it was: the policy is still the start, its sampled replies (same
    seeds) are the start's, so the KL is exactly 0 and the frozen judge, asked both orders, is exactly 1/2 on every
    pair, at the mid-run evaluation (metrics.jsonl) and the last (summary.json)."""
    policy, _ = build_tiny_qwen(tmp_path / "models")
    run = tmp_path / "run"
    r = run_cli(["train", "task=chat_sentiment", "objective=grpo", "data=online", f"model.name_or_path={policy}",
                 f"world_cache={tmp_path / 'cache'}", "task.generator.n_train=16", "task.generator.n_eval=6",
                 "data.prompts_per_round=4", "data.n=2", "data.max_new_tokens=8", "train.steps=2",
                 "train.batch_size=4", "train.lr=1e-30", "threads=1", "eval.n_prompts=6", "eval.max_new_tokens=8",
                 "eval.every=1", "eval.kl_to_start=true", "eval.model_judge=true", "train.max_length=128",
                 "train.max_prompt_length=80", f"hydra.run.dir={run}"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    mid = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    mid = next(m for m in mid if "eval/kl_to_start" in m)
    ev = json.loads((run / "summary.json").read_text())["eval"]
    for got in (mid, {f"eval/{k}": v for k, v in ev.items() if not isinstance(v, dict)}
                | {f"eval/model_judge/{k}": v for k, v in ev["model_judge"].items()}):
        assert got["eval/kl_to_start"] == 0.0 and got["eval/kl_to_start_per_token"] == 0.0
        assert got["eval/model_judge/win_rate"] == 0.5 and got["eval/model_judge/preference_mean"] == 0.5
    assert ev["model_judge"]["judge"] == f"start:{policy}" and ev["win_rate"] == 0.5  # AFINN: the same replies


def test_start_checks_are_refused_without_sampled_replies_in_one_line(tmp_path):
    r = run_cli(["train", "task=chat_sentiment", "objective=grpo", "data=online", "eval.model_judge=true",
                 "eval.temperature=0", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].endswith(
        "eval.model_judge=true reads the sampled replies; eval.temperature must be > 0, got 0.0")


def test_dpo_on_the_starts_own_best_vs_worst_replies_of_chat_sentiment(tmp_path):
    """experiment=smollm2_sentiment_pairs' stale16 cell on a tiny word-sampling model: one generation of the
    starting policy's replies (32 prompts x 4, all round 1) scored by VADER serves every step, and each group whose
    best and worst VADER scores differ by more than data.min_gap gives one pair, exactly as many as the rounds
    report. At lr 1e-30 the policy stays the start: every DPO margin is 0 (loss log 2 in float32), the KL to the
    start exactly 0 and the frozen judge and AFINN exactly 1/2, at the mid-run and the last evaluation."""
    policy = build_tiny_sentiment_llama(tmp_path / "models")
    run = tmp_path / "run"
    r = run_cli(["train", "experiment=smollm2_sentiment_pairs", "objective=dpo", "regime=stale16", "model=tiny",
                 f"model.name_or_path={policy}", "sampler=hf", f"world_cache={tmp_path / 'cache'}",
                 "task.generator.n_train=32", "task.generator.n_eval=6", "data.n=4", "data.max_new_tokens=8",
                 "train.steps=3", "train.batch_size=2", "train.lr=1e-30", "train.checkpoint_every=0",
                 "train.max_length=256", "train.max_prompt_length=200", "eval.n_prompts=6", "eval.batch_size=6",
                 "eval.max_new_tokens=8", "eval.every=2", f"hydra.run.dir={run}"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 32 * 4 and {s["round"] for s in samples} == {1}  # 16 steps x 2 pairs: 32 prompts
    assert all(s["score"] == pytest.approx(vader(s["completion"]), abs=1e-12) for s in samples)
    groups = [samples[i:i + 4] for i in range(0, len(samples), 4)]
    assert all(len({s["prompt"] for s in g}) == 1 for g in groups) and len({g[0]["prompt"] for g in groups}) == 32
    gaps = [max(s["score"] for s in g) - min(s["score"] for s in g) for g in groups]
    pairs = sum(gap > 0.01 for gap in gaps)  # best vs worst by the training reward, chosen above rejected
    assert 3 * 2 <= pairs <= 32 and any(gap > 0.5 for gap in gaps)  # the replies do differ in sentiment
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in train] == [1, 2, 3]
    for m in train:  # the one generation serves every step
        assert (m["online/round"], m["online/units"], m["online/dropped_prompts"]) == (1, pairs, 32 - pairs)
        assert (m["dpo/margin"], m["logratio_mean"]) == (0.0, 0.0) and m["loss"] == float(np.float32(np.log(2)))
    mid = next(m for m in metrics if m.get("step") == 2 and "eval/kl_to_start" in m)
    ev = json.loads((run / "summary.json").read_text())["eval"]
    for got in (mid, {"eval/kl_to_start": ev["kl_to_start"], "eval/win_rate": ev["win_rate"],
                      "eval/model_judge/win_rate": ev["model_judge"]["win_rate"],
                      "eval/model_judge/preference_mean": ev["model_judge"]["preference_mean"]}):
        assert (got["eval/kl_to_start"], got["eval/win_rate"]) == (0.0, 0.5)
        assert (got["eval/model_judge/win_rate"], got["eval/model_judge/preference_mean"]) == (0.5, 0.5)
    assert ev["judge"] == "lexicon:afinn" and ev["model_judge"]["judge"] == f"start:{policy}"
