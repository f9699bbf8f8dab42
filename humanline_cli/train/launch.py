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

import os
import uuid
from pathlib import Path

from humanline_cli.errors import RunFailed, UserError


def spawn_count(cfg) -> int:
    """How many ranks this job must start itself (0: run here, in this process)."""
    if "WORLD_SIZE" in os.environ:  # already a rank (torchrun, SLURM + torchrun, or our own launch)
        return 0
    backend = cfg.get("backend") or {}
    strategy = backend.get("strategy", "single")
    strategy, nproc = str(getattr(strategy, "value", strategy)), int(backend.get("nproc", 1) or 1)
    return nproc if strategy in ("ddp", "fsdp") and nproc > 1 else 0


def _rank_entry(config_yaml: str, run_dir: str):
    """One rank: rebuild the resolved config, run the job; errors come back as values (one line)."""
    import torch.distributed as tdist
    from omegaconf import OmegaConf

    from humanline_cli.train.run import run_job

    try:
        run_job(OmegaConf.create(config_yaml), Path(run_dir))
        return None
    except UserError as e:
        return ("user", str(e))
    except RunFailed as e:
        return ("run", str(e))
    finally:
        if tdist.is_initialized():
            tdist.destroy_process_group()


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
    """Run the job on `nproc` ranks per node; raise UserError / RunFailed with rank 0's message."""
    from omegaconf import OmegaConf
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    conf = launch_config(nproc)
    try:
        results = elastic_launch(conf, _rank_entry)(config_yaml, str(run_dir))
    except ChildFailedError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else "ChildFailedError"
        raise RunFailed(f"a rank crashed: {first}") from None
    errors = [results[r] for r in sorted(results) if results[r] is not None]
    if errors:
        kind, msg = errors[0]
        raise (UserError if kind == "user" else RunFailed)(msg)


def shared_run_dir(run_dir: Path) -> Path:
    """Under an external launcher (torchrun), every rank adopts rank 0's run dir."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return run_dir
    import torch
    import torch.distributed as tdist

    from humanline_cli.backend import init_distributed

    init_distributed("cuda" if torch.cuda.is_available() else "cpu")
    box = [str(run_dir)]
    tdist.broadcast_object_list(box, src=0)
    return Path(box[0])
