"""Scale: DDP ranks on CPU (gloo) started by the job itself, micro-batch invariance of the loss,
LoRA runs end to end. Each run goes through the real CLI in a subprocess. Runs compared with each other
(equal in exact arithmetic) run in float64 and agree to 1e-9 on any CPU kernel set (numerics.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.cli import FAST, TINY_WORLD, run_cli
from tests.helpers.numerics import FP64, PADDED, SAVED_REL, assert_same_rows, max_weight_diff


def _train(tmp_path: Path, name: str, extra: list[str]) -> tuple[list[dict], dict]:
    out = tmp_path / name
    # bucketing off: these tests compare how a step is split (ranks, micro-batches), and a length sort
    # regroups sequences differently per split (the same step to float rounding; test_packing.py covers it)
    r = run_cli(["train", *TINY_WORLD, *FAST, "backend=cpu", "train.length_bucketing=false", f"hydra.run.dir={out}",
                 *extra], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, load_file(str(out / "model" / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("objective", ["dpo", "kto", "grpo"])
def test_two_ranks_match_one_process(tmp_path, cache_dir, objective, strategy):
    """Same global batch and seed: 2 gloo ranks (each half the batch; DDP replicas or FSDP2 shards)
    vs 1 process, with humanline on (the sync path): per-step loss and gradient norms and the final
    weights agree to 1e-9 (float64: only the summation order differs)."""
    common = [f"objective={objective}", "+humanline=true", *FP64, *(PADDED if strategy == "fsdp" else [])]
    one_rows, one = _train(tmp_path, "one", common)
    two_rows, two = _train(tmp_path, "two", [*common, f"backend.strategy={strategy}", "backend.nproc=2"])
    assert [r["step"] for r in one_rows] == [r["step"] for r in two_rows] == [1, 2, 3]
    assert [r["units"] for r in two_rows] == [r["units"] for r in one_rows]  # logged over both ranks' halves
    assert_same_rows(one_rows, two_rows)  # the global loss, not rank 0's share; relative 1e-9
    if "lm_head.weight" in two and "lm_head.weight" not in one:  # FSDP's full state dict spells out the tie
        assert torch.equal(two.pop("lm_head.weight"), two["model.embed_tokens.weight"])
    assert max_weight_diff(one, two) <= SAVED_REL  # float64 training, saved in float32: at most one ulp
    start = load_file(str(next(cache_dir.glob("arithmetic-*")) / "policy" / "model.safetensors"))
    # the runs really trained (start: the world's saved policy, whose tied head is not a separate tensor)
    assert max_weight_diff({k: one[k] for k in start}, start) > 1e-4


@pytest.mark.parametrize("objective", ["grpo", "kto"])
def test_micro_batch_size_does_not_change_the_step(tmp_path, cache_dir, objective):
    """GRPO's token mean and KTO's z0 are over the whole step: 2 micro-batches of 4 == 1 of 8."""
    whole_rows, whole = _train(tmp_path, "whole", [f"objective={objective}", *FP64])
    split_rows, split = _train(tmp_path, "split", [f"objective={objective}", *FP64, "train.micro_batch_size=4"])
    assert_same_rows(whole_rows, split_rows)  # float64: relative 1e-9 (numerics.py)
    assert max_weight_diff(whole, split) <= SAVED_REL


def test_lora_humanline_run_trains_adapters_and_saves_a_plain_model(tmp_path, cache_dir):
    rows, merged = _train(tmp_path, "lora", ["objective=dpo", "+humanline=true", "model.lora.r=4"])
    # reference adapter == policy at step 1: log-ratios exactly 0, loss -log sigmoid(0) = ln 2 to float32 rounding
    assert rows[0]["loss"] == pytest.approx(0.6931471805599453, abs=1e-7)  # (one float32 ulp at 0.69 is 6e-8)
    out = tmp_path / "lora"
    assert (out / "model" / "adapter").is_dir()
    start = load_file(str(next(cache_dir.glob("arithmetic-*")) / "policy" / "model.safetensors"))
    # merged = base + B A (alpha / r): the LoRA'd projections moved, the embeddings (not adapted) did not
    assert torch.equal(merged["model.embed_tokens.weight"], start["model.embed_tokens.weight"])
    assert float((merged["model.layers.0.self_attn.q_proj.weight"]
                  - start["model.layers.0.self_attn.q_proj.weight"]).abs().max()) > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "complete"


def test_slurm_multinode_launch_config_and_preset():
    from hydra import compose, initialize_config_module

    from humanline_cli.train.launch import first_host, launch_config

    assert first_host("gpu[003-005,010],cpu1") == "gpu003" and first_host("a01,a02") == "a01"
    assert first_host("node7") == "node7" and first_host("n[1,4]") == "n1"
    env = {"SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[003-004]", "SLURM_JOB_ID": "4242", "MASTER_PORT": "29500"}
    c = launch_config(8, env)
    assert (c.min_nodes, c.max_nodes, c.nproc_per_node) == (2, 2, 8)
    assert (c.rdzv_backend, c.rdzv_endpoint, c.run_id, c.max_restarts) == ("c10d", "gpu003:29500", "humanline-4242", 0)
    local = launch_config(2, {})
    assert (local.min_nodes, local.max_nodes, local.nproc_per_node, local.rdzv_endpoint) == (1, 1, 2, "127.0.0.1:0")
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose("train", overrides=["hydra/launcher=slurm_multinode", "backend=cuda", "backend.strategy=fsdp",
                                          "backend.nproc=8"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (2, 1, 8)
    assert "submitit" in launcher._target_.lower()


@pytest.mark.slow
def test_two_rank_online_run_matches_one_process(tmp_path, cache_dir):
    """Online GRPO (HF sampler) on 2 DDP ranks: the same samples, losses and weights as one process,
    and one samples.jsonl written by rank 0."""
    online = ["objective=grpo", "data=online", "data.prompts_per_round=8", "data.n=4", "data.max_new_tokens=6", *FP64]
    one_rows, one = _train(tmp_path, "one", online)
    two_rows, two = _train(tmp_path, "two", [*online, "backend.strategy=ddp", "backend.nproc=2",
                                             "train.checkpoint_every=0"])
    assert_same_rows(one_rows, two_rows, keys=("loss", "grad_norm"))  # float64: relative 1e-9
    for a, b in zip(one_rows, two_rows):
        assert b["online/label_reward_mean"] == a["online/label_reward_mean"]  # the same samples, the same labels
    assert max_weight_diff(one, two) <= SAVED_REL
    assert (tmp_path / "one" / "samples.jsonl").read_text() == (tmp_path / "two" / "samples.jsonl").read_text()
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["data"] == "online" and summary["eval"]["n_prompts"] == 16


def test_gradient_checkpointing_changes_memory_not_the_update(tmp_path, cache_dir):
    plain_rows, plain = _train(tmp_path, "plain", ["objective=dpo", "+humanline=true", *FP64, *PADDED])
    ckpt_rows, ckpt = _train(tmp_path, "ckpt", ["objective=dpo", "+humanline=true", *FP64, *PADDED,
                                                "train.gradient_checkpointing=true"])
    assert_same_rows(plain_rows, ckpt_rows)  # recomputed activations, summed in another order: float64, 1e-9
    assert max_weight_diff(plain, ckpt) <= SAVED_REL


@pytest.mark.slow
def test_torchrun_habit_gives_one_run_dir_written_by_rank_0(tmp_path, cache_dir):
    """`torchrun --nproc_per_node 2 -m humanline_cli train ...`: every rank runs Hydra, rank 0's run dir
    is broadcast, only rank 0 writes; the result equals our own launcher's."""
    import os
    import subprocess
    import sys

    out = tmp_path / "tr"
    args = ["train", *TINY_WORLD, *FAST, "backend=cpu", "backend.strategy=ddp", "objective=kto", *FP64,
            "train.length_bucketing=false", f"hydra.run.dir={out}"]
    torchrun = Path(sys.executable).parent / "torchrun"
    r = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "humanline_cli", *args],
                       cwd=tmp_path, env={**os.environ}, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "complete"
    # backend.nproc is torchrun's WORLD_SIZE: the header's estimate and the recorded config count both ranks
    assert "DDP x2" in " ".join(r.stderr.split()), r.stderr[-3000:]
    assert json.loads((out / "resolved_config.json").read_text())["backend"]["nproc"] == 2
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == [1, 2, 3]  # one writer: each step logged once
    own_rows, _ = _train(tmp_path, "own", ["objective=kto", *FP64, "backend.strategy=ddp", "backend.nproc=2"])
    # the same 2-rank split, started another way; torchrun's environment (OMP_NUM_THREADS, ...) may pick
    # other kernels, so not bitwise in float32 (observed 6e-8 apart): float64, relative 1e-9
    assert_same_rows(own_rows, rows)


def test_an_outside_launchers_ranks_are_backend_nproc():
    from humanline_cli.config import launched_backend
    from humanline_cli.errors import UserError

    assert launched_backend({"strategy": "fsdp", "nproc": 1, "timeout_s": 5.0}, 2) == {
        "strategy": "fsdp", "nproc": 2, "timeout_s": 5.0}
    assert launched_backend({"strategy": "ddp", "nproc": 4}, 4)["nproc"] == 4
    with pytest.raises(UserError, match=r"^backend.nproc=3 but the launcher started 2 ranks"):
        launched_backend({"strategy": "ddp", "nproc": 3}, 2)
    with pytest.raises(UserError, match=r"backend.strategy=single: set backend.strategy=ddp"):
        launched_backend({"strategy": "single", "nproc": 1}, 2)
