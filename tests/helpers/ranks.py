"""Two ranks as child processes of the test: start them, wait, and collect what each put on its queue."""
from __future__ import annotations

import multiprocessing


def run_two_ranks(method: str, target, args, timeout: float) -> list:
    """Start target(rank, *args(ctx), out) for ranks 0 and 1 in processes of `method` (fork: the ranks start with
    the test's imports; spawn where CUDA is used), `args` made once for both (a barrier they share), wait up to
    `timeout` s, require exit 0 from both, and return the two objects they put on `out`, sorted."""
    ctx = multiprocessing.get_context(method)
    out, shared = ctx.Queue(), args(ctx)
    procs = [ctx.Process(target=target, args=(r, *shared, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    assert [p.exitcode for p in procs] == [0, 0]
    return sorted(out.get(timeout=5) for _ in procs)
