"""How much of a step's forward work is real tokens: the arithmetic behind train.packing and
train.length_bucketing, for the bench and the tests (the trainer logs the measured fraction as
tokens_per_position)."""
from __future__ import annotations


def padding_efficiency(lengths: list[int], micro: int, packing: bool, bucketing: bool) -> float:
    """Useful tokens / processed tokens when a step's sequences of `lengths` tokens are cut, in this
    order, into micro-batches of `micro` sequences. Padded, a micro-batch costs micro-size x its longest
    sequence; `bucketing` sorts the lengths longest first before cutting (as sources.micro_batches does);
    `packing` runs each micro-batch as one padding-free row, costing the sum of its lengths (bucketing
    is then moot)."""
    if micro < 1:
        raise ValueError(f"micro must be >= 1, got {micro}")
    useful = sum(lengths)
    if not useful:
        return 1.0
    if packing:
        return 1.0
    order = sorted(lengths, reverse=True) if bucketing else list(lengths)
    processed = sum(len(mb) * max(mb) for mb in (order[i:i + micro] for i in range(0, len(order), micro)))
    return useful / processed
