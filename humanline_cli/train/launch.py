"""Start the ranks of a distributed job with torch's own launcher, after Hydra composed ONCE.

`humanline train backend=ddp|fsdp backend.nproc=N`: the job (one process, one run dir, one validated
spec, one `${now:}`) hands the spec to N ranks started by torch's elastic launch API
(`torch.distributed.launcher.api.elastic_launch`, the engine behind torchrun), on one node or across a
SLURM allocation. Under CUDA each rank takes one GPU (NCCL), else ranks run on CPU with gloo. When a rank
fails, this turns the agent's report into that rank's own exception (train/failures.py's records).

`torchrun --nproc_per_node N -m humanline_cli train ...` starts the ranks itself: train/job.py joins them.
"""
from __future__ import annotations

import logging
import os
import signal
import uuid
from pathlib import Path

from humanline_cli.errors import Interrupted, Preempted, RunFailed


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[003-005,010],cpu1' -> 'gpu003', 'a01,a02' -> 'a01'."""
    head = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist[: nodelist.index("]") + 1]
    if "[" not in head:
        return head
    prefix, rng = head.split("[", 1)
    return prefix + rng.rstrip("]").split(",")[0].split("-")[0]


def launch_config(nproc: int, env=None):
    """torch's LaunchConfig for this job: one node (c10d on a free local port), or, inside a SLURM
    allocation of several nodes (the `hydra/launcher=slurm_multinode` preset runs one task per node),
    every node's agent meets at the first node's c10d store and each starts `nproc` ranks; the global
    rank 0 (on the first node to join) writes the outputs."""
    from torch.distributed.launcher.api import LaunchConfig

    env = os.environ if env is None else env
    nodes = int(env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES", "1")) or 1)
    if nodes > 1:
        master = env.get("MASTER_ADDR") or first_host(env["SLURM_JOB_NODELIST"])
        port = env.get("MASTER_PORT", "29500")
        return LaunchConfig(min_nodes=nodes, max_nodes=nodes, nproc_per_node=nproc,
                            run_id=f"humanline-{env.get('SLURM_JOB_ID', 'job')}", rdzv_backend="c10d",
                            rdzv_endpoint=f"{master}:{port}", max_restarts=0, monitor_interval=1.0,
                            start_method="spawn")
    return LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
                        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.2,
                        start_method="spawn")


def launch(entry, args: tuple, run_dir: Path, nproc: int) -> None:
    """Run `entry(*args)` on `nproc` ranks per node (fresh processes: `entry` and `args` are pickled). If any
    rank fails, every rank ends (the elastic agent stops them) and this raises the FAILING rank's own message,
    as UserError (exit 2), RunFailed (exit 2) or RankCrashed (a bug, exit 1), after writing it to failed.json."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from humanline_cli.train import failures

    conf = launch_config(nproc)
    # the agent logs each dead rank's exit as a multi-line traceback of its own polling code; the
    # failing rank's message (and a bug's traceback, on that rank's stderr) is what the user needs
    quiet = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    agent = logging.getLogger("torch.distributed.elastic.agent.server.api")  # "Received 2 death signal": we
    agent_level = agent.level                                                 # say it in our one line
    agent.setLevel(logging.ERROR)
    try:
        elastic_launch(conf, entry)(*args)
    except SignalException as e:
        # this process got SIGINT/SIGTERM: the agent forwarded it to every rank and waited (30 s at most)
        # for them to stop: after a checkpoint (SIGTERM, signals.StopSignal) or with "interrupted" in
        # rank 0's failed.json (Ctrl-C). Report it as one process would.
        rec = failures.root_cause(run_dir, conf.run_id)
        if rec is not None and rec["type"] == "Preempted":
            raise failures.as_exception(rec) from None
        if e.sigval == signal.SIGINT:  # the step a rank recorded: rank 0's failed.json may lack it (rank 0 died of
            where = failures.interrupted(run_dir, conf.run_id)  # a peer's exit before its own Ctrl-C landed)
            if where is not None:
                _record_interrupt_in_failed_json(Path(run_dir), where)
            raise (Interrupted(where) if where else KeyboardInterrupt()) from None
        raise Preempted(f"stopped by {signal.Signals(e.sigval).name} (the ranks ended without a new checkpoint); "
                        f"{failures.rerun_hint(Path(run_dir))}") from None
    except ChildFailedError as e:
        rec = failures.root_cause(run_dir, conf.run_id)
        dead = failures.killed(e, run_dir, conf.run_id, conf.nproc_per_node * conf.max_nodes)
        # the others only saw it go; a timeout is the better message (the silent rank froze, then the
        # agent killed it)
        if dead is not None and (rec is None or (rec.get("secondary") and not rec.get("timeout"))):
            rec = {**dead, "wall_clock_s": (rec or {}).get("wall_clock_s", {})}
        if rec is None:  # killed without a word (kill -9, out of memory, a segfault)
            first = str(e).strip().splitlines()[0] if str(e).strip() else "ChildFailedError"
            raise RunFailed(f"a rank crashed: {first}") from None
        # rank 0 may have died second, on the transport error: failed.json says the root cause, rec
        failures.write_failed(run_dir, failures.failed_json(rec))
        raise failures.as_exception(rec) from None
    finally:
        quiet.setLevel(level)
        agent.setLevel(agent_level)
        failures.clear(run_dir, conf.run_id)


def _record_interrupt_in_failed_json(run_dir: Path, where: str) -> None:
    """Rank 0 wrote failed.json with a peer's exit as the cause when that exit reached it before its own
    Ctrl-C did; the job was interrupted, so failed.json says that, with the step a rank recorded."""
    import json

    from humanline_cli.train import failures

    try:
        failed = json.loads((run_dir / failures.FAILED_JSON).read_text())
    except (OSError, ValueError):
        return  # not written (no run dir yet, or a full disk): nothing to correct
    if failed.get("interrupted"):
        return
    failures.write_failed(run_dir, failures.interrupted_json(where, failed.get("wall_clock_s")))
