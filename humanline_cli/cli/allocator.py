"""glibc's malloc keeps the memory a training process frees, for its next allocations.

By default glibc serves an allocation of 32 MiB or more (less, early on) with its own mmap and unmaps it when it
is freed, and returns the heap's free top to the kernel. A training step allocates and frees the same large tensors
every step (weight gradients, the vocabulary-wide embedding gradient and logits, activations), so every step
touches fresh pages again, one page fault per 4 KiB: about a gigabyte a step for SmolLM2's GRPO step, and dear in
a virtual machine, whose host may also have taken the freed pages back. With mmap off and trimming off, freed
blocks stay in the heap and the next step reuses them: its page faults drop to none, and the process's peak
resident memory stays what it was (4.5 GB in that step either way). One arena for every thread: each vLLM engine
call runs in a new thread, which glibc would give an arena of its own, so a weight push (the oneDNN-packed copies
of every linear layer) would allocate afresh in whichever arena its thread drew. Intel's recipe for PyTorch on CPUs makes the
same trade with jemalloc. A user who set glibc's malloc tunables in the environment keeps them.
"""
from __future__ import annotations

import ctypes
import os
import sys

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8

# the environment variables by which a user sets glibc's malloc behaviour themselves
USER_SETTINGS = ("GLIBC_TUNABLES", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_",
                 "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX", "LD_PRELOAD")


def keep_freed_memory() -> bool:
    """Turn off glibc's mmap for large blocks and its heap trimming, and give every thread the main arena, unless the user chose an allocator or malloc
    settings of their own (USER_SETTINGS) or this is not glibc. Whether the settings were made."""
    if not sys.platform.startswith("linux") or any(os.environ.get(k) for k in USER_SETTINGS):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # another C library (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    # mallopt answers 1 on success; -1 for the trim threshold means never trim (man 3 mallopt)
    return mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, -1) == 1 and mallopt(M_ARENA_MAX, 1) == 1
