"""Round producers for asynchronous online training (data.async_lag > 0): a round is submitted with a
snapshot of the weights that must sample it, and its completions are collected later.

- `SamplerProcess`: the round sampler in a child process (torch.multiprocessing, spawn context), so
  sampling round r+lag overlaps training round r. The child builds it once from the model's files (the
  transformers sampler over its own copy of the model, or with sampler=vllm an in-process vLLM engine: only
  the child imports vllm); each request carries a weight snapshot (CPU tensors the parent cloned: torch's
  queue moves their storage to shared memory, so nothing is copied through the pipe and the parent's live
  weights are never shared), which the child loads into its model or pushes into its engine.
  A bounded queue: the caller never submits more than `lag` rounds ahead of the one it trains.
- `InlineRounds`: the same rounds sampled sequentially in this process from a private copy of the model
  or a private engine (data.async_worker=inline): the staleness without the overlap. It is what the child
  must equal exactly.

Under DDP/FSDP every rank has its own producer, which samples that rank's share of each round (`indices`:
the prompts' places in the whole round, so each completion's seed is one process's).

Both return, per round, (Completions, RoundTiming). Every wait has a timeout and watches the child's
liveness: a dead or silent sampler becomes one RunFailed line, never a hang.
"""
from __future__ import annotations

import contextlib
import dataclasses
import queue
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from humanline_cli.core.interfaces import Completions, SamplingParams
from humanline_cli.errors import RunFailed, ignore_ctrl_c
from humanline_cli.memory import keep_freed_memory
from humanline_cli.sampling.proc_clock import cpu_s, page_faults, run_queue_s

START_TIMEOUT_S = 600.0  # the child's start (imports, model load) may take minutes for a large model
# tests only: "kill@R" / "raise@R" / "hang@R" in the child at round R (every rank's child), or "kill@R:K" etc.:
# only in rank K's child (data.async_lag under DDP/FSDP: each rank has its own sampler process)


@dataclass(frozen=True)
class RoundTiming:
    """Seconds a round cost: sampling it (in the child: overlapped with training), the trainer blocked
    waiting for it (wait_for_sample), the sampler idle before it, waiting for the trainer's request
    (wait_for_trainer), and, once, the trainer blocked on the child's start (sampler_start: importing
    torch and loading the model, when that outlasts the parent's own setup).

    Where the round's sampling sat in time (time.monotonic() of whichever process sampled it: Linux's
    CLOCK_MONOTONIC is one clock for all processes, so the trainer compares them with its own), the CPU
    seconds the sampling took and the seconds it waited for a CPU (None where the kernel does not say), and
    the minor page faults it took (memory the process had given back to the kernel and touched again):
    they tell an overlap that did not happen from one the machine had no free core for."""

    sample_s: float = 0.0
    wait_for_sample_s: float = 0.0
    wait_for_trainer_s: float = 0.0
    sampler_start_s: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0
    cpu_s: float = 0.0
    run_queue_s: float | None = None
    page_faults: int = 0


@dataclass(frozen=True)
class Snapshot:
    """A private CPU copy of the policy's weights, packed into one flat buffer per dtype (so sending it to
    the child moves one shared-memory segment per dtype, not one file descriptor per tensor)."""

    buffers: dict[str, torch.Tensor]                      # dtype name -> 1-D tensor
    index: tuple[tuple[str, str, int, tuple[int, ...]], ...]  # (name, dtype name, offset, shape)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Views into the buffers, by the policy's state_dict names."""
        return {name: self.buffers[dt][off:off + _numel(shape)].view(shape) for name, dt, off, shape in self.index}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def snapshot(policy: torch.nn.Module) -> Snapshot:
    """The policy's weights now; later optimizer steps do not change the copy. A peft LoRA policy: its
    weights with the adapter merged in, under the base model's names (core.lora.merged_weights), which is
    what the sampler's plain model loads. `policy` is the module itself, never a DDP wrapper (whose names
    carry a `module.` prefix).

    FSDP2 (DTensor parameters): each is gathered whole with full_tensor(), a collective, one tensor at a
    time (the plain path: straight into the flat buffers, so at most one full tensor exists beside them);
    every rank must call this at the same point of the run (the online source does: at a round's start)."""
    if hasattr(policy, "get_base_model"):
        from humanline_cli.core.lora import merged_weights

        state = {k: v.detach() for k, v in merged_weights(policy)}  # gathered (FSDP2) by merged_weights
    else:
        state = {k: v.detach() for k, v in policy.state_dict().items()}
    sizes: dict[str, int] = {}
    index = []
    for name, t in state.items():  # a DTensor's dtype and shape are the whole tensor's: no gather needed here
        dt = str(t.dtype).removeprefix("torch.")
        index.append((name, dt, sizes.get(dt, 0), tuple(t.shape)))
        sizes[dt] = sizes.get(dt, 0) + t.numel()
    dtypes = {str(t.dtype).removeprefix("torch."): t.dtype for t in state.values()}
    buffers = {dt: torch.empty(n, dtype=dtypes[dt]) for dt, n in sizes.items()}
    for (_, dt, off, _), t in zip(index, state.values()):
        whole = t.full_tensor() if hasattr(t, "full_tensor") else t  # in state_dict order on every rank
        buffers[dt][off:off + whole.numel()].copy_(whole.reshape(-1))
        del whole
    return Snapshot(buffers, tuple(index))


Load = Callable[[Snapshot], None]  # puts a round's snapshot into the sampler's private model or engine


def load_into(model: torch.nn.Module) -> Load:
    """The transformers sampler's model loads the snapshot."""
    return lambda weights: model.load_state_dict(weights.state_dict())


def push_into(engine) -> Load:
    """A vLLM engine (VLLMSampler) gets the snapshot pushed in place."""
    return lambda weights: engine.push_state(weights.state_dict().items())


class InlineRounds:
    """Sequential and in-process: a round is sampled, when collected, from its submitted snapshot put into
    the sampler's private model or engine by `load`."""

    def __init__(self, sampler, load: Load):
        self.sampler, self.load = sampler, load
        self.name = f"{type(sampler).__name__} in this process (async_worker=inline)"
        self._jobs: dict[int, tuple] = {}

    def submit(self, key: int, weights: Snapshot, prompt_ids: list[list[int]], params: SamplingParams,
               indices: list[int] | None = None) -> None:
        self._jobs[key] = (weights, prompt_ids, params, indices)

    def result(self, key: int) -> tuple[Completions, RoundTiming]:
        weights, prompt_ids, params, indices = self._jobs.pop(key)
        out, clock = _sample(self.load, self.sampler, weights, prompt_ids, params, indices)
        return out, RoundTiming(sample_s=clock["finished_at"] - clock["started_at"], **clock)

    def close(self) -> None:
        self._jobs.clear()
        self.sampler.close()


@dataclass(frozen=True)
class ChildSpec:
    """What the child needs to build its sampler (all picklable)."""

    model_path: str
    tokenizer_path: str
    trust_remote_code: bool
    precision: str
    threads: int
    batch_size: int
    rank: int = 0  # the training rank this sampler serves
    vllm: dict | None = None  # sampler=vllm: VLLMSampler's keyword arguments (seed, max_model_len, ...); None: transformers


def start_vllm(spec: ChildSpec):
    """sampler=vllm: an in-process vLLM engine over the model's files (imports vllm), and how a snapshot
    reaches it. The engine keeps the torch thread count it starts with: the caller sets `threads` first."""
    from humanline_cli.models import load_tokenizer
    from humanline_cli.sampling.vllm import VLLMSampler

    engine = VLLMSampler(spec.model_path, load_tokenizer(spec.tokenizer_path, spec.trust_remote_code), **spec.vllm)
    return engine, push_into(engine)


class SamplerProcess:
    def __init__(self, spec: ChildSpec, timeout_s: float, poll_s: float = 0.5):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self._requests, self._results = ctx.Queue(), ctx.Queue()
        self._held: dict[int, Snapshot] = {}  # each in-flight round's snapshot, alive until its result arrives
        self._done: dict[int, tuple[Completions, RoundTiming]] = {}
        self._ready = False
        self.name = f"{'VLLMSampler' if spec.vllm is not None else 'HFSampler'} in a sampler process"
        self.proc = ctx.Process(target=_child, args=(spec, self._requests, self._results), daemon=True,
                                name="humanline-sampler")
        self.proc.start()

    def submit(self, key: int, weights: Snapshot, prompt_ids: list[list[int]], params: SamplingParams,
               indices: list[int] | None = None) -> None:
        """Round `key`: sample `prompt_ids` from `weights`; `indices` are the prompts' places in the whole
        round (their completions' seeds: HFSampler.generate), when these are one rank's share of it."""
        self._check_alive(f"before round {key}")
        self._held[key] = weights
        self._requests.put((key, weights, prompt_ids, params, indices))

    def result(self, key: int) -> tuple[Completions, RoundTiming]:
        """Block (timed: wait_for_sample) until round `key` is sampled."""
        t = time.perf_counter()
        deadline = t + (self.timeout_s if self._ready else max(self.timeout_s, START_TIMEOUT_S))
        start_s = 0.0
        while key not in self._done:
            try:
                kind, k, payload = self._results.get(timeout=self.poll_s)
            except queue.Empty:
                self._check_alive(f"while sampling round {key}")
                if time.perf_counter() > deadline:
                    if not self._ready:
                        raise RunFailed(f"the sampler process did not start within "
                                        f"{max(self.timeout_s, START_TIMEOUT_S):g}s") from None
                    raise RunFailed(f"the sampler process gave no round {key} within sampler.timeout_s="
                                    f"{self.timeout_s:g}s (raise it for slow sampling)") from None
                continue
            if kind == "error":
                raise RunFailed(f"the sampler process failed{f' on round {k}' if k is not None else ''}: {payload}")
            if kind == "ready":
                self._ready = True
                start_s = time.perf_counter() - t
                deadline = time.perf_counter() + self.timeout_s  # the round's own time starts now
                continue
            out, clock, idle_s = payload
            self._held.pop(k, None)
            self._done[k] = (out, RoundTiming(sample_s=clock["finished_at"] - clock["started_at"],
                                              wait_for_trainer_s=idle_s, **clock))
        out, timing = self._done.pop(key)
        waited = time.perf_counter() - t - start_s
        return out, dataclasses.replace(timing, wait_for_sample_s=waited, sampler_start_s=start_s)

    def _check_alive(self, when: str) -> None:
        if not self.proc.is_alive():
            code = self.proc.exitcode
            how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            busy = [k for k in sorted(self._held) if k not in self._done]  # sent, not returned: it died on the first
            raise RunFailed(f"the sampler process died ({how}) " + (f"while sampling round {busy[0]}" if busy else when))

    def close(self) -> None:
        """Ask the child to stop; a child that has not within 2 s is killed (what it holds is lost
        anyway: the checkpoint has the rounds it needs). Never blocks longer."""
        if self.proc.is_alive():
            with contextlib.suppress(Exception):
                self._requests.put(None)
            self.proc.join(timeout=2)  # a child mid-round finishes it first: not worth waiting for
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(timeout=5)
        for q in (self._requests, self._results):
            q.cancel_join_thread()  # never wait on a feeder thread for a child that is gone
            q.close()
        self._held.clear()


def _sample(load: Load, sampler, weights: Snapshot, prompt_ids, params, indices=None) -> tuple[Completions, dict]:
    """Put the round's snapshot into the sampler (`load`) and sample the round (the prompts' places in the whole
    round: `indices`, which seed each completion); with the round's clock."""
    t, c, q, f = time.monotonic(), cpu_s(), run_queue_s(), page_faults()
    load(weights)
    out = sampler.generate(prompt_ids, params, indices=indices)
    q1 = run_queue_s()
    return out, {"started_at": t, "finished_at": time.monotonic(), "cpu_s": cpu_s() - c,
                 "run_queue_s": q1 - q if q is not None and q1 is not None else None,
                 "page_faults": page_faults() - f}


def _die_with_parent() -> None:
    """Linux: the kernel sends SIGKILL to this process when its parent dies (kill -9 included)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1


def _child(spec: ChildSpec, requests, results) -> None:
    """The sampler process: build the sampler, then sample each requested round from its snapshot.
    SIGINT/SIGTERM are left to the parent (it checkpoints, then stops this process)."""
    import multiprocessing

    _die_with_parent()
    ignore_ctrl_c()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    keep_freed_memory()  # before the model's and the first round's allocations
    try:
        from humanline_cli.backend import make_backend

        backend = make_backend("cpu", spec.precision, spec.threads)
        if spec.vllm is not None:
            sampler, load = start_vllm(spec)
        else:
            from humanline_cli.models import load_policy, load_tokenizer
            from humanline_cli.sampling.hf import HFSampler

            model = load_policy(spec.model_path, backend.device, spec.trust_remote_code, dtype=backend.weights_dtype)
            tok = load_tokenizer(spec.tokenizer_path, spec.trust_remote_code)
            sampler, load = HFSampler(model, tok, spec.batch_size, backend.autocast), load_into(model)
    except BaseException as e:  # noqa: BLE001 - reported to the parent as one line
        results.put(("error", None, f"{type(e).__name__}: {e}"))
        return
    results.put(("ready", None, None))
    try:
        _serve(sampler, load, requests, results, parent)
    finally:
        sampler.close()  # a vLLM engine shuts down before the process exits


def _serve(sampler, load: Load, requests, results, parent) -> None:
    """Sample each requested round from its snapshot until asked to stop (None) or the parent is gone."""
    idle_from = None
    while True:
        try:
            msg = requests.get(timeout=1.0)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return
            continue
        if msg is None:
            return
        key, weights, prompt_ids, params, indices = msg
        idle = time.monotonic() - idle_from if idle_from is not None else 0.0
        try:
            out, clock = _sample(load, sampler, weights, prompt_ids, params, indices)
            del weights
        except BaseException as e:  # noqa: BLE001 - reported to the parent as one line
            results.put(("error", key, f"{type(e).__name__}: {e}"))
            return
        results.put(("done", key, (out, clock, idle)))
        idle_from = time.monotonic()
