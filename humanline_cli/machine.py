"""What the memory fit and the launch checks know of the machine a run starts on: per-device memory as torch
reports it, the devices one node shows, the nodes, bf16 support, and the launcher's allocation (SLURM's GPUs per
node). The real machine (`this_machine`, from torch.cuda), or a device profile (`backend.profile=CARD[:N[xM]]`,
`parse_profile`): a GPU card described by its numbers, so that a GPU command is checked on any CPU exactly as it
would be on the card, and stops before any weight loads (train/dry_run.py).

`check_launch` is the one check of ranks against devices: a job that starts more ranks per node than the node shows
devices, or than the launcher allocates, stops in one line (exit 2) before any rank starts; so does bf16 on a GPU
without it.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from humanline_cli.errors import UserError

GB = 1024**3


@dataclass(frozen=True)
class Card:
    label: str
    memory: float  # bytes per device: torch.cuda.get_device_properties(i).total_memory (a little under nvidia-smi's)
    bf16: bool


# total_memory as torch reports it (its "total capacity of ... GiB" in an out-of-memory message), rounded to 0.01 GiB
CARDS = {
    "a100-40gb": Card("A100 40GB", 39.39 * GB, True),
    "a100-80gb": Card("A100 80GB", 79.15 * GB, True),
    "h100-80gb": Card("H100 80GB", 79.11 * GB, True),
    "h200": Card("H200", 139.81 * GB, True),
    "v100-32gb": Card("V100 32GB", 31.74 * GB, False),
}
PROFILE = re.compile(r"(?P<card>[a-z0-9-]+)(?::(?P<devices>\d+)(?:x(?P<nodes>\d+))?)?")


@dataclass(frozen=True)
class Machine:
    """A machine as the checks see it; `profile`: the backend.profile that described it (None: the real one)."""

    device: str            # cuda | cpu
    memory: float          # bytes per device (0: unknown)
    devices: int           # devices one node shows (CUDA_VISIBLE_DEVICES applied)
    nodes: int = 1
    bf16: bool = True
    label: str = ""
    profile: str | None = None

    def describe(self) -> str:
        nodes = f"{self.nodes} nodes x " if self.nodes > 1 else ""
        return (f"{nodes}{self.devices} {self.label or self.device} ({self.memory / GB:.1f} GiB each"
                f"{'' if self.bf16 else ', no bf16'})")


@dataclass(frozen=True)
class Allocation:
    """What the launcher allocates each job (hydra/launcher=slurm*: hydra.launcher.*); None: it does not say."""

    gpus_per_node: int | None = None
    nodes: int | None = None


def parse_profile(text: str) -> Machine:
    """`CARD` (one device), `CARD:N` (N devices on one node) or `CARD:NxM` (M nodes of N), e.g. h100-80gb:8x2."""
    m = PROFILE.fullmatch(text.strip().lower())
    card = CARDS.get(m.group("card")) if m else None
    if card is None or (m.group("devices") and int(m.group("devices")) < 1) or (m.group("nodes") and
                                                                                 int(m.group("nodes")) < 1):
        raise UserError(f"config key 'backend.profile': {text!r} is not CARD[:N[xM]] (N devices per node, M nodes) "
                        f"with CARD one of {', '.join(CARDS)}")
    return Machine("cuda", card.memory, int(m.group("devices") or 1), int(m.group("nodes") or 1), card.bf16,
                   card.label, text)


def this_machine(device: str) -> Machine:
    """The real machine for `device` (cuda | cpu): CUDA's visible devices, the first one's memory and bf16."""
    import torch

    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return Machine("cuda", float(props.total_memory), torch.cuda.device_count(), _slurm_nodes(),
                       torch.cuda.is_bf16_supported(), props.name)
    return Machine("cpu", 0.0, os.cpu_count() or 1, _slurm_nodes())


def _slurm_nodes() -> int:
    return int(os.environ.get("SLURM_NNODES", os.environ.get("SLURM_JOB_NUM_NODES", "1")) or 1)


def allocation_of(launcher) -> Allocation:
    """The allocation a Hydra launcher node (hydra.launcher) asks for: SLURM's GPUs and nodes (submitit), nothing
    for a launcher that runs jobs on this machine."""
    if launcher is None or "submitit" not in str(launcher.get("_target_", "")).lower():
        return Allocation()
    gpus, nodes = launcher.get("gpus_per_node"), launcher.get("nodes")
    return Allocation(int(gpus) if gpus is not None else None, int(nodes) if nodes is not None else None)


def ranks_per_node(strategy: str, nproc: int) -> int:
    """The ranks a job starts on each node: backend.nproc under ddp / fsdp, else one process."""
    return nproc if strategy in ("ddp", "fsdp") and nproc > 1 else 1


def check_launch(strategy: str, nproc: int, precision: str, machine: Machine, allocation: Allocation) -> None:
    """One line (UserError) where the job's ranks cannot all get a device, before any rank starts: more ranks per
    node than the launcher allocates GPUs or than the node shows devices (a rank beyond them fails at
    torch.cuda.set_device with "invalid device ordinal"), several nodes where the ranks would not meet, bf16 on a
    GPU without it."""
    ranks = ranks_per_node(strategy, nproc)
    if machine.device != "cuda":
        return
    if allocation.gpus_per_node is not None and ranks > allocation.gpus_per_node:
        raise UserError(f"backend.nproc={nproc} starts {ranks} ranks per node, one per GPU, but the launcher allocates "
                        f"hydra.launcher.gpus_per_node={allocation.gpus_per_node}: set "
                        f"hydra.launcher.gpus_per_node={ranks} (or backend.nproc={allocation.gpus_per_node})")
    if ranks > machine.devices:
        seen = os.environ.get("CUDA_VISIBLE_DEVICES") if machine.profile is None else None
        raise UserError(f"backend.nproc={nproc} starts {ranks} ranks per node, one per GPU, but "
                        f"{'the profile ' + machine.profile + ' has' if machine.profile else 'this node shows'} "
                        f"{machine.devices} CUDA device(s){f' (CUDA_VISIBLE_DEVICES={seen})' if seen else ''}: "
                        f"set backend.nproc={machine.devices} or run where {ranks} GPUs are visible")
    nodes = allocation.nodes or machine.nodes
    if nodes > 1 and ranks < 2:
        raise UserError(f"{nodes} nodes need ranks to meet: backend.strategy=ddp or fsdp with backend.nproc >= 2 "
                        f"(the GPUs of one node)")
    if precision in ("bf16", "auto") and not machine.bf16:
        raise UserError(f"backend.precision={precision} computes in bf16, which {machine.label or 'this GPU'} does "
                        f"not support: set backend.precision=fp32")
