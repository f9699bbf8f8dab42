"""Offline source: a fixed list of objective units, shuffled each epoch, cut into optimizer steps
of micro-batches. Online rollouts (rollout.py) yield the same StepData."""
from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class StepData:
    micro_batches: list            # batches for one optimizer step
    new_round: bool = False        # online: the first step of a sampling round
    info: dict = field(default_factory=dict)


class OfflineSource:
    def __init__(self, units: list, collate, batch_size: int, micro_batch_size: int, seed: int, shuffle: bool = True):
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
        units = self._take(self.batch_size)
        mbs = [self.collate(units[i : i + self.micro]) for i in range(0, len(units), self.micro)]
        return StepData(mbs, new_round=False, info={"epoch": self.epoch})

    def describe(self) -> str:
        return f"{len(self.units)} offline units"
