"""A dry run against a device profile (`backend.profile=CARD[:N[xM]]`, humanline_cli/machine.py): the job does
what it would do on M nodes of N such GPUs up to the first weight it would load (validation, the launcher's
allocation and the devices against the ranks, the memory fit that picks `train.micro_batch_size=auto`, or the
refusal), prints what the run's header would say, and stops: exit 0, or the refusal's one line and exit 2. Nothing
loads but the model's config (config.json, and the reward models'), and the run dir is not touched.

A hub id counts as fetched: the run itself fetches the snapshot before the fit (build.prepare_files), so FSDP2
loads it sharded there.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from rich.console import Console

from humanline_cli.config import RunSpec
from humanline_cli.core.objectives import PROPERTIES
from humanline_cli.errors import UserError
from humanline_cli.machine import Allocation, Machine, check_launch, parse_profile, ranks_per_node
from humanline_cli.memory import MemoryEstimate
from humanline_cli.train.build import behaviour_of, model_paths, prepare_model, prepare_world
from humanline_cli.train.fit import fit_memory
from humanline_cli.train.lengths import check_model_lengths


@dataclass(frozen=True)
class Plan:
    """What the run would start with on the profile's machine."""

    spec: RunSpec              # its micro-batch fitted
    machine: Machine
    estimate: MemoryEstimate
    ranks_per_node: int
    nodes: int

    @property
    def micro_batch(self) -> int:
        return self.spec.train.micro_batch_size

    def lines(self) -> list[str]:
        """The header's lines a user would see on that machine, then the dry run's last word."""
        spec, tr = self.spec, self.spec.train
        ranks = f"{self.ranks_per_node} rank(s) per node" + (f" x {self.nodes} nodes" if self.nodes > 1 else "")
        out = [f"humanline train: {spec.objective} / {spec.regime} / humanline {'on' if spec.humanline_on else 'off'}"
               f" (dry run on backend.profile={self.machine.profile})",
               f"  task {spec.task}, model {spec.model}; {self.machine.describe()}; {ranks} "
               f"({spec.backend_cfg.strategy.value}, backend.precision={spec.backend_cfg.precision.value})",
               f"  {self.estimate.describe()}"]
        out += [f"  note: {note}" for note in spec.notes]
        out.append(f"  {tr.steps} steps; a step sees {tr.batch_size} {PROPERTIES[spec.objective].unit} "
                   f"(micro-batch {tr.micro_batch_size} x {tr.accumulation} accumulation)")
        out.append("humanline: dry run: the run would start; no weight was loaded")
        return out


def plan(spec: RunSpec, allocation: Allocation = Allocation()) -> Plan:
    """The run's start on its backend.profile's machine, or the UserError it would stop with (one line)."""
    b = spec.backend_cfg
    machine = parse_profile(b.profile)
    if b.device.value == "cpu":
        raise UserError(f"backend.profile={b.profile} describes GPUs: use it with backend=cuda")
    check_launch(b.strategy.value, b.nproc, b.precision.value, machine, allocation)
    prepare_world(spec, progress=False)  # the launcher builds these before any rank too (local files, no weights)
    prepare_model(spec, progress=False)
    model_path, _ = model_paths(spec)
    check_model_lengths(spec, model_path)
    fitted, est = fit_memory(spec, model_path, torch.device("cuda"), machine=machine, fetched=True,
                             behaviour=behaviour_of(spec))
    if est is None:
        raise UserError(f"backend.profile: the model's config cannot be read from {model_path} (config.json): the dry "
                        f"run sizes the run from it")
    return Plan(fitted, machine, est, ranks_per_node(b.strategy.value, b.nproc), allocation.nodes or machine.nodes)


def dry_run(spec: RunSpec, allocation: Allocation, console: Console | None = None) -> None:
    """Print what the run would start with (plan) on its profile's machine; a refusal is raised."""
    console = console or Console(stderr=True)
    for line in plan(spec, allocation).lines():
        console.print(line, soft_wrap=True, markup=False, highlight=False)
