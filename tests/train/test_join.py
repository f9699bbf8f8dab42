"""Joining ranks another launcher started (torchrun): rank 0 alone locks and prepares the run dir while the
others wait for it in the gloo wait group, never in a collective of the training group, whose timeout
(backend.timeout_s) is meant to catch a frozen rank. Two real gloo ranks in two processes; no training."""
from __future__ import annotations

import multiprocessing
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as tdist
from omegaconf import OmegaConf

from humanline_cli.train.job import Context, Job

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
    ctx = multiprocessing.get_context("fork")  # the ranks start with this process's imports: seconds, not ten
    start, done = ctx.Barrier(2), ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_join_rank, args=(r, port, str(tmp_path / "run"), start, done)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    ends = sorted(done.get(timeout=5) for _ in procs)
    assert [e[:4] for e in ends] == [(0, 0, None, "gloo"), (1, 0, None, "gloo")]
    assert ends[1][4] >= PREPARE_S > TIMEOUT_S  # rank 1 really waited out rank 0's prepare
