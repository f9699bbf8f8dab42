"""What a process got from the CPUs, for telling an overlap that did not happen from one the machine did not
have the cores for: its CPU seconds (all threads) and, on Linux, its run-queue delay, the seconds its
threads were ready to run but waited for a CPU (/proc/self/task/*/schedstat, field 2). A process that
computes without blocking has wall = CPU + run-queue delay, so a large delay means other work held the
cores."""
from __future__ import annotations

import os
import time


def cpu_s() -> float:
    """This process's CPU seconds, user + system, all threads."""
    return time.process_time()


def run_queue_s() -> float | None:
    """Seconds this process's threads (the live ones) have waited on a run queue; None where the kernel
    does not say (not Linux, or schedstat unavailable)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    total, seen = 0, False
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/schedstat") as f:
                total += int(f.read().split()[1])
            seen = True
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total / 1e9 if seen else None


def page_faults() -> int:
    """Minor page faults this process has taken so far (0 where the platform does not count them)."""
    try:
        import resource
    except ImportError:
        return 0
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


def keep_freed_memory() -> bool:
    """glibc only: keep freed heap memory for reuse instead of giving it back to the kernel at once.

    A process that only samples (the asynchronous sampler) allocates and frees the same large buffers
    (KV cache, logits) every round; with glibc's defaults it returned them to the kernel after each round
    and faulted ~30,000 fresh pages back in the next (measured: +0.03-0.07 s of system time and ~25% more
    CPU per round than the same sampling inside the trainer, whose training allocations keep the heap
    large). Allocations up to 32 MiB (glibc's largest mmap threshold) come from the heap, and the heap is
    not trimmed below 1 GiB of free top. Returns whether glibc took both settings."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
        return bool(libc.mallopt(m_mmap_threshold, 32 * 1024 * 1024)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))
    except (OSError, AttributeError):
        return False
