"""How often a checkpoint's files are hashed (at 8B a checkpoint is ~112 GB): once per file per save, and
on resume once per file by rank 0 alone, whose verdict every rank gets (2 gloo ranks): never once per rank."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as tdist
import torch.multiprocessing as mp

from humanline_cli.backend import Dist
from humanline_cli.train import checkpoint as C

SHARDS = ["shards/__0_0.distcp", "shards/__1_0.distcp", "shards/.metadata"]


def _checkpoint(root: Path) -> Path:
    path = root / "step_4"
    (path / "shards").mkdir(parents=True)
    for i, name in enumerate([*C.FILES, *SHARDS]):
        (path / name).write_bytes(os.urandom(1000 + i))
    (path / C.CHECKSUMS).write_text(json.dumps(C.checksums(path)))
    return path


def _counting(monkeypatch) -> list:
    calls: list = []
    real = C._sha256
    monkeypatch.setattr(C, "_sha256", lambda p: (calls.append(Path(p).name), real(p))[1])
    return calls


def test_a_save_hashes_each_file_once(tmp_path, monkeypatch):
    path = _checkpoint(tmp_path)
    calls = _counting(monkeypatch)
    sums = C.checksums(path)
    assert sorted(calls) == sorted(Path(n).name for n in [*C.FILES, *SHARDS]) and len(sums) == len(calls)
    assert C.verify(path) is None and len(calls) == 2 * len(sums)  # verify: once more per file


def _rank(rank: int, store: str, path: str, out: str) -> None:
    tdist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        calls: list = []
        real = C._sha256
        C._sha256 = lambda p: (calls.append(1), real(p))[1]
        dist = Dist(rank, 2, rank)
        intact = C.verified_by_rank0(Path(path), dist)
        n_intact = len(calls)
        tdist.barrier()
        if rank == 0:  # truncate one shard
            shard = Path(path) / SHARDS[1]
            shard.write_bytes(shard.read_bytes()[:10])
        tdist.barrier()
        damaged = C.verified_by_rank0(Path(path), dist)
        Path(f"{out}.{rank}").write_text(json.dumps([intact, n_intact, damaged, len(calls)]))
    finally:
        tdist.destroy_process_group()


def test_a_resume_hashes_on_rank0_only_and_every_rank_gets_its_verdict(tmp_path):
    path = _checkpoint(tmp_path)
    n = len([*C.FILES, *SHARDS])
    out = str(tmp_path / "res")
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(path), out), nprocs=2, join=True)
    r0, r1 = (json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1))
    assert r0[0] is None and r1[0] is None and r0[1] == n and r1[1] == 0
    assert r0[2] == r1[2] == "shards/__1_0.distcp (10 bytes) does not match its sha256 (truncated or altered)"
    assert r0[3] == 2 * n and r1[3] == 0
