"""Offline source: a fixed list of objective units, shuffled each epoch, cut into optimizer steps
of micro-batches. Online rounds (online.py) yield the same StepData."""
from __future__ import annotations

import random

from .base import Shard, StepData, micro_batches


class OfflineSource:
    def __init__(self, units: list, collate, batch_size: int, micro_batch_size: int, seed: int, shuffle: bool = True,
                 shard: Shard = Shard()):
        self.shard = shard
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
        return StepData(micro_batches(units, self.collate, self.micro, self.shard), new_round=False,
                        info={"epoch": self.epoch})

    def describe(self) -> str:
        return f"{len(self.units)} offline units"

    def close(self) -> None:
        pass
