"""The CLI keeps freed memory in the process (memory.keep_freed_memory): a large tensor freed and allocated again
reuses its pages, which the kernel's page-fault count shows; a user's own malloc settings win."""
import json
import os
import subprocess
import sys

# after importing the CLI as the console script does: a 64 MiB tensor allocated and freed, then a 48 MiB one (both
# above glibc's largest mmap threshold, 32 MiB, so mmap-served by default), whose first touch's minor page faults
# are counted: the freed block holds it, so kept memory faults on none of its pages
# (in a new thread when THREAD is set: a vLLM engine call's way)
PROBE = """
import json, os, resource, threading
import humanline_cli.cli.main  # noqa: F401
import torch
torch.set_num_threads(1)
torch.ones(2 ** 24)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
second = lambda: torch.ones(3 * 2 ** 22)
if os.environ.get("THREAD"):
    t = threading.Thread(target=second)
    t.start()
    t.join()
else:
    second()
print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""
PAGES = 3 * 2 ** 24 // 4096  # the second tensor's 4 KiB pages: what a fresh mapping faults on first touch


def _faults(**env_extra) -> int:
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "LD_PRELOAD", "MALLOC_ARENA_MAX")}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])["faults"]


def test_a_freed_tensor_is_reused_without_page_faults():
    assert _faults() < PAGES // 16


def test_another_thread_reuses_it_too():
    assert _faults(THREAD="1") < PAGES // 16
    # a user's own arena setting leaves glibc's defaults in place: the second tensor is a fresh mapping
    assert _faults(THREAD="1", MALLOC_ARENA_MAX="8") >= PAGES // 2


def test_the_users_malloc_settings_win():
    # glibc's default behaviour restated as a tunable: the second tensor is a fresh mapping again
    assert _faults(GLIBC_TUNABLES="glibc.malloc.check=0") >= PAGES // 2
