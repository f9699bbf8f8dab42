"""Exact mid-run checkpoint/resume.

In-process: a checkpoint round-trips every piece (weights, reference, optimizer, scheduler, RNGs, data
position, timers, baseline, last metrics), so continuing from step k gives bit-identical weights to a
run that never stopped, for full fine-tuning and LoRA, with a moving and a fixed reference; pruning
keeps K; online rounds' queued units survive JSON. Through the real CLI (kill -9 and rerun: in
test_kill9_resume.py): a rerun of a complete run touches nothing; another config is refused (one
line), `resume=false` moves the old outputs aside; a sweep skips only jobs whose saved config matches.
"""
from __future__ import annotations

import json
import random
import socket
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from humanline_cli.core.humanline import ReferenceRule
from humanline_cli.core.interfaces import SamplingParams
from humanline_cli.data.examples import BinaryExample, GroupExample, PairExample
from humanline_cli.eval.evaluator import Side
from humanline_cli.sources.online import OnlineSource, RoundSpec, TokenCompletion
from humanline_cli.train import checkpoint as C
from humanline_cli.train import rundir as R
from humanline_cli.train.timing import PhaseTimer
from humanline_cli.train.tracking import NullTracker, Tracker
from humanline_cli.train.trainer import train
from tests.helpers.cli import BASE, run_cli
from tests.helpers.ranks import run_two_ranks
from tests.helpers.runs import read_rows
from tests.helpers.training import offline_parts, run_train, train_spec

# ------------------------------------------------------------------ in-process pieces
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch on one thread


class Killed(Exception):
    pass


@pytest.mark.parametrize("lora,moving,cached", [(False, True, False), (False, False, False), (True, True, False),
                                               (True, False, False), (False, False, True)])
def test_resumed_training_is_bit_identical(tmp_path, lora, moving, cached):
    """6 steps straight vs 4 steps, a checkpoint, a fresh process-like rebuild, then steps 5-6."""
    whole = offline_parts(lora, moving, cached)
    _, ckpts, _ = run_train(tmp_path / "whole", whole, train_spec(6, moving, every=1, keep=2))
    assert ckpts.steps() == [5, 6] and not list(ckpts.root.glob(".tmp-*"))  # pruned to K=2, no temp dirs

    first = offline_parts(lora, moving, cached)
    real_next = first.source.next_step

    def crash_at_5(step):  # the process dies during step 5
        if step == 5:
            raise Killed
        return real_next(step)

    first.source.next_step = crash_at_5
    with pytest.raises(Killed):
        run_train(tmp_path / "cut", first, train_spec(6, moving, every=2, keep=3))
    cut = C.Checkpoints(tmp_path / "cut", 2)
    assert cut.steps() == [2, 4]
    tensors = load_file(cut.latest() / "tensors.safetensors")
    policy_keys = {k for k in tensors if k.startswith("policy.")}
    if lora:  # the adapter only (what lora.adapter_tensors names), never the frozen base weights
        assert policy_keys and all(".lora_" in k for k in policy_keys)
    else:
        assert policy_keys == {f"policy.{n}" for n, _ in first.policy.named_parameters()}
    assert any(k.startswith("reference.") for k in tensors) == moving  # fixed reference: rebuilt, not saved

    resumed = offline_parts(lora, moving, cached)
    (tmp_path / "cut" / "metrics.jsonl").rename(tmp_path / "cut" / "metrics-first.jsonl")
    last, _, _ = run_train(tmp_path / "cut", resumed, train_spec(6, moving, every=2, keep=3), cut.latest())
    for (name, a), b in zip(whole.policy.named_parameters(), resumed.policy.parameters()):
        assert torch.equal(a, b), name
    for a, b in zip(whole.reference.model.parameters(), resumed.reference.model.parameters()):
        assert torch.equal(a, b)
    rows = read_rows(tmp_path / "cut" / "metrics-first.jsonl") + read_rows(tmp_path / "cut" / "metrics.jsonl")
    assert rows == read_rows(tmp_path / "whole" / "metrics.jsonl") and [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert last["loss"] == rows[-1]["loss"]
    if cached:  # the store came back from the checkpoint: steps 5-6 found every sequence in it
        assert [r["reference_cache/hit_fraction"] for r in rows] == [0.0] * 3 + [1.0] * 3
        assert resumed.reference.misses == 0 and len(resumed.reference.store) == 12


def test_checkpoint_holds_every_piece(tmp_path):
    parts = offline_parts(lora=False, moving=True)
    last, ckpts, timer = run_train(tmp_path, parts, train_spec(5, True, every=5))
    after = (random.random(), float(np.random.rand()), float(torch.rand(1)))  # the RNGs right after the save
    path = ckpts.latest()
    assert path.name == "step_5"
    state = C.read_state(path)
    tensors = load_file(path / "tensors.safetensors")
    # hand-checked values: 5 AdamW steps; warm-up ceil(0.5 * 5) = 3 steps then cosine over 2 more
    assert state["step"] == 5 and float(tensors["optimizer.0.step"]) == 5.0
    assert state["scheduler"]["last_epoch"] == 5
    assert state["scheduler"]["_last_lr"] == pytest.approx([1e-2 * 0.5 * (1 + np.cos(np.pi * 2 / 2))])
    assert state["optimizer"]["param_groups"][0]["lr"] == state["scheduler"]["_last_lr"][0]
    assert state["source"]["epoch"] == 1 and len(state["source"]["order"]) == 14 - 5 * 2
    assert state["baselines"] == {"baseline": {"texts": ["x", "yz"], "scores": [0.25, 0.5]},
                                  "greedy_baseline": {"texts": ["g", ""], "scores": [1.0, 0.0]}}
    assert state["last_metrics"]["loss"] == last["loss"] and state["reference_saved"] is True
    assert state["timer"]["seconds"]["train"] > 0 and state["timer"]["total"] > 0
    assert tensors["rng.torch"].dtype == torch.uint8

    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    fresh = offline_parts(lora=False, moving=True)
    fresh.evaluator.baseline = fresh.evaluator.greedy_baseline = None
    from humanline_cli.core.optim import make_optimizer, make_scheduler

    opt = make_optimizer(fresh.policy, 1e-2, 0.01)
    sched = make_scheduler(opt, 5, 0.5, "cosine")
    timer2 = PhaseTimer()
    step, last2 = C.Checkpoints(tmp_path, 5).load(path, fresh, opt, sched, timer2)
    assert step == 5 and last2 == last
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == after
    for a, b in zip(parts.policy.parameters(), fresh.policy.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(parts.reference.model.parameters(), fresh.reference.model.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(opt.state_dict()["state"][3]["exp_avg_sq"], tensors["optimizer.3.exp_avg_sq"])
    assert sched.last_epoch == 5 and sched.get_last_lr() == state["scheduler"]["_last_lr"]
    assert fresh.source.state_dict() == parts.source.state_dict()
    assert fresh.source.next_step(6).micro_batches[0].seqs.input_ids.tolist() == \
        parts.source.next_step(6).micro_batches[0].seqs.input_ids.tolist()
    assert fresh.evaluator.baseline == Side(["x", "yz"], [0.25, 0.5])
    assert fresh.evaluator.greedy_baseline == Side(["g", ""], [1.0, 0.0])
    assert timer2.seconds["train"] >= state["timer"]["seconds"]["train"] and timer2.elapsed() >= state["timer"]["total"]


def test_online_round_state_survives_json():
    """The queued units of an unfinished round (token completions, chat prompts) and the counters."""
    spec = RoundSpec("dpo", 2, 2, SamplingParams(n=2), 2, 0.0, seed=5)
    rows = [{"prompt": "a"}, {"prompt": [{"role": "user", "content": "b"}]}, {"prompt": "c"}]
    src = OnlineSource(rows, None, None, None, ("labeller", None), spec, None, None)
    tc = TokenCompletion((4, 5, 2), "xy", (-0.5, -1.25, -0.0625))
    src.round, src.epoch, src._order = 3, 2, [2, 0]
    src._queue = [[PairExample("a", tc, TokenCompletion((6,), "z", (-2.0,))),
                   PairExample(rows[1]["prompt"], "plain", tc)],
                  [BinaryExample("c", tc, False), GroupExample("c", [tc, tc], [0.1, 1 / 3])]]
    src._round_info = {"online/round": 3, "online/label_reward_mean": 0.1 + 0.2}
    src._sample_tokens, src._sample_seconds = 96, 0.75
    src.rng.random()
    text = json.dumps(C.to_json(src.state_dict()))
    back = OnlineSource(rows, None, None, None, ("labeller", None), spec, None, None)
    back.load_state_dict(C.from_json(json.loads(text)))
    assert back._queue == src._queue and back._queue[0][0].chosen.ids == (4, 5, 2)  # tuples stay tuples
    assert back._queue[1][1].rewards[1] == 1 / 3 and back._round_info["online/label_reward_mean"] == 0.1 + 0.2
    assert (back.round, back.epoch, back._order, back._sample_tokens) == (3, 2, [2, 0], 96)
    assert back.sample_tokens_per_s() == 128.0 and back.rng.random() == src.rng.random()
    with pytest.raises(KeyError):  # only the known unit types are ever built from a checkpoint
        C.from_json({"__unit__": "os.system"})


def test_rewind_and_move_aside(tmp_path):
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("old: 1\n")  # the previous run's record (the job writes its own after)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": s / 10}) + "\n" for s in (1, 2, 3))
                                      + '{"step": 4, "lo')  # a line torn by the kill
    (run / "samples.jsonl").write_text("".join(json.dumps({"round": r}) + "\n" for r in (1, 1, 2, 3)))
    (run / "failed.json").write_text("{}")
    R.rewind_outputs(run, step=2, rounds=2)
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert [json.loads(x)["round"] for x in (run / "samples.jsonl").read_text().splitlines()] == [1, 1, 2]
    assert not (run / "failed.json").exists()
    (run / "train.log").write_text("log")
    (run / "previous-1").mkdir()
    dest = R.move_aside(run)
    assert dest.name == "previous-2"
    assert sorted(p.name for p in run.iterdir()) == ["previous-1", "previous-2", "train.log"]
    assert (dest / ".hydra" / "config.yaml").read_text() == "old: 1\n" and (dest / "metrics.jsonl").exists()


def test_config_diff_names_keys_and_ignores_the_harmless_ones():
    old = {"seed": 0, "threads": 1, "wandb": {"mode": "offline"}, "train": {"lr": 1e-5, "checkpoint_every": 50},
           "hl": {"clamp": True}}
    new = {"seed": 0, "threads": 2, "wandb": {"mode": "online"}, "train": {"lr": 1e-4, "checkpoint_every": 5},
           "hl": {"clamp": False}, "resume": False}
    assert R.config_diff(old, new) == ["hl.clamp: true -> false", "train.lr: 1e-05 -> 0.0001"]


def test_a_run_saved_before_a_key_existed_resumes_with_the_keys_default(tmp_path):
    """A run dir saved by an older humanline lacks the keys added since; each counts at today's schema default
    (which need not be what the older code did: the line names each key and the value it takes), and only a value
    away from that default is another config."""
    import copy

    from humanline_cli.config import compose_train, resolve
    from humanline_cli.errors import RunDirConflict
    from humanline_cli.train.tracking import scrub

    config = resolve(compose_train([*BASE, "sampler=vllm"])).config
    old = copy.deepcopy(config)
    del old["train"]["shared_prefix"], old["train"]["compile"], old["sampler"]["block_size"]
    run = tmp_path / "run"
    run.mkdir()
    (run / R.RESOLVED).write_text(json.dumps(old))
    assert R.config_diff(old, config) == []
    said = []
    assert R.prepare_run_dir(run, config, resume=True, say=said.append) == 0
    assert said == [f"{run} holds a run made before sampler.block_size, train.compile, train.shared_prefix existed: "
                    f"resuming it with today's default(s) (sampler.block_size=null, train.compile=false, "
                    f"train.shared_prefix=true), which may differ from what the older code did"]
    assert json.loads((run / R.RESOLVED).read_text()) == json.loads(json.dumps(scrub(config)))

    (run / R.RESOLVED).write_text(json.dumps(old))
    compiled = copy.deepcopy(config)
    compiled["train"]["compile"] = True
    with pytest.raises(RunDirConflict, match=r"another config \(train\.compile: false -> true\)"):
        R.prepare_run_dir(run, compiled, resume=True, say=said.append)
    assert len(said) == 1 and json.loads((run / R.RESOLVED).read_text()) == old  # refused: nothing written
    old["train"]["lr"] = 0.5  # a saved key that differs is shown as before
    assert R.config_diff(old, config) == ["train.lr: 0.5 -> 0.001"]


def test_wandb_continues_the_same_run(tmp_path):
    first = Tracker(tmp_path, {"seed": 0}, {"mode": "offline"}, "t")
    run_id = (tmp_path / "wandb_id.txt").read_text().strip()
    assert first.wandb is not None and first.wandb.id == run_id
    first.finish()
    again = Tracker(tmp_path, {"seed": 0}, {"mode": "offline"}, "t", resume=True)
    assert again.wandb.id == run_id
    again.finish()
    fresh = Tracker(tmp_path, {"seed": 0}, {"mode": "offline"}, "t")
    assert fresh.wandb.id != run_id
    fresh.finish()


def test_a_full_disk_skips_the_checkpoint_not_the_run(tmp_path, monkeypatch):
    import safetensors.torch

    real = safetensors.torch.save_file
    calls = []

    def full_at_step_4(tensors, path):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(tensors, path)

    monkeypatch.setattr(safetensors.torch, "save_file", full_at_step_4)
    parts = offline_parts(lora=False, moving=False)
    printed = []
    ckpts = C.Checkpoints(tmp_path, 2, keep=5, console=SimpleNamespace(print=lambda *a, **k: printed.append(a[0])))
    (tmp_path / "m").mkdir()
    last = run_train(tmp_path / "m", parts, train_spec(6, False, every=2), checkpoints=ckpts)[0]
    assert last["loss"] > 0 and ckpts.steps() == [2, 6] and not list(ckpts.root.glob(".tmp-*"))
    assert len(printed) == 1 and "checkpoint at step 4 not written" in printed[0] and "No space left" in printed[0]


def test_null_tracker_and_no_checkpoints_by_default(tmp_path):
    parts = offline_parts(lora=False, moving=False)
    spec = train_spec(2, False, every=0)
    train(spec.train, spec.humanline, parts, objective=spec.objective_cfg,
          rule=ReferenceRule.from_spec(spec.humanline, spec.regime), tracker=NullTracker(), timer=PhaseTimer(),
          checkpoints=C.Checkpoints(tmp_path, 0))
    assert not (tmp_path / "checkpoints").exists()


def _files(run: Path) -> dict:
    return {str(p.relative_to(run)): (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(run.rglob("*"))
            if p.is_file() and p.name != ".lock"}  # every job takes (and rewrites) the run dir's lock


def _one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr[-2000:]
    return lines[0]


def test_rerun_rules_through_the_cli(cache_dir, tmp_path):
    run = tmp_path / "run"
    args = ["train", *BASE, "train.steps=4", "train.checkpoint_every=2", f"hydra.run.dir={run}"]
    first = run_cli(args, tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    saved = json.loads((run / "resolved_config.json").read_text())
    assert saved["train"]["lr"] == 1e-3 and "hydra" not in saved
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2", "step_4"]
    before = _files(run)

    again = run_cli(args, tmp_path)  # complete, same config: nothing is touched, not even .hydra
    assert again.returncode == 0 and "already complete" in again.stderr, again.stderr[-2000:]
    assert _files(run) == before
    # a job killed (-9) after its complete summary.json, before releasing its lock: still final
    (run / ".lock").write_text(f"999999999 {socket.gethostname()}\n")
    stale = run_cli(args, tmp_path)
    assert stale.returncode == 0 and "taking it over" in stale.stderr and "already complete" in stale.stderr
    assert "resuming" not in stale.stderr and _files(run) == before

    other = run_cli([*args, "train.lr=2e-3", "seed=4"], tmp_path)
    line = _one_error_line(other.stderr)
    assert other.returncode == 2 and "another config" in line and "resume=false" in line
    assert "seed: 0 -> 4" in line and "train.lr: 0.001 -> 0.002" in line
    assert _files(run) == before  # nothing written: .hydra/ is the job's to write, after the checks, mtimes included

    over = run_cli([*args, "train.lr=2e-3", "seed=4", "resume=false"], tmp_path)
    assert over.returncode == 0, over.stderr[-2000:]
    old = run / "previous-1"
    for name, (_, data) in before.items():  # every old output moved aside intact, .hydra included
        if not name.startswith("train.log"):
            assert (old / name).read_bytes() == data, name
    assert json.loads((run / "resolved_config.json").read_text())["train"]["lr"] == 2e-3
    assert json.loads((run / "summary.json").read_text())["seed"] == 4


def test_sweep_skips_only_jobs_with_the_same_config(cache_dir, tmp_path):
    sweep = tmp_path / "sweep"
    args = ["train", "-m", "seed=0,1", *BASE, "train.steps=2", "train.save_model=false", f"hydra.sweep.dir={sweep}"]
    first = run_cli(args, tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    jobs = sorted(p.parent for p in sweep.glob("*/summary.json"))
    assert len(jobs) == 2
    before = {j: _files(j) for j in jobs}

    changed = run_cli([*args, "train.lr=1e-4"], tmp_path)
    assert changed.returncode == 2, changed.stderr[-2000:]
    refusals = [ln for ln in changed.stderr.splitlines() if "another config" in ln]
    assert len(refusals) == 2 and all("train.lr: 0.001 -> 0.0001" in ln for ln in refusals)
    assert {j: _files(j) for j in jobs} == before  # results and their .hydra/config.yaml untouched
    # (the same sweep again skips both: test_experiments.py::test_rerunning_a_sweep_skips_complete_runs)


def _rng_rank(rank: int, port: int, tmp: str, out) -> None:
    """One of 2 gloo ranks: its own seeds, a checkpoint's RNG entries through the files rank 0 writes, then the
    rank's numbers after a restore from them."""
    import os

    from safetensors.torch import save_file

    from humanline_cli.backend import init_distributed
    from humanline_cli.train.checkpoint import from_json, rank_rngs, rng_entries, set_rank_rng, to_json

    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    dist = init_distributed("cpu", 30)
    torch.manual_seed(100 + rank)
    random.seed(200 + rank)
    np.random.seed(300 + rank)
    rngs = rank_rngs(dist)
    drawn = (torch.rand(2).tolist(), random.random(), float(np.random.rand()))
    if rank == 0:  # rank 0 writes what every rank reads
        tensors, state = rng_entries(rngs)
        save_file(tensors, f"{tmp}/tensors.safetensors")
        Path(f"{tmp}/state.json").write_text(json.dumps(to_json(state)))
    torch.distributed.barrier()
    torch.manual_seed(0)  # whatever happened since
    random.seed(0)
    np.random.seed(0)
    set_rank_rng(load_file(f"{tmp}/tensors.safetensors"), from_json(json.loads(Path(f"{tmp}/state.json").read_text())),
                 rank)
    out.put((rank, drawn, (torch.rand(2).tolist(), random.random(), float(np.random.rand()))))
    torch.distributed.destroy_process_group()


def test_each_rank_resumes_from_its_own_rng_states(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    got = run_two_ranks("fork", _rng_rank, lambda ctx: (port, str(tmp_path)), 60)
    for rank, drawn, restored in got:
        assert restored == drawn, rank  # torch, python and numpy: the numbers this rank drew after the save
    assert got[0][1] != got[1][1]  # and the ranks' numbers differ (each its own seeds), as before the save
