"""Asynchronous online rounds (data.async_lag=1) on 2 gloo ranks, through the real CLI: each rank has its own
sampler process, which samples that rank's share of each round (prompt 0-1 on rank 0, prompt 2 on rank 1: an
uneven share) from the weights one round old, with the one-process run's per-completion seeds. The shares are
gathered, so samples (keyed by round, prompt and sample), units, staleness, losses and weights equal one
process's at lag 1 (float64: relative 1e-9), under DDP and FSDP2 (whose snapshot gathers every DTensor). A
checkpoint gathers the in-flight round's shares (whole rounds, as one process stores them); a sampler process
that dies on rank 1 ends the job with rank 1's one line and exit 2, and the rerun resumes from the checkpoint
to the uninterrupted numbers."""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.helpers.cli import FAST, TINY_WORLD, run_cli
from tests.helpers.numerics import FP64, PADDED, RUN_ABS, RUN_REL, SAVED_REL, assert_same_rows, max_weight_diff

N = 4  # samples per prompt
ARGS = ["train", *TINY_WORLD, *FAST, "backend=cpu", "train.length_bucketing=false", "objective=dpo", "+humanline=true",
        "task=preference", "data=online", "data.prompts_per_round=3", f"data.n={N}", "data.max_new_tokens=6",
        "train.micro_batch_size=1", "data.async_lag=1", "train.checkpoint_every=1", "train.keep_checkpoints=10",
        *FP64, *PADDED]  # padded: FSDP2 runs the padded batch, and one process equals it in float64 only so
TWO = {"backend.nproc=2", "backend.timeout_s=600"}  # 600 s > run_cli's limit: a hang cannot end in time


def _run(tmp_path: Path, name: str, extra=(), env=None, code: int = 0):
    out = tmp_path / name
    t = time.monotonic()
    r = run_cli([*ARGS, *extra, f"hydra.run.dir={out}"], tmp_path, env_extra=env, timeout=300)
    assert r.returncode == code, r.stderr[-3000:]
    return out, r, time.monotonic() - t


def _outputs(run: Path) -> dict:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    samples, seen = {}, {}
    for s in (json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()):
        k = seen.get(s["round"], 0)  # prompt-major per round: row k is sample k % N of prompt k // N
        seen[s["round"]] = k + 1
        samples[(s["round"], k // N, k % N)] = (s["prompt"], s["completion"], s["score"], s["policy_version"])
    pending = {}
    for step in sorted((run / "checkpoints").glob("step_*")):
        for job in json.loads((step / "state.json").read_text())["source"]["pending"]:
            pending[(step.name, job["round"])] = job
    weights = load_file(str(run / "model" / "model.safetensors"))
    return {"rows": rows, "samples": samples, "pending": pending, "weights": weights}


@pytest.fixture(scope="module")
def one(tmp_path_factory, cache_dir):
    return _outputs(_run(tmp_path_factory.mktemp("one"), "one")[0])


def _assert_same_run(one: dict, two: dict) -> None:
    assert len(one["samples"]) == 3 * 3 * N and two["samples"] == one["samples"]  # texts, scores, policy versions
    # rounds 1 and 2 from the starting weights; round 3 from the weights after step 1 (a round is one step)
    assert {k[0]: v[3] for k, v in one["samples"].items()} == {1: 0, 2: 0, 3: 1}
    keys = ("step", "units", "online/round", "online/policy_version", "online/staleness_steps")
    assert [{k: r[k] for k in keys} for r in two["rows"]] == [{k: r[k] for k in keys} for r in one["rows"]] == [
        {"step": s, "units": 3, "online/round": s, "online/policy_version": v, "online/staleness_steps": st}
        for s, v, st in ((1, 0, 0), (2, 0, 1), (3, 1, 1))]
    assert_same_rows(one["rows"], two["rows"], keys=("loss", "grad_norm", "online/label_reward_mean"))
    assert one["rows"][2]["loss"] != pytest.approx(one["rows"][0]["loss"], abs=1e-6)  # the losses carry information
    if "lm_head.weight" in two["weights"] and "lm_head.weight" not in one["weights"]:  # FSDP spells out the tie
        two["weights"].pop("lm_head.weight")
    assert max_weight_diff(one["weights"], two["weights"]) <= SAVED_REL
    # every checkpoint holds its in-flight round whole, gathered from both ranks: as one process stores it
    assert sorted(two["pending"]) == sorted(one["pending"]) == [("step_1", 2), ("step_2", 3), ("step_3", 4)]
    for key, a in one["pending"].items():
        b = two["pending"][key]
        assert (b["prompts"], b["version"]) == (a["prompts"], a["version"]) and len(a["prompts"]) == 3
        ca, cb = a["completions"], b["completions"]
        assert (cb["n"], cb["texts"], cb["token_ids"]) == (ca["n"], ca["texts"], ca["token_ids"]) and len(ca["texts"]) == 12
        assert [x for lp in cb["logps"] for x in lp] == pytest.approx([x for lp in ca["logps"] for x in lp],
                                                                      rel=RUN_REL, abs=RUN_ABS)


def test_two_ddp_ranks_at_lag_1_equal_one_process(tmp_path, one):
    run, r, _ = _run(tmp_path, "ddp", ["backend.strategy=ddp", *TWO])
    _assert_same_run(one, _outputs(run))


def test_fsdp_sampler_fault_on_rank_1_is_one_line_then_the_rerun_resumes_to_one_process(tmp_path, one, fault_env):
    """FSDP2, lag 1. Rank 1's sampler process is killed as round 3 reaches it (during step 2): rank 1 fails
    at step 2's checkpoint, which waits for round 3; rank 0 is stopped; one error line, rank 1's, exit 2,
    well before backend.timeout_s. The rerun (same command) resumes from step 1's checkpoint, whose in-flight
    round 2 every rank takes its share of, and ends with the one-process run's samples, losses and weights."""
    extra = ["backend.strategy=fsdp", *TWO]
    run, r, wall = _run(tmp_path, "fsdp", extra, env=fault_env(sampler="kill@3:1"), code=2)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("humanline: error:")]
    assert len(errors) == 1 and errors[0].endswith(
        "rank 1: the sampler process died (killed by signal 9) while sampling round 3"), r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "leaked semaphore" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == errors[0]
    failed = json.loads((run / "failed.json").read_text())
    assert failed["rank"] == 1 and failed["status"] == "failed" and "while sampling round 3" in failed["error"]
    assert not (run / "summary.json").exists() and wall < 150, wall
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_1"]

    run, r, _ = _run(tmp_path, "fsdp", extra)
    assert "resuming" in r.stderr and "from step 1 " in r.stderr, r.stderr[-3000:]
    _assert_same_run(one, _outputs(run))


def test_an_empty_share_is_submitted_and_a_whole_round_restores_each_ranks_share():
    """One prompt per round on 2 ranks: rank 1's share is empty. It still submits the round (its producer
    samples nothing; every rank's producer runs every round), and a checkpoint's whole in-flight round gives
    rank 0 the prompt's completions and rank 1 none (the same slicing for 3 prompts: 2 and 1)."""
    from types import SimpleNamespace

    from humanline_cli.core.interfaces import Completions, SamplingParams
    from humanline_cli.sources.online import OnlineSource, RoundSpec
    from humanline_cli.sources.source import Shard

    class Producer:
        def __init__(self):
            self.calls = []

        def submit(self, key, weights, prompt_ids, params, indices=None):
            self.calls.append((key, prompt_ids, indices, params.seed))

    rows = [{"prompt": f"p{i}"} for i in range(5)]
    enc = SimpleNamespace(prompt_ids=lambda p: [int(p[1:]) + 10])
    spec = RoundSpec("dpo", 2, 1, SamplingParams(n=2, seed=7), 1, 0.0, seed=7)
    sources = {}
    for rank in (0, 1):
        src = OnlineSource(rows, enc, None, None, ("x", None), spec, None, None, shard=Shard(rank, 2), lag=1,
                           producer=Producer())
        src._submit(1, weights=None)
        sources[rank] = src
    (k0, ids0, idx0, seed0), = sources[0].producer.calls
    (k1, ids1, idx1, seed1), = sources[1].producer.calls
    assert sources[0]._pending[1]["prompts"] == sources[1]._pending[1]["prompts"]  # both ranks drew the same prompt
    p = sources[0]._pending[1]["prompts"][0]
    assert (k0, ids0, idx0) == (1, [[p + 10]], [0]) and (k1, ids1, idx1) == (1, [], [])
    assert seed0 == seed1 == 7 * 100003 + 1  # the round's seed, as one process draws it

    letters = "abcdef"  # completion k of the whole round: text letters[k], token id k + 1
    for n_prompts, want in ((1, {0: "ab", 1: ""}), (3, {0: "abcd", 1: "ef"})):
        k = 2 * n_prompts
        job = {"round": 2, "prompts": [0, 1, 2][:n_prompts], "version": 1,
               "completions": vars(Completions(2, [[i + 1] for i in range(k)], [[-0.1 * i] for i in range(k)],
                                               list(letters[:k])))}
        state = {"n_prompts": 5, "round": 1, "epoch": 1, "order": [], "queue": [], "round_info": {},
                 "rng": random.Random(0).getstate(), "sample_tokens": 0, "sample_seconds": 0.0, "pending": [job]}
        for rank, src in sources.items():
            src.load_state_dict(state)
            got = src._done[2]
            assert got.n == 2 and "".join(got.texts) == want[rank]
            assert got.token_ids == [[letters.index(c) + 1] for c in want[rank]]
            assert src._pending[2] == {"prompts": [0, 1, 2][:n_prompts], "version": 1}
    bad = {**job, "completions": {**job["completions"], "texts": list(letters[:5])}}
    with pytest.raises(ValueError, match="in-flight round 2 has 5 completions, not 2 for each of its 3 prompts"):
        sources[0].load_state_dict({**state, "pending": [bad]})
