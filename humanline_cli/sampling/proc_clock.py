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

