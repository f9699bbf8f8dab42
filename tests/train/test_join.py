"""One job started several times by another launcher: torchrun's ranks (rank 0 alone locks and prepares the run dir
while the others wait for it in the gloo wait group, never in a collective of the training group, whose timeout,
backend.timeout_s, is meant to catch a frozen rank), and SLURM's nodes (node 0 alone locks and prepares; the
others wait for its marker, then launch their ranks). Each in two real processes; no training."""
from __future__ import annotations

import multiprocessing
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as tdist
from omegaconf import OmegaConf

from humanline_cli.train import job as job_module
from humanline_cli.train.job import Context, Job
from humanline_cli.train.lock import RunDirLock
from humanline_cli.train.nodes import slurm_nodes
from tests.helpers.cli import TINY_WORLD
from tests.helpers.ranks import run_two_ranks

PREPARE_S = 5.0  # rank 0's prepare (hashing a checkpoint to resume, in a real run) ...
TIMEOUT_S = 2    # ... outlasts the training group's timeout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join_rank(rank: int, port: int, run_dir: str, start, done) -> None:
    """One torchrun rank: the environment torchrun sets, then the job's join, with a slow prepare."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})

    def slow_prepare(self, lock):
        lock.acquire()
        time.sleep(PREPARE_S)
        return None  # a complete run: every rank ends with exit 0 after the hand-out

    Job._prepare = slow_prepare
    torch.cuda.is_available = lambda: True  # a CUDA host: backend.device=cpu still means gloo and CPU tensors
    cfg = OmegaConf.create({"backend": {"device": "cpu", "timeout_s": TIMEOUT_S}})
    start.wait()  # both ranks meet at rendezvous together: only the prepare is slow
    t0 = time.monotonic()
    end = Job(cfg, Context(Path(run_dir), Path(run_dir), rank, 2)).run()
    done.put((rank, end.code, end.message, tdist.get_backend(), time.monotonic() - t0))


def test_a_slow_rank0_prepare_outlasting_the_timeout_completes_on_gloo_for_backend_cpu(tmp_path):
    port = _free_port()
    # fork: the ranks start with this process's imports (seconds, not ten)
    ends = run_two_ranks("fork", _join_rank, lambda ctx: (port, str(tmp_path / "run"), ctx.Barrier(2)), 120)
    assert [e[:4] for e in ends] == [(0, 0, None, "gloo"), (1, 0, None, "gloo")]
    assert ends[1][4] >= PREPARE_S > TIMEOUT_S  # rank 1 really waited out rank 0's prepare


def _slurm_node(index: int, run_dir: str, cfg, done) -> None:
    """One node's task of a 2-node SLURM job (what submitit runs on each node), its launch recorded instead of
    run; node 0's prepare takes a second longer, so node 1 has to wait for it."""
    os.environ.update({"SLURM_NNODES": "2", "SLURM_NODEID": str(index), "SLURM_JOB_ID": "41"})
    prepare = Job._prepare

    def slow_prepare(self, lock):
        spec = prepare(self, lock)
        time.sleep(1.0)
        done.put(("prepared", index, time.monotonic()))
        return spec

    def launch(spec, ctx, nproc):
        done.put(("launch", index, time.monotonic(), nproc, spec, (Path(run_dir) / ".lock").read_text()))
        time.sleep(0.5)  # the ranks run: node 0 holds the lock meanwhile

    Job._prepare, job_module._launch = slow_prepare, launch
    end = Job(cfg, Context(Path(run_dir), Path(run_dir), nodes=slurm_nodes())).run()
    done.put(("end", index, end.code, end.message))


def _two_nodes(run_dir: Path, cfg) -> dict:
    ctx = multiprocessing.get_context("fork")
    done = ctx.Queue()
    procs = [ctx.Process(target=_slurm_node, args=(i, str(run_dir), cfg, done)) for i in (1, 0)]  # node 1 first
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    got: dict = {}
    while not done.empty():
        event = done.get(timeout=5)
        got[event[:2]] = event[2:]
    return got


def test_slurm_nodes_node0_alone_locks_and_prepares_the_others_wait_for_it(tmp_path):
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose("train", overrides=[*TINY_WORLD, "backend=cpu", "backend.strategy=ddp", "backend.nproc=2"])
    run = tmp_path / "run"
    got = _two_nodes(run, cfg)
    assert ("prepared", 1) not in got  # node 1 never prepared the run dir (nor took its lock)
    (t0_prepared,), (t0, n0, spec0, lock0), (t1, n1, spec1, lock1) = \
        got[("prepared", 0)], got[("launch", 0)], got[("launch", 1)]
    assert spec1 == spec0 and n0 == n1 == 2  # node 0's spec, handed over whole
    assert t1 >= t0_prepared and t0 >= t0_prepared  # node 1 launched only once node 0 had prepared
    assert lock0 == lock1 and lock0.split()[0].isdigit()  # node 0's pid held the lock through both launches
    assert got[("end", 0)] == got[("end", 1)] == (0, None)
    # node 0's record and log alone; the marker is gone once the ranks ran
    assert sorted(p.name for p in run.iterdir()) == [".lock", "resolved_config.json", "train.log"]
    # node 0 refused (the run dir is another job's): node 1 ends with node 0's own line, and launches nothing
    with RunDirLock(run):
        got = _two_nodes(run, cfg)
    assert not any(k[0] in ("launch", "prepared") for k in got)
    assert got[("end", 0)] == got[("end", 1)] and got[("end", 0)][0] == 2
    assert got[("end", 0)][1].startswith(f"{run} is in use by another job (pid {os.getpid()} on ")
    # one process per node would train alone, each into the same run dir: refused on every node, before a launch
    with initialize_config_module(config_module="conf", version_base="1.3"):
        single = compose("train", overrides=[*TINY_WORLD, "backend=cpu"])
    got = _two_nodes(tmp_path / "single", single)
    assert not any(k[0] == "launch" for k in got)
    assert got[("end", 0)] == got[("end", 1)] == (2, "2 nodes need ranks to meet: backend.strategy=ddp or fsdp with "
                                                     "backend.nproc >= 2 (the GPUs of one node)")
