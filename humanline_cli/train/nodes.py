"""A SLURM job of several nodes (hydra/launcher=slurm_multinode): every node runs the same `humanline train` job on
one run dir that every node must see (a shared file system). Node 0 alone locks and prepares the dir (validate, the
resume rule, the record) and leaves a marker, JSON: prepared (or nothing to do), or the error that stopped it. The
other nodes wait for that marker, then start their ranks, which meet node 0's at rendezvous. The marker holds no
object (never a pickle to load): the other nodes resolve the same config to the same spec.

Consumes the node's place (`slurm_nodes`, read once per process from SLURM's environment) and the job's own
preparation; produces the spec each node launches, or the error every node ends with.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from humanline_cli.config import RunSpec
from humanline_cli.errors import RunFailed, UserError, one_line

NODE0_MARKER = ".node0-"  # + Nodes.job: node 0 prepared the run dir (or its error), JSON, for the other nodes of its job
NODE0_WAIT_S = 3600.0     # how long another node waits for it: a resume's prepare hashes the checkpoint (minutes)


@dataclass(frozen=True)
class Nodes:
    """This node's place in a SLURM job of several nodes (index 0 of count 1 elsewhere); `job` names the job and
    its restart (a requeued job keeps its id), so a marker left by an earlier one is never taken for its own."""

    index: int = 0
    count: int = 1
    job: str = ""

    @property
    def marker(self) -> str:
        return f"{NODE0_MARKER}{self.job}"


def slurm_nodes(env=None) -> Nodes:
    """Nodes as SLURM set them for a job's task (srun: SLURM_NNODES, SLURM_NODEID); read once per process."""
    env = os.environ if env is None else env
    count = int(env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES", "1")) or 1)
    if count <= 1:
        return Nodes()
    return Nodes(int(env.get("SLURM_NODEID", "0") or 0), count,
                 f"{env.get('SLURM_JOB_ID', 'job')}.{env.get('SLURM_RESTART_COUNT', '0') or 0}")


def clear_markers(run_dir: Path) -> None:
    """Earlier jobs' markers (never outputs of a run), removed by the job that now holds the dir's lock."""
    for old in run_dir.glob(f"{NODE0_MARKER}*"):
        old.unlink(missing_ok=True)


def prepare_on_node0(nodes: Nodes, run_dir: Path, prepare: Callable[[], RunSpec | None],
                     starts_ranks: Callable[[RunSpec], bool]) -> tuple[RunSpec | None, Path | None]:
    """Node 0: `prepare()` (lock, validate, the resume rule, the record; None: nothing to do), and whether it
    prepared, or its error, left in the run dir for the other nodes. Returns (spec, the marker to remove once every
    node's ranks met: None where nothing launches)."""
    path = run_dir / nodes.marker
    try:
        spec = prepare()
        if spec is not None and not starts_ranks(spec):  # each node would train alone, into one run dir
            raise UserError(f"{nodes.count} nodes need ranks to meet: backend.strategy=ddp or fsdp "
                            f"with backend.nproc >= 2 (the GPUs of one node)")
    except Exception as e:
        with contextlib.suppress(OSError):  # a run dir it cannot write: the other nodes time out saying so
            _leave_marker(path, {"error": one_line(e), "user": isinstance(e, UserError)})
        raise
    _leave_marker(path, {"prepared": spec is not None})
    return spec, (path if spec is not None else None)


def wait_for_node0(nodes: Nodes, run_dir: Path, resolve_spec: Callable[[], RunSpec]) -> RunSpec | None:
    """Node 1..: the spec node 0 prepared (`resolve_spec()`: the same config resolved here; None: nothing to do),
    or node 0's error, raised here so that the job ends the same way on every node."""
    path = run_dir / nodes.marker
    deadline = time.monotonic() + NODE0_WAIT_S
    while not path.is_file():
        if time.monotonic() > deadline:
            raise UserError(f"node {nodes.index} of {nodes.count}: node 0 did not prepare {run_dir} "
                            f"within {NODE0_WAIT_S:g} s (no {path.name}); the nodes of a job need a shared file "
                            f"system holding the run dir (hydra.run.dir / hydra.sweep.dir on it)")
        time.sleep(0.2)
    box = json.loads(path.read_text())
    if "error" in box:  # node 0's own line (a busy run dir, a bad config)
        raise UserError(box["error"]) if box["user"] else RunFailed(f"node 0: {box['error']}")
    if not box["prepared"]:  # a complete run: nothing to do on any node
        return None
    return resolve_spec()


def _leave_marker(path: Path, box: dict) -> None:
    """Node 0's result for the other nodes, whole or not at all (they poll for the file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(box))
    os.replace(tmp, path)
