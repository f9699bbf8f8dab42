"""Helpers every sampler shares (the interface and its data types: core/interfaces.py)."""
from __future__ import annotations


def cut_at_eos(ids: list[int], eos_id: int, pad_id: int | None = None) -> list[int]:
    """Keep tokens up to and including the first EOS; drop padding after it."""
    out = []
    for t in ids:
        out.append(t)
        if t == eos_id:
            break
    return out


_MASK63 = (1 << 63) - 1


def sample_seed(seed: int, index: int, sample: int) -> int:
    """A 63-bit seed for completion `sample` of prompt `index` under base seed `seed` (a splitmix64
    finaliser over the three numbers): distinct inputs give unrelated streams, and the seed does not
    depend on which other prompts share the call or the rank."""
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + sample * 0x94D049BB133111EB) & (2**64 - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 31)) & _MASK63
