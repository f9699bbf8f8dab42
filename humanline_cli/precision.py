"""`backend.precision=auto` on CPU: bf16 autocast where this CPU computes bf16 matmuls at least BF16_MIN_SPEEDUP
times faster than fp32, fp32 elsewhere. Measured, not guessed from the CPU's name: a short GEMM probe at the model's
shapes (its hidden and MLP widths, PROBE_TOKENS rows) in fp32 and bf16 on one thread, once per machine: the result
is cached in `<world_cache>/precision/`, keyed by the CPU's model name, its flags, torch's version and the shapes.
The flags only gate which probes run: a CPU without bf16 instructions (avx512_bf16 or amx_bf16 on x86, bf16 on Arm)
computes bf16 GEMMs in emulation (~0.3 GFLOP/s on AVX2, 1,000x slower than fp32), so no bf16 probe runs there and
the run stays fp32."""
from __future__ import annotations

import hashlib
import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from humanline_cli.atomic import write_json_atomic
from humanline_cli.backend import set_torch_threads

BF16_MIN_SPEEDUP = 1.5  # below this, bf16's rounding buys too little time
BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")  # x86 AMX, x86 AVX-512 BF16, Arm's BF16 extension
PROBE_TOKENS = 512  # rows of the probe's GEMMs: a micro-batch's tokens
PROBE_S = 0.05  # seconds per timing of one dtype at one shape, after a warm-up call
PROBE_ROUNDS = 4  # fp32 and bf16 timed in turns, the fastest of each kept: a machine's other load hits both alike


@dataclass(frozen=True)
class Choice:
    precision: str  # "bf16" | "fp32"
    why: str  # one line for the run's header
    speedup: float | None = None  # bf16 GFLOP/s over fp32's, where both were measured


def cpu_info() -> tuple[str, tuple[str, ...]]:
    """(model name, flags) from /proc/cpuinfo (x86 `flags`, Arm `Features`); elsewhere the platform's name, no flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine(), ()
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or fields.get("CPU part") or platform.machine()
    return name, tuple(sorted(set((fields.get("flags") or fields.get("Features") or "").split())))


def gemm_seconds(a: torch.Tensor, b: torch.Tensor, seconds: float = PROBE_S) -> float:
    """Seconds per `a @ b` on torch's current threads, over calls for about `seconds`."""
    calls, start = 0, time.perf_counter()
    while True:
        a @ b
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return elapsed / calls


def measure(shapes: list[tuple[int, int]], flags: tuple[str, ...]) -> dict:
    """The probe: GFLOP/s over `shapes` ((k, n) pairs, PROBE_TOKENS rows) in fp32, and in bf16 where `flags` say this
    CPU has bf16 instructions (None otherwise): total FLOPs over the sum of each shape's fastest time in
    PROBE_ROUNDS rounds that time the dtypes in turns (the hardware's rate, less what a loaded machine takes)."""
    has_bf16 = [f for f in BF16_FLAGS if f in flags]
    dtypes = (torch.float32, torch.bfloat16) if has_bf16 else (torch.float32,)
    threads = torch.get_num_threads()
    set_torch_threads(1)  # one core's ratio: two threads on a shared machine wait for each other (0.6x measured)
    try:
        best = _best_times(shapes, dtypes)
    finally:
        set_torch_threads(threads)
    flops = sum(2.0 * PROBE_TOKENS * k * n for k, n in shapes) / 1e9
    rate = {dtype: flops / sum(times) for dtype, times in best.items()}
    return {"fp32_gflops": rate[torch.float32], "bf16_gflops": rate.get(torch.bfloat16), "bf16_flags": has_bf16}


def _best_times(shapes: list[tuple[int, int]], dtypes: tuple) -> dict:
    """dtype -> each shape's fastest seconds per GEMM over PROBE_ROUNDS rounds, the dtypes timed in turns."""
    g = torch.Generator().manual_seed(0)
    best = {dtype: [float("inf")] * len(shapes) for dtype in dtypes}
    for i, (k, n) in enumerate(shapes):
        a, b = torch.randn(PROBE_TOKENS, k, generator=g), torch.randn(k, n, generator=g)
        pairs = {dtype: (a.to(dtype), b.to(dtype)) for dtype in dtypes}
        for x, y in pairs.values():
            x @ y  # warm-up: oneDNN's kernel selection, first-touch of the buffers
        for _ in range(PROBE_ROUNDS):
            for dtype, (x, y) in pairs.items():
                best[dtype][i] = min(best[dtype][i], gemm_seconds(x, y))
    return best


def decide(probe: dict) -> Choice:
    """bf16 autocast where the probe's bf16 rate is at least BF16_MIN_SPEEDUP x its fp32 rate, else fp32; `why` names
    the measured ratio and the instructions behind it."""
    if probe["bf16_gflops"] is None:
        return Choice("fp32", "fp32: this CPU has no bf16 instructions (avx512_bf16, amx_bf16), so no bf16 probe ran")
    speedup = probe["bf16_gflops"] / probe["fp32_gflops"]
    flags = ", ".join(probe["bf16_flags"])
    if speedup >= BF16_MIN_SPEEDUP:
        return Choice("bf16", f"bf16 autocast: bf16 GEMM {speedup:.1f}x fp32 on this CPU ({flags})", speedup)
    return Choice("fp32", f"fp32: bf16 GEMM only {speedup:.2f}x fp32 on this CPU ({flags}), under "
                          f"{BF16_MIN_SPEEDUP}x", speedup)


def choose(shapes: list[tuple[int, int]], cache_root: str | Path) -> Choice:
    """The CPU's precision for a model of `shapes`: read from the cache, else measured (a second or two) and stored."""
    name, flags = cpu_info()
    key = {"cpu": name, "flags": list(flags), "torch": torch.__version__, "shapes": [list(s) for s in shapes]}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(cache_root).expanduser() / "precision" / f"cpu-{digest}.json"
    try:
        probe = json.loads(path.read_text())["probe"]
    except (OSError, ValueError, KeyError):
        probe = measure(shapes, flags)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {**key, "probe": probe}, tmp=path.with_name(f"{path.name}.{time.time_ns()}.tmp"))
    return decide(probe)


def model_shapes(config) -> list[tuple[int, int]]:
    """The (k, n) GEMM shapes that dominate a decoder layer of `config` (a transformers config): the attention
    projections (hidden x hidden) and the MLP (hidden x intermediate, intermediate x hidden)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config  # None: no config
    hidden = int(getattr(text, "hidden_size", 0) or 1024)
    inter = int(getattr(text, "intermediate_size", 0) or 4 * hidden)
    return [(hidden, hidden), (hidden, inter), (inter, hidden)]
