"""Data sources: what the training loop pulls one optimizer step at a time.

Both yield `StepData` (the micro-batches of one step), so the loop cannot tell a fixed offline file
(`OfflineSource`) from online rounds of sample -> label -> feedback (`OnlineSource`). The builder
(build.py) constructs them from ready parts: units or prompt rows, an encoder, a collator, a
sampler and a labeller.
"""
from .base import Shard, Source, StepData, micro_batches
from .offline import OfflineSource
from .online import OnlineSource, RoundSpec

__all__ = ["OfflineSource", "OnlineSource", "RoundSpec", "Shard", "Source", "StepData", "micro_batches"]
