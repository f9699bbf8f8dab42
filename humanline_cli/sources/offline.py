"""Offline source: a fixed list of objective units, shuffled each epoch, cut into optimizer steps
of micro-batches. Online rounds (online.py) yield the same StepData."""
from __future__ import annotations

import random

from humanline_cli.core.interfaces import StepData
from humanline_cli.sources.source import Shard, micro_batches


class OfflineSource:
    def __init__(self, units: list, collate, batch_size: int, micro_batch_size: int, seed: int, shuffle: bool = True,
                 shard: Shard = Shard(), length=None):
        self.shard = shard
        self.length = length  # unit -> tokens: length bucketing in micro_batches (None: off)
        self.units = units
        self.collate = collate
        self.batch_size = batch_size
        self.micro = micro_batch_size
        self.rng = random.Random(seed)
        self.shuffle = shuffle
        self.epoch = 0
        self._order: list[int] = []

    def _take(self, n: int) -> list:
        out = []
        while len(out) < n:
            if not self._order:
                self._order = list(range(len(self.units)))
                if self.shuffle:
                    self.rng.shuffle(self._order)
                self.epoch += 1
            out.append(self.units[self._order.pop()])
        return out

    def next_step(self, step: int) -> StepData:
        units = self._take(self.batch_size)  # every rank draws the same global batch, then takes its share
        return StepData(micro_batches(units, self.collate, self.micro, self.shard, self.length), new_round=False,
                        info={"epoch": self.epoch})

    truncation = None  # data.collate.Truncation, set by the builder

    def describe(self) -> str:
        cut = f"; {self.truncation.describe()}" if self.truncation is not None else ""
        return f"{len(self.units)} offline units{cut}"

    def state_dict(self) -> dict:
        """The position in the data: the epoch, what is left of this epoch's order, the shuffle RNG."""
        return {"n_units": len(self.units), "epoch": self.epoch, "order": list(self._order),
                "rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        if state["n_units"] != len(self.units):
            raise ValueError(f"the checkpoint was made with {state['n_units']} offline units, the data now has "
                             f"{len(self.units)}")
        self.epoch = int(state["epoch"])
        self._order = [int(i) for i in state["order"]]
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))

    def sample_tokens_per_s(self) -> float | None:
        return None

    def close(self) -> None:
        pass
