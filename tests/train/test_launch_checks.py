"""A job that starts more ranks per node than the launcher allocates GPUs, or than the node shows CUDA devices, stops
in one line (exit 2) before any rank starts and before the run dir gets a record: a rank beyond them would fail at
torch.cuda.set_device with "invalid device ordinal". CUDA is faked (device count, properties): the check reads only
those."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from humanline_cli.memory import GB

SLURM = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"


@pytest.fixture
def gpus(monkeypatch):
    """A node that shows `n` H100s."""
    def show(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda i: SimpleNamespace(total_memory=int(79.11 * GB), name="NVIDIA H100 80GB HBM3"))
    return show


def _job(tmp_path, *overrides: str, launcher: dict | None = None):
    from humanline_cli.train.job import Context, HydraRecord, Job

    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose("train", overrides=["backend=cuda", "backend.strategy=ddp", *overrides])
    record = HydraRecord(cfg, OmegaConf.create({"hydra": {"launcher": launcher or {}}}), [])
    return Job(cfg, Context(tmp_path / "run", Path(tmp_path)), record)


def test_more_ranks_than_visible_gpus_stop_before_launch(tmp_path, gpus, monkeypatch):
    from humanline_cli.train import job

    gpus(1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.setattr(job, "_launch", lambda *a: pytest.fail("the ranks were started"))
    end = _job(tmp_path, "backend.nproc=2").run()
    assert (end.code, end.message) == (2, "backend.nproc=2 starts 2 ranks per node, one per GPU, but this node shows 1 "
                                          "CUDA device(s) (CUDA_VISIBLE_DEVICES=3): set backend.nproc=1 or run where 2 "
                                          "GPUs are visible")
    assert not (tmp_path / "run" / ".hydra").exists()


def test_more_ranks_than_the_slurm_allocation_stop_before_launch(tmp_path, gpus, monkeypatch):
    from humanline_cli.train import job

    gpus(8)
    monkeypatch.setattr(job, "_launch", lambda *a: pytest.fail("the ranks were started"))
    end = _job(tmp_path, "backend.nproc=8", launcher={"_target_": SLURM, "gpus_per_node": 1, "nodes": 1}).run()
    assert (end.code, end.message) == (2, "backend.nproc=8 starts 8 ranks per node, one per GPU, but the launcher "
                                          "allocates hydra.launcher.gpus_per_node=1: set hydra.launcher.gpus_per_node=8 "
                                          "(or backend.nproc=1)")
    started = []
    monkeypatch.setattr(job, "_launch", lambda spec, ctx, nproc: started.append(nproc))
    end = _job(tmp_path, "backend.nproc=8", launcher={"_target_": SLURM, "gpus_per_node": 8, "nodes": 1}).run()
    assert end.code == 0 and started == [8]  # the allocation holds the ranks: they start
