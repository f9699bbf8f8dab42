"""Per-device memory estimate of a run, from the model's config alone (no weights loaded).

Counts parameters exactly by building the model on the meta device. Bytes per parameter follow what
the trainer keeps: fp32 master weights (bf16 autocast computes, it does not store), fp32 gradients and
AdamW's two fp32 moments for every trainable parameter, the reference (a full fp32 copy, or bf16 under
FSDP2 mixed precision, `reference_bytes=2`; with LoRA the base model with adapters off, or one more
adapter). FSDP divides weights, gradients and optimizer
states by the number of ranks; DDP replicates them. Activations use the usual transformer estimate
per layer of 34 * s * b * h bytes (16-bit activations, Korthikanti et al. 2022, with the attention
scores kept by a fused SDPA/flash kernel, which transformers uses by default) for s tokens, b sequences
and hidden size h, or about 2 * s * b * h bytes per layer with gradient checkpointing, plus one chunk
of fp32 logits (token_logps computes log-probs in chunks).
It is an estimate (allocator slack, CUDA context and vLLM's own share are not included).
"""
from __future__ import annotations

from dataclasses import dataclass

GB = 1024**3


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

    @property
    def total(self) -> float:
        return self.policy + self.grads + self.optimizer + self.reference + self.activations

    def describe(self) -> str:
        parts = [f"policy {self.policy / GB:.2f}", f"grads {self.grads / GB:.2f}", f"AdamW {self.optimizer / GB:.2f}",
                 f"reference {self.reference / GB:.2f}", f"activations {self.activations / GB:.2f}"]
        how = f", FSDP over {self.ranks} ranks" if self.sharded else (f", DDP x{self.ranks}" if self.ranks > 1 else "")
        return (f"memory per device (estimate{how}): {' + '.join(parts)} = {self.total / GB:.2f} GiB "
                f"({_count(self.params)} params, {_count(self.trainable)} trainable, {self.seqs} x "
                f"{self.tokens}-token sequences per micro-batch)")


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


def estimate(config, *, seqs_per_micro: int, max_length: int, lora_r: int = 0, moving_reference: bool = True,
             strategy: str = "single", ranks: int = 1, gradient_checkpointing: bool = False,
             vocab_chunk_bytes: int = 2**27, params: int | None = None,
             reference_bytes: float = 4.0) -> MemoryEstimate:
    n = params if params is not None else count_params(config)
    shard = ranks if strategy == "fsdp" else 1
    trainable = lora_params(config, lora_r) if lora_r > 0 else n
    policy = 4.0 * (n + (trainable if lora_r > 0 else 0)) / shard
    grads = 4.0 * trainable / shard
    optimizer = 8.0 * trainable / shard
    if lora_r > 0:
        reference = 4.0 * trainable / shard if moving_reference else 0.0
    else:
        reference = reference_bytes * n / shard
    s, b, h, layers = max_length, seqs_per_micro, config.hidden_size, config.num_hidden_layers
    per_layer = (2.0 if gradient_checkpointing else 34.0) * s * b * h
    activations = per_layer * layers + vocab_chunk_bytes
    return MemoryEstimate(n, trainable, policy, grads, optimizer, reference, activations, ranks, strategy == "fsdp",
                          b, s)


def check_fits(est: MemoryEstimate, device_bytes: float, headroom: float = 0.9) -> str | None:
    """A one-line reason when the estimate exceeds `headroom` of the device, else None."""
    if est.total <= headroom * device_bytes:
        return None
    return (f"the run will not fit: {est.total / GB:.1f} GiB estimated per device > {headroom:.0%} of "
            f"{device_bytes / GB:.1f} GiB (policy {est.policy / GB:.1f}, grads {est.grads / GB:.1f}, AdamW "
            f"{est.optimizer / GB:.1f}, reference {est.reference / GB:.1f}, activations {est.activations / GB:.1f}); "
            f"try backend.strategy=fsdp backend.nproc=N, model.lora.r=16, train.gradient_checkpointing=true or a "
            f"smaller train.micro_batch_size")
