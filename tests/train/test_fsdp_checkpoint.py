"""FSDP2 checkpoints (torch.distributed.checkpoint shards + checkpoint.py's state): kill -9 of ONE
rank of a 2-rank gloo job mid-run, then the same command, gives exactly the numbers of an
uninterrupted run; a checkpoint written by N ranks refuses M ranks in one line."""
from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from humanline_cli.backend import Dist
from humanline_cli.errors import UserError
from humanline_cli.train.checkpoint import Checkpoints
from tests.helpers.cli import FAST, TINY_WORLD, run_cli

ARGS = [*TINY_WORLD, *FAST, "backend=cpu", "objective=dpo", "+humanline=true", "backend.strategy=fsdp",
        "backend.nproc=2", "train.steps=3", "train.checkpoint_every=1"]


def _run(tmp_path, out, env=None):
    return run_cli(["train", *ARGS, f"hydra.run.dir={out}"], tmp_path, env_extra=env, timeout=300)


@pytest.mark.slow
def test_kill9_of_one_fsdp_rank_then_rerun_matches_uninterrupted(tmp_path, cache_dir, fault_env):
    full, cut = tmp_path / "full", tmp_path / "cut"
    r = _run(tmp_path, full)
    assert r.returncode == 0, r.stderr[-3000:]
    # humanline sync moves the reference: the checkpoint holds the policy's, AdamW's and the reference's
    # shards (one DCP file per rank) next to the rest of the state
    step = full / "checkpoints" / "step_3"
    assert sorted(p.name for p in (step / "shards").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert json.loads((step / "state.json").read_text())["sharded"] is True

    r = _run(tmp_path, cut, fault_env(rank="1:3:kill"))  # rank 1 SIGKILLs itself as step 3 starts
    assert r.returncode == 2, r.stderr[-3000:]
    msg = "without a word (kill -9, out of host memory, a lost machine)"  # "killed by SIGKILL" when torch saw it
    assert "rank 1: " in r.stderr.strip().splitlines()[-1] and msg in r.stderr.strip().splitlines()[-1]
    assert msg in json.loads((cut / "failed.json").read_text())["error"]
    assert sorted(p.name for p in (cut / "checkpoints").iterdir()) == ["step_1", "step_2"]  # no half-written step_3

    r = _run(tmp_path, cut)  # the same command
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming" in r.stderr and "from step 2 of 3" in r.stderr
    rows = lambda d: [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    a, b = rows(full), rows(cut)
    assert [x["step"] for x in a] == [x["step"] for x in b] == [1, 2, 3]
    for x, y in zip(a, b):  # same ranks, threads and order of operations: bitwise equal
        assert (x["loss"], x["grad_norm"]) == (y["loss"], y["grad_norm"])
    ma, mb = load_file(str(full / "model" / "model.safetensors")), load_file(str(cut / "model" / "model.safetensors"))
    assert ma.keys() == mb.keys() and all(bool((ma[k] == mb[k]).all()) for k in ma)

    # written by 2 ranks, loaded by 1: one line, before anything is touched
    with pytest.raises(UserError) as e:
        Checkpoints(cut, 1, dist=Dist()).load(step, None, None, None, None)
    assert str(e.value) == f"{step} was written by 2 rank(s), this run has 1; resume=false starts over"
