"""Online rounds: feedback from fixed scored samples, dropped prompts, skipped rounds, empty
completions, reward faults; and end-to-end online runs through the CLI with both samplers."""
from __future__ import annotations

import json

import pytest
import torch

from humanline_cli.core.batches import BinaryBatch, GroupBatch, PairBatch
from humanline_cli.errors import RunFailed
from tests.helpers.cli import FAST, TINY_WORLD, run_cli
from tests.helpers.training import length_score, online_source


def test_dpo_round_keeps_best_vs_worst():
    src = online_source("dpo", ["1", "22", "333"], length_score)
    step = src.next_step(1)
    assert step.new_round and src.sampler.pushes == 1
    (batch,) = step.micro_batches
    assert isinstance(batch, PairBatch) and len(batch.seqs) == 4  # 2 prompts -> 2 pairs (chosen + rejected rows)
    tok = src.encoder.tok
    chosen = tok.decode(batch.seqs.input_ids[0][batch.seqs.loss_mask[0]], skip_special_tokens=True)
    rejected = tok.decode(batch.seqs.input_ids[2][batch.seqs.loss_mask[2]], skip_special_tokens=True)
    assert (chosen, rejected) == ("333", "1")
    assert step.info["online/dropped_prompts"] == 0 and step.info["online/units"] == 2


def test_kto_round_splits_pairs_and_grpo_keeps_groups():
    kto = online_source("kto", ["1", "22", "333"], length_score).next_step(1).micro_batches[0]
    assert isinstance(kto, BinaryBatch) and sorted(kto.labels.tolist()) == [False, False, True, True]
    grpo = online_source("grpo", ["1", "22", "333"], length_score).next_step(1).micro_batches[0]
    assert isinstance(grpo, GroupBatch) and len(grpo.seqs) == 6
    # scores .1 .2 .3: mean .2, population std sqrt(2/300) -> A = +-0.1 / (0.08165 + 0.01)
    a = 0.1 / ((2 / 300) ** 0.5 + 0.01)
    # float64 arithmetic, then one float32 rounding of |A| ~ 1.1 (<= 6e-8)
    assert sorted(grpo.advantages.tolist()) == pytest.approx(sorted([-a, 0.0, a] * 2), abs=1e-7)
    assert grpo.sampler_logps is not None and float(grpo.sampler_logps.min()) == -0.5


def test_round_with_every_prompt_below_threshold_is_skipped_and_logged():
    src = online_source("dpo", ["1", "2", "3"], length_score)  # all score 0.1: gap 0 <= 0.01
    step = src.next_step(1)
    assert step.micro_batches == [] and step.info["online/skipped_round"] == 1
    assert step.info["online/dropped_prompts"] == 2 and step.info["online/tied_groups"] == 2
    step = online_source("grpo", ["1", "2"], length_score).next_step(1)  # zero-variance groups: kept, counted
    assert torch.equal(step.micro_batches[0].advantages, torch.zeros(4))
    assert (step.info["online/dropped_prompts"], step.info["online/tied_groups"]) == (0, 2)
    # a round with some spread: its tied group is counted too, its advantages are 0
    src = online_source("grpo", ["1", "2"], lambda prompts, completions, answers=None: [0.0, 0.0, 0.0, 1.0])
    step = src.next_step(1)
    (batch,) = step.micro_batches
    assert step.info["online/tied_groups"] == 1 and step.info["online/dropped_prompts"] == 0
    assert batch.advantages.abs().sum() > 0 and sorted(batch.advantages.tolist()).count(0.0) == 2


def test_empty_completions_are_handled():
    src = online_source("dpo", ["", "22"], length_score)
    (batch,) = src.next_step(1).micro_batches
    assert int(batch.seqs.loss_mask[2].sum()) == 1  # the empty rejected completion is just EOS
    assert src._round_info["online/empty_completions"] == 2


def test_prompts_are_used_once_per_epoch():
    src = online_source("grpo", ["1", "22"], length_score, n_prompts=4, batch=2)
    for step in range(1, 5):  # one step per round: 2 groups per round, batch 2
        src.next_step(step)
    # 4 rounds x 2 prompts = 2 epochs of 4 prompts
    assert src.epoch == 2 and src.round == 4


@pytest.mark.parametrize("scorer,needle", [
    (lambda p, c, a=None: [float("nan")] * len(c), "non-finite"),
    (lambda p, c, a=None: [0.0], "returned 1 scores for 6"),
])
def test_reward_faults_name_the_reward(scorer, needle):
    with pytest.raises(RunFailed, match=f"reward fake.*{needle}"):
        online_source("dpo", ["1", "22", "333"], scorer).next_step(1)


ONLINE = [*TINY_WORLD, *FAST, "data=online", "data.prompts_per_round=8", "data.n=4", "data.max_new_tokens=6"]


# The 40-step world policy answers ~2% of sums right: a round of 32 samples holds no right one about half the
# time (0.98^32), every DPO/KTO pair then ties and the step is skipped (test_faults.py tests the skipped-steps
# rule). These cases test the online route, so they accept skipped steps.
SKIPS_OK = "train.max_skipped_fraction=1.0"


@pytest.mark.parametrize("objective,extra", [("grpo", []), ("dpo", ["+humanline=true", SKIPS_OK]), ("kto", [SKIPS_OK]),
                                             ("dpo", ["sampler=vllm", SKIPS_OK]),
                                             # LoRA + vLLM: the merged weights are pushed each round
                                             # (test_vllm_sampler.py pins them to the merged model's samples)
                                             ("grpo", ["sampler=vllm", "model.lora.r=4", "+humanline=true"])])
def test_online_end_to_end(cache_dir, tmp_path, objective, extra):
    run = tmp_path / "run"
    r = run_cli(["train", f"objective={objective}", *ONLINE, *extra, f"hydra.run.dir={run}"], cwd=tmp_path,
                env_extra={"VLLM_CPU_KVCACHE_SPACE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((run / "summary.json").read_text())
    assert s["data"] == "online" and s["objective"] == objective
    assert s["wall_clock_s"]["sample"] > 0 and s["wall_clock_s"]["label"] > 0
    assert s["tokens_per_s"]["sample"] > 0
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) % 32 == 0 and {"round", "prompt", "completion", "score"} <= set(samples[0])
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["online/round"] == 1


def test_online_with_a_reward_model_labeller(cache_dir, tmp_path):
    from tests.helpers.models import build_tiny_reward_model

    build_tiny_reward_model(tmp_path / "rm")
    run = tmp_path / "run"
    r = run_cli(["train", "objective=grpo", *ONLINE, "reward=model", f"reward.name_or_path={tmp_path / 'rm'}",
                 f"hydra.run.dir={run}"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    scores = {s["score"] for s in samples}
    assert len(scores) > 2 and not scores <= {0.0, 1.0}  # real-valued RM scores, not the verifier's 0/1


def test_a_failed_vllm_run_releases_its_engine_before_the_next_run(cache_dir, tmp_path, monkeypatch):
    """run_rank cleans up in `finally`: a vLLM run that fails mid-training closes its engine, and a
    second run in the same process (as in a single-process sweep) then completes."""
    from hydra import compose, initialize_config_module

    import humanline_cli.train.job as job
    from humanline_cli.cli.overrides import normalize_overrides
    from humanline_cli.config import resolve
    from humanline_cli.sampling.vllm import VLLMSampler

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    closed = []
    real_close = VLLMSampler.close
    monkeypatch.setattr(VLLMSampler, "close", lambda self: (closed.append("llm" in self.__dict__), real_close(self)))
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose("train", overrides=normalize_overrides(["objective=dpo", *ONLINE, "sampler=vllm", SKIPS_OK]))
    spec = resolve(cfg)
    real_train = job.train

    def failing_train(*a, **k):
        raise RunFailed("injected failure at step 1")

    monkeypatch.setattr(job, "train", failing_train)
    with pytest.raises(RunFailed, match="injected"):
        job.run_rank(spec, job.Context(tmp_path / "first", tmp_path))
    assert closed[0] is True and len(closed) == 2  # the live engine was shut down by the finally (2nd close: no-op)
    assert (tmp_path / "first" / "failed.json").exists()
    monkeypatch.setattr(job, "train", real_train)
    summary = job.run_rank(spec, job.Context(tmp_path / "second", tmp_path))
    assert summary["status"] == "complete" and closed[2] is True
