"""What every data source shares: its rank's share of each global batch (the interface: core/interfaces.py)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

from humanline_cli.core.interfaces import Source, StepData


class SourceWrapper:
    """A source around another (the benches' clocks): every core.interfaces.Source method passes through;
    a subclass overrides the ones it watches."""

    def __init__(self, source: Source):
        self.source = source

    def next_step(self, step: int) -> StepData:
        return self.source.next_step(step)

    def describe(self) -> str:
        return self.source.describe()

    def state_dict(self) -> dict:
        return self.source.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.source.load_state_dict(state)

    def sample_tokens_per_s(self) -> float | None:
        return self.source.sample_tokens_per_s()

    def close(self) -> None:
        self.source.close()


@dataclass(frozen=True)
class Shard:
    """Which share of every global batch this process trains on (rank r of w), and the two collectives
    that sharded sampling and evaluation need (no-ops for one process)."""

    rank: int = 0
    world_size: int = 1

    def share(self, n: int) -> list[int]:
        """This rank's items of n: the r-th contiguous block, the first n % w ranks one longer
        (n = 10, w = 4: 0-2, 3-5, 6-7, 8-9)."""
        per, extra = divmod(n, self.world_size)
        start = self.rank * per + min(self.rank, extra)
        return list(range(start, start + per + (self.rank < extra)))

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order (torch.distributed.all_gather_object; [obj] alone)."""
        if self.world_size == 1:
            return [obj]
        import torch.distributed as tdist

        out: list = [None] * self.world_size
        tdist.all_gather_object(out, obj)
        return out

    def max_int(self, x: int) -> int:
        """The largest x over ranks: keeps ranks in lockstep where each forward is a collective (FSDP)."""
        if self.world_size == 1:
            return int(x)
        import torch
        import torch.distributed as tdist

        device = f"cuda:{torch.cuda.current_device()}" if tdist.get_backend() == "nccl" else "cpu"
        t = torch.tensor([int(x)], dtype=torch.long, device=device)
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)  # once per decoding step: a tensor, not a pickle
        return int(t.item())


def micro_batches(units: list, collate, micro: int, shard: Shard = Shard(), length=None) -> list:
    """A global batch of units -> this rank's micro-batches. Rank r takes the r-th contiguous block
    (Shard.share: the first len(units) % world_size ranks one unit more), so every unit is trained
    once, as in one process. Every rank cuts the same number of micro-batches, ceil(ceil(n / w) / micro),
    so collectives (FSDP's gathers, DDP's gradient reduce) stay in lockstep: a rank whose share is
    shorter (an online round with fewer units, or a remainder, not a multiple of the ranks) pads with
    FILLER micro-batches (one copy of unit 0, `batch.filler = True`) that the trainer runs with weight 0.
    KTO partners (the completion each prompt is mismatched with for z0) are the next unit of the GLOBAL
    batch, so z0 does not depend on how the batch is split into micro-batches or ranks.

    `length` (unit -> tokens; train.length_bucketing): this rank's share is sorted by it, longest first
    (stable, so deterministic), before it is cut, each unit keeping its partner; micro-batches of similar
    lengths carry less padding. The step's loss and gradient do not depend on the order (each micro-batch
    is weighted by its share of the step), only their float32 summation order does."""
    share = shard.share(len(units))
    partners = units[1:] + units[:1]
    mine, theirs = [units[i] for i in share], [partners[i] for i in share]
    if length is not None:
        order = sorted(range(len(mine)), key=lambda i: -length(mine[i]))
        mine, theirs = [mine[i] for i in order], [theirs[i] for i in order]
    out = []
    for i in range(0, len(mine), micro):
        batch = collate(mine[i:i + micro], theirs[i:i + micro])
        with contextlib.suppress(AttributeError):  # its units, named if its loss is not finite (trainer)
            batch.units = mine[i:i + micro]
        out.append(batch)
    most = -(-len(units) // shard.world_size)  # the longest share
    while len(out) < -(-most // micro):  # same count on every rank: pad with weight-0 fillers
        batch = collate(units[:1], partners[:1])
        batch.filler = True
        out.append(batch)
    return out


def is_filler(batch) -> bool:
    """A padding micro-batch (micro_batches): it runs the collectives, it trains nothing (weight 0)."""
    return batch.filler
