"""Start the ranks of a distributed job with torch's own launcher, after Hydra composed ONCE.

`humanline train backend=ddp|fsdp backend.nproc=N`: the Hydra job (one process, one run dir, one
resolved config, one `${now:}`) hands the resolved config to N ranks started by torch's elastic
launch API (`torch.distributed.launcher.api.elastic_launch`, the engine behind torchrun), on one
node. Under CUDA each rank takes one GPU (NCCL), else ranks run on CPU with gloo.

`torchrun --nproc_per_node N -m humanline_cli train ...` also works: every rank runs Hydra, rank 0's
run dir is broadcast to the others (theirs point at a throwaway dir, see cli.main), and only rank 0
writes outputs.
"""
from __future__ import annotations

import logging
import os
import signal
import uuid
from pathlib import Path

from humanline_cli.errors import Interrupted, Preempted, RunFailed


def spawn_count(cfg) -> int:
    """How many ranks this job must start itself (0: run here, in this process)."""
    if "WORLD_SIZE" in os.environ:  # already a rank (torchrun, SLURM + torchrun, or our own launch)
        return 0
    backend = cfg.get("backend") or {}
    strategy = backend.get("strategy", "single")
    strategy, nproc = str(getattr(strategy, "value", strategy)), int(backend.get("nproc", 1) or 1)
    return nproc if strategy in ("ddp", "fsdp") and nproc > 1 else 0


def _rank_entry(config_yaml: str, run_dir: str):
    """One rank: rebuild the resolved config, run the job. A failure is recorded (failures.record,
    done by run_job) and ends this process at once with the CLI's exit code: the elastic agent then
    stops every other rank, and the launching process reports this rank's own message."""
    import sys

    import torch.distributed as tdist
    from omegaconf import OmegaConf

    from humanline_cli.train.failures import EXIT, kind_of, release_semaphores
    from humanline_cli.train.run import run_job

    signal.signal(signal.SIGTERM, _sigterm_default)  # outside StopSignal's reach (e.g. cleaning up after a failure)
    try:
        run_job(OmegaConf.create(config_yaml), Path(run_dir))
    except KeyboardInterrupt:  # Ctrl-C: rank 0 wrote failed.json (with the step); leave at once, as a
        sys.stdout.flush()       # failure does (a normal exit can wait on the process group's threads)
        sys.stderr.flush()
        release_semaphores()
        os._exit(130)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - every failure ends the rank the same way
        if kind_of(e) == "bug":  # a bug: its traceback on this rank's stderr, as one process would show it
            import traceback

            traceback.print_exception(e, file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        # no destroy_process_group: under NCCL it can wait on the peers this failure left in a collective
        release_semaphores()
        os._exit(EXIT[kind_of(e)])
    if tdist.is_initialized():
        tdist.destroy_process_group()
    return None


def _sigterm_default(signum, frame) -> None:
    """SIGTERM outside StopSignal's reach: the agent's SIGTERM to the surviving ranks when one failed may land
    while they clean up; die as SIGTERM's default would, semaphores released first."""
    from humanline_cli.train.failures import die_by_sigterm

    die_by_sigterm()


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


def launch(cfg, run_dir: Path, nproc: int) -> None:
    """Run the job on `nproc` ranks per node. If any rank fails, every rank ends (the elastic agent
    stops them) and this raises the FAILING rank's own message, as UserError (exit 2), RunFailed
    (exit 2) or failures.RankCrashed (a bug, exit 1), after writing it to failed.json."""
    from omegaconf import OmegaConf
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from humanline_cli.config import resolve
    from humanline_cli.train import failures
    from humanline_cli.train.build import prepare_model, prepare_world
    from humanline_cli.train.tracking import write_json_atomic

    # the bundled world is built here, once, on first use (minutes of CPU SFT), before any rank exists:
    # ranks waiting for another rank's build would sit in a collective past backend.timeout_s
    spec = resolve(cfg)
    prepare_world(spec)
    prepare_model(spec)  # a packaged model is converted here too, once, for the same reason
    config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
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
        elastic_launch(conf, _rank_entry)(config_yaml, str(run_dir))
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
        raise Preempted(f"stopped by {signal.Signals(e.sigval).name} (the ranks ended without a checkpoint); "
                        f"rerun the same command to resume from the last checkpoint") from None
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
        if Path(run_dir).is_dir():  # rank 0 may have died second, on the transport error: the cause is rec
            write_json_atomic(Path(run_dir) / "failed.json", failures.failed_json(rec))
        raise failures.as_exception(rec) from None
    finally:
        quiet.setLevel(level)
        agent.setLevel(agent_level)
        failures.clear(run_dir, conf.run_id)


def shared_run_dir(run_dir: Path, cfg=None) -> Path:
    """Under an external launcher (torchrun), every rank adopts rank 0's run dir (joining the process
    group here, with the job's backend.timeout_s)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return run_dir
    import torch
    import torch.distributed as tdist

    from humanline_cli.backend import init_distributed

    backend = (cfg.get("backend") if cfg is not None else None) or {}
    init_distributed("cuda" if torch.cuda.is_available() else "cpu", backend.get("timeout_s"))
    box = [str(run_dir)]
    tdist.broadcast_object_list(box, src=0)
    return Path(box[0])


def _record_interrupt_in_failed_json(run_dir: Path, where: str) -> None:
    """Rank 0 wrote failed.json with a peer's exit as the cause when that exit reached it before its own
    Ctrl-C did; the job was interrupted, so failed.json says that, with the step a rank recorded."""
    import json

    from humanline_cli.train import failures
    from humanline_cli.train.tracking import write_failed_json

    path = run_dir / "failed.json"
    try:
        failed = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # not written (no run dir yet, or a full disk): nothing to correct
    if failed.get("interrupted"):
        return
    write_failed_json(path, failures.interrupted_json(where, failed.get("wall_clock_s")))
