"""Every `humanline train` command of the docs' "Scaling up" and "Reproducing the paper's tables" sections
(README.md and humanline_cli/docs/*.md), and the pinned paper-scale commands: each composes and validates with
backend=cuda at every point of its sweep, and each GPU command, run as a dry run against the device profile of the
card it is meant for (an 80 GB H100 with the GPUs per node its ranks take and the nodes its launcher allocates),
starts at every point: the micro-batch it takes, the estimate, the ranks per node, as a user would see them, with no
weight loaded. docs/scaling.md's table of every command on every card is the one generated from the same runs.
The hub models' sizes come from their published config.json files, in a fake huggingface_hub cache."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from importlib.resources import files
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_module

from humanline_cli.config import resolve
from humanline_cli.errors import UserError
from humanline_cli.memory import GB
from tests.helpers.gpu_table import (
    CARDS,
    SCALING,
    documented_commands,
    gpu_commands,
    hub_cache,
    outcomes,
    outcomes_of,
    overrides,
    render,
    specs,
    write_hub_cache,
)

ROOT = Path(__file__).resolve().parents[2]
# ArmoRM (paper_instruction_following's labeller and judge) runs its own code only where the command opts in
TRUST = "task.labeller.trust_remote_code=true task.judge.trust_remote_code=true"
# the paper-scale commands users must be able to type, pinned here whatever the docs say
PINNED = [
    f"humanline train -m backend=cuda backend.strategy=fsdp backend.nproc=8 experiment=paper_instruction_following "
    f"{TRUST}",
    "humanline train -m backend=cuda backend.strategy=fsdp backend.nproc=8 experiment=paper_math",
    f"humanline train backend=cuda model.lora.r=16 experiment=paper_instruction_following data=online {TRUST}",
    "humanline train backend=cuda experiment=paper_math data=online",
    "humanline train backend=cuda backend.strategy=fsdp backend.nproc=8 experiment=paper_math data=online sampler=hf",
    # LoRA under FSDP2 (adapters on the sharded base; merged weights gathered layer by layer for vLLM)
    "humanline train -m backend=cuda backend.strategy=fsdp backend.nproc=8 model.lora.r=16 "
    f"experiment=paper_instruction_following {TRUST}",
    # DDP holds a whole replica per GPU: LoRA at 8B (full fine-tuning is refused, test below)
    "humanline train -m backend=cuda backend.strategy=ddp backend.nproc=8 model.lora.r=16 "
    f"experiment=paper_instruction_following {TRUST}",
    "humanline train -m experiment=paper_math backend.strategy=fsdp backend.nproc=8 hydra/launcher=slurm "
    "hydra.launcher.gpus_per_node=8",
]
EXPERIMENTS = sorted(p.name[:-5] for p in files("conf").joinpath("experiment").iterdir() if p.name.endswith(".yaml"))
H100 = 79.11 * GB


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with hub_cache(tmp_path_factory.mktemp("hf")):
        yield


@pytest.fixture(scope="module")
def found(hub):
    """Every GPU command's (points, allocation), composed once for the tests below."""
    return {cmd: specs(cmd) for cmd in gpu_commands(PINNED)}


@pytest.fixture(scope="module")
def results(found):
    """Every GPU command (documented and pinned) on every card."""
    return {cmd: outcomes_of(*found[cmd]) for cmd in found}


def _validate_all(cmd: str, composed: dict) -> int:
    """Every point of `cmd` validates into a CUDA spec; humanline=... as swept (`composed`: the points found)."""
    points, _ = composed[cmd] if cmd in composed else specs(cmd)
    for point, spec in points:
        assert spec.backend_cfg.device.value == "cuda", point
        for kv in point:
            key, value = kv.split("=", 1)
            if key == "humanline":
                assert spec.humanline_on == yaml.safe_load(value)
    return len(points)


def _sweep_size(cmd: str) -> int:
    """objectives x {offline, online} x humanline on/off; experiment=paper_math (the authors' GRPO recipe): online,
    stale64 and humanline on stale64."""
    return 3 if "experiment=paper_math" in cmd.split() else 12


@pytest.mark.parametrize("cmd", documented_commands())
def test_documented_scaling_and_paper_commands_validate(cmd, found):
    n = _validate_all(cmd, found)
    # Hydra's -m after `train`, not python's `-m humanline_cli` of a torchrun line (a single run)
    if "experiment=paper_" in cmd and overrides(cmd)[1]:
        assert n == _sweep_size(cmd)


@pytest.mark.parametrize("cmd", PINNED)
def test_pinned_paper_scale_commands_validate(cmd, found):
    assert _validate_all(cmd, found) == (_sweep_size(cmd) if " -m " in cmd else 1)


@pytest.mark.parametrize("cmd", gpu_commands(PINNED))
def test_every_gpu_command_starts_on_80gb_h100s(cmd, found, results):
    """What a user of an 80 GB H100 node sees: every point starts, with a micro-batch that divides each rank's share
    of the batch, an estimate within 90% of the GPU, and one rank per GPU on each node."""
    args, _, launched = overrides(cmd)
    found, _ = found[cmd]
    nproc = launched or next((int(a.split("=")[1]) for a in args if a.startswith("backend.nproc=")), 1)
    nodes = next((int(a.split("=")[1]) for a in args if a.startswith("hydra.launcher.nodes=")), 1)
    got = results[cmd]["h100-80gb"]
    assert [r.point for r in got] == [p for p, _ in found]
    for r, (_, spec) in zip(got, found):
        assert r.started, f"{r.point}: {r.refusal}"
        share = spec.train.batch_size // spec.train.ranks
        assert share % r.micro == 0 and 0 < r.gib <= 0.9 * H100 / GB
        assert (r.ranks_per_node, r.nodes) == (nproc, nodes)


def test_the_fsdp_grid_takes_the_largest_micro_batch_that_fits_an_h100(results):
    """The FSDP grid's GRPO x online points (4 groups of 8 sequences of 2,048 tokens a rank) start on an 80 GB H100:
    the paper experiment's micro-batch is auto, and the sleeping vLLM engine's share is counted while it generates."""
    got = results[PINNED[0]]["h100-80gb"]
    grpo_online = [r for r in got if "objective=grpo" in r.point and "data=online" in r.point]
    # micro-batch 2: FSDP2 gathers the root (embeddings, head) in fp32 so that the head and log-softmax compute in
    # fp32 (log-ratios not quantised by bf16 logits), ~3 GiB more than a bf16 root at 8B
    assert len(grpo_online) == 2 and all(r.started and r.micro == 2 for r in grpo_online)
    # the whole batch a rank trains (32 pairs / 8 ranks = 4) in one micro-batch: auto took the largest that fits
    dpo_offline = [r for r in got if "objective=dpo" in r.point and "data=offline" in r.point]
    assert all(r.micro == 4 for r in dpo_offline)


def test_full_fine_tuning_under_ddp_at_8b_is_refused_with_fsdp_named(hub):
    """Every DDP rank holds the whole 8B model, its fp32 gradients, AdamW and the reference (~210 GiB): no card fits
    it, and the line says to shard with FSDP."""
    cmd = ("humanline train -m backend=cuda backend.strategy=ddp backend.nproc=8 experiment=paper_instruction_following "
           f"{TRUST}")
    for card, got in outcomes(cmd, ("h100-80gb", "h200")).items():
        assert len(got) == 12 and not any(r.started for r in got), card
        for r in got:
            assert r.refusal.startswith("the run will not fit: ") and "\n" not in r.refusal
            assert "under DDP each of the 8 ranks holds the whole model" in r.refusal
            assert "use backend.strategy=fsdp" in r.refusal


def _plan(cmd: str, profile: str):
    from humanline_cli.train.dry_run import plan

    found, allocation = specs(cmd)
    point, spec = found[0]
    return plan(dataclasses.replace(spec, backend_cfg=dataclasses.replace(spec.backend_cfg, profile=profile)),
                allocation)


def test_ranks_beyond_the_launchers_allocation_are_refused_before_launch(hub):
    """SLURM's preset allocates one GPU per job: 8 ranks would fail at torch.cuda.set_device on ranks 1-7."""
    cmd = "humanline train -m experiment=paper_math backend.strategy=fsdp backend.nproc=8 hydra/launcher=slurm"
    with pytest.raises(UserError) as e:
        _plan(cmd, "h100-80gb:8")
    assert str(e.value) == ("backend.nproc=8 starts 8 ranks per node, one per GPU, but the launcher allocates "
                            "hydra.launcher.gpus_per_node=1: set hydra.launcher.gpus_per_node=8 (or backend.nproc=1)")
    assert _plan(cmd + " hydra.launcher.gpus_per_node=8", "h100-80gb:8").ranks_per_node == 8
    with pytest.raises(UserError, match=r"^backend.nproc=8 starts 8 ranks per node, one per GPU, but the profile "
                                        r"h100-80gb:4 has 4 CUDA device\(s\): set backend.nproc=4"):
        _plan(cmd + " hydra.launcher.gpus_per_node=8", "h100-80gb:4")
    # bf16 (CUDA's default precision) on a GPU without it
    with pytest.raises(UserError, match="backend.precision=bf16 computes in bf16, which V100 32GB does not support"):
        _plan("humanline train backend=cuda experiment=paper_math data=online", "v100-32gb")


def test_a_sleeping_engine_leaves_training_the_gpu(hub):
    """Level-2 sleep frees the engine's weights and KV cache while the policy trains: a larger
    sampler.gpu_memory_utilization is refused only where the steady state does not fit beside the engine while it
    generates, not for the whole run. Qwen2.5-1.5B on one 80 GB H100 (training ~35.7 GiB at the paper's micro-batch):
    half the GPU for vLLM starts with sleep, and is refused without it (the training peak beside the engine)."""
    cmd = "humanline train backend=cuda experiment=paper_math data=online sampler.gpu_memory_utilization=0.5"
    p = _plan(cmd, "h100-80gb")
    assert p.estimate.steady + p.estimate.evaluation <= 0.9 * 0.5 * H100 < max(p.estimate.training, p.estimate.loading)
    assert max(p.estimate.training, p.estimate.loading) <= 0.9 * (H100 - 2 * GB)
    with pytest.raises(UserError, match=r"^train.micro_batch_size=1 will not fit: .* less 39.6 GiB for vLLM"):
        _plan(cmd + " sampler.sleep=false", "h100-80gb")
    with pytest.raises(UserError, match=r"^the steady state will not fit beside vLLM while it generates: "):
        _plan("humanline train backend=cuda experiment=paper_math data=online sampler.gpu_memory_utilization=0.8",
              "h100-80gb")


def test_the_scaling_table_is_the_generated_one(results):
    text = SCALING.read_text()
    assert render(text, {cmd: results[cmd] for cmd in gpu_commands()}) == text, \
        "docs/scaling.md's GPU table is out of date: run python -m tests.helpers.gpu_table"
    assert set(results[gpu_commands()[0]]) == set(CARDS)


def test_the_dry_run_prints_what_the_run_would_start_with(tmp_path):
    """`backend.profile=...` on the command line: the run's header as on that machine, exit 0, no weight loaded and
    the run dir left without a record; a refusal is one line and exit 2."""
    cache = write_hub_cache(tmp_path / "hub")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
           "HF_MODULES_CACHE": str(tmp_path / "modules"), "HOME": str(tmp_path)}
    base = [sys.executable, "-m", "humanline_cli", "train", "backend=cuda", "backend.strategy=fsdp", "backend.nproc=8",
            "experiment=paper_instruction_following", "objective=grpo", "data=online", f"hydra.run.dir={tmp_path}/run"]
    # ArmoRM's own code without the opt-in: one line naming both keys, before any weight loads
    done = subprocess.run([*base, "backend.profile=h100-80gb:8"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "humanline: error: reward model RLHFlow/ArmoRM-Llama3-8B-v0.1 needs its own code to load (config.json "
        "auto_map); if you trust it, set task.labeller.trust_remote_code=true and task.judge.trust_remote_code=true"]
    base += TRUST.split()
    done = subprocess.run([*base, "backend.profile=h100-80gb:8"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    err = done.stderr
    assert "dry run on backend.profile=h100-80gb:8" in err
    assert "8 H100 80GB (79.1 GiB each); 8 rank(s) per node (fsdp, backend.precision=bf16)" in err
    assert "(micro-batch 2 x 2 accumulation)" in err and "FSDP over 8 ranks" in err  # the fp32 root: see above
    assert err.rstrip().endswith("humanline: dry run: the run would start; no weight was loaded")
    assert not (tmp_path / "run" / ".hydra").exists()
    done = subprocess.run([*base, "backend.profile=a100-40gb:8"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()
    assert len(last) == 1 and last[0].startswith("humanline: error: the run will not fit: "), done.stderr


def test_a_profile_that_names_no_card_is_refused_in_one_line():
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose("train", overrides=["backend=cuda", "backend.profile=h100:8"])
    with pytest.raises(UserError, match=r"^config key 'backend.profile': 'h100:8' is not CARD\[:N\[xM\]\]"):
        resolve(cfg)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_sampler_hf_composes_with_every_experiment(name):
    """The sampler's keys live in conf/sampler/*.yaml: no experiment file sets a vLLM-only key, so
    `sampler=hf` composes (and validates, online included) with each of them."""
    # paper_math, the frontier with sync K, the async corrections and the smollm2 studies are online only (their
    # stale rounds are data.generate_every on online data; the chat task has no offline file)
    online_only = name in ("paper_math", "laptop_headroom_frontier_sync", "laptop_corrections_async") or \
        name.startswith("smollm2")
    for regime in ("online",) if online_only else ("offline", "online"):
        with initialize_config_module(config_module="conf", version_base="1.3"):
            cfg = compose("train", overrides=[f"experiment={name}", "sampler=hf", f"data={regime}"])
        spec = resolve(cfg)
        assert spec.sampler_cfg.name == "hf" and spec.regime == regime
