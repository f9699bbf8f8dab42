"""Token log-probs from a causal LM and masked reductions. Leaf module: tensors in, tensors out.

`token_logps` never builds the full (N, T, V) logits. It runs the model's decoder to the final
hidden states, keeps only the positions whose next token is a completion token, and applies the
LM head to chunks of those positions: the log-softmax in float32, gathered, one chunk of logits alive at
a time in the forward and (through per-chunk activation checkpointing) in the backward too.

How the forward runs is the run's `ForwardOptions`, given once to the policy's wrapper (`PolicyForward`) and to
the reference (reference.py) by the builder; a batch of `Seqs` carries only its tensors.

With `options.pack` (train.packing) the decoder runs on ONE padding-free row holding every sequence's real
tokens back to back, position ids restarting at 0 per sequence and no attention mask: transformers then
builds a block-diagonal causal mask (sdpa/eager) or runs varlen flash-attention from the position ids.
The result is gathered back to the same (N, T-1) padded coordinates, so every loss is unchanged.

`options.temperature` T (objective.tempered_logps: data.temperature, else 1) divides the logits before the
log-softmax on every path: log p(x_t) = z[x_t] / T - logsumexp(z / T), TRL's convention. The policy, the
reference (built with the same options) and the KTO mismatched pairs all get it.
"""
from __future__ import annotations

import sys
import weakref
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from humanline_cli.core import shared_prefix
from humanline_cli.core.batches import Seqs
from humanline_cli.errors import UserError

# Decoders whose log-prob forwards run compiled (train.compile): decoder -> torch.compile(decoder). The compiled
# wrapper shares the decoder's parameters and lives here rather than as an attribute (which would register it as
# a submodule and double the state dict), so generate(), weight pushes and checkpoints see the module unchanged.
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# Float32 elements in one chunk's logits (2**25 = 128 MiB): 261 tokens at a 128k vocabulary,
# the whole batch at once for a small one. The backward holds about four such buffers.
LOGITS_PER_CHUNK = 2**25

# Config attributes by which a model's forward transforms `lm_head(hidden)` (Gemma 2/3 soft-capping,
# Cohere's logit_scale, Granite's logits_scaling, Falcon-H1's lm_head_multiplier, MiniCPM's width
# scaling...). The chunked path would skip that transform, so such models take the full-logits path.
_HEAD_EXTRAS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier",
                "lm_head_multiplier", "dim_model_base", "mup_width_multiplier")

# Packing is checked once, as a setup step of a run with train.packing (`check_packing`: a model that
# ignores per-sequence position ids would let sequences attend to each other): packed vs padded log-probs,
# no grad, eval mode, float32 where the attention kernel allows. Max |difference| above PACK_CHECK_TOL
# (float32) is an error; in 16-bit compute (flash-attention, half-precision weights), whose rounding
# differs between the two shapes, the MEAN |difference| over completion tokens above PACK_CHECK_TOL_16BIT is.
PACK_CHECK_TOL = 1e-4
PACK_CHECK_TOL_16BIT = 5e-2


@dataclass(frozen=True)
class ForwardOptions:
    """How token_logps runs a model on a batch: settings of the run, never of the data."""

    pack: bool = False          # the rows as one padding-free packed row (train.packing)
    share_prefix: bool = False  # a prompt shared by several rows runs once (train.shared_prefix)
    temperature: float = 1.0    # log softmax(logits / temperature) (objective.tempered_logps: data.temperature)


PLAIN = ForwardOptions()  # padded rows, each prompt run with its row, T = 1
PACKED = ForwardOptions(pack=True)


@dataclass(frozen=True)
class PolicyForward:
    """The policy as the losses run it: `module`, what the gradient flows through (a DDP wrapper under DDP, else
    the policy), and the run's forward options. The reference (reference.py) answers `logps(seqs)` alike."""

    module: torch.nn.Module
    options: ForwardOptions = PLAIN

    def logps(self, seqs: Seqs) -> torch.Tensor:
        return token_logps(self.module, seqs, self.options)

    def processed_tokens(self, seqs: Seqs) -> int:
        return processed_tokens(self.module, seqs, self.options)

    def unwrapped(self) -> PolicyForward:
        """The policy itself, outside a DDP wrapper: for forwards whose gradient never syncs (KTO's z0)."""
        return PolicyForward(_unwrap_ddp(self.module), self.options)


def token_logps(model: torch.nn.Module, seqs: Seqs, options: ForwardOptions = PLAIN,
                chunk_size: int | None = None) -> torch.Tensor:
    """log p(x_t | x_<t) for t = 1..T-1, shape (N, T-1), float32 (float64 for a float64 model), zero where
    the completion mask is 0.

    input_ids/attention_mask (N, T) -> hidden states (N, T, H) from `model.get_decoder()` -> the M
    positions with completion_mask 1 -> `model.get_output_embeddings()` on chunks of `chunk_size`
    of them (default: LOGITS_PER_CHUNK // vocab), the head run in float32 (autocast off: head_logits), the
    logits divided by T = options.temperature, log p = logit[target] / T - logsumexp(logits / T).
    With grad enabled and more than one chunk, each chunk is checkpointed, so the backward recomputes one
    chunk's logits at a time (one extra head matmul, no (N, T, V) buffer). The decoder and head are called as
    modules, so hooks on them (LoRA layers, a wrapper's forward hooks on lm_head) fire as in `model(...)`.

    Falls back to the full-logits path (`_full_logits_token_logps`) when the model does not expose a
    separate decoder and output embedding, is a peft prompt-learning model
    (virtual tokens live in its forward), or its config declares a logit transform listed in
    _HEAD_EXTRAS. An FSDP2 root is chunked too: the computation runs as the root's forward
    (_as_root_forward), so FSDP's hooks gather the head and arm the backward; so is a DDP wrapper's module, run
    as the wrapper's forward (_run_as_forward), so DDP arms its gradient all-reduce.

    `options.pack` (see the module docstring) takes the packed path, on either route, except for peft
    prompt-learning models (padded); a run checks once, at setup, that the model packs (check_packing).
    """
    if _is_fsdp_root(model) and model not in _INSIDE_ROOT:
        return _as_root_forward(model, seqs, lambda: token_logps(model, seqs, options, chunk_size))
    inner = _unwrap_ddp(model)
    if inner is not model:
        return _run_as_forward(inner, model, seqs, lambda: token_logps(inner, seqs, options, chunk_size))
    if runs_packed(model, seqs, options):
        return _packed_token_logps(model, seqs, chunk_size, options.temperature)
    shared = _shared_plan(model, seqs, options)
    split = _decoder_and_head(model)
    if split is None:
        return _full_logits_token_logps(model, seqs, options.temperature)
    decoder, head = split
    rows, cols = seqs.loss_mask[:, 1:].nonzero(as_tuple=True)  # position t predicts token t+1
    if shared is not None:
        h = shared_prefix.hidden_at(_run_decoder, decoder, shared, rows, cols)
    else:
        out = _run_decoder(decoder, input_ids=seqs.input_ids, attention_mask=seqs.attention_mask, use_cache=False)
        h = shared_prefix.last_hidden(out)[rows, cols]  # (M, H)
    targets = seqs.input_ids[rows, cols + 1]  # (M,)
    picked = _head_logps(model, head, h, targets, chunk_size, options.temperature)
    logps = torch.zeros(seqs.input_ids.shape[0], seqs.input_ids.shape[1] - 1, dtype=picked.dtype,
                        device=picked.device)
    return logps.index_put((rows, cols), picked)


def compile_decoder(model: torch.nn.Module) -> bool:
    """Route `model`'s decoder forwards in token_logps through torch.compile (inductor, dynamic shapes, so one graph
    serves every sequence length). False where token_logps does not split the model (the full-logits path)."""
    split = _decoder_and_head(_unwrap_ddp(model))
    if split is None:
        return False
    _COMPILED[split[0]] = torch.compile(split[0], dynamic=True)
    return True


def _run_decoder(decoder: torch.nn.Module, **inputs):
    """The decoder's forward, compiled where compile_decoder asked for it. A compile that fails (no C compiler, an
    op inductor cannot lower) says so in one line and the run goes on eager."""
    compiled = _COMPILED.get(decoder)
    if compiled is None:
        return decoder(**inputs)
    try:
        return compiled(**inputs)
    except Exception as exc:  # noqa: BLE001 - any compile failure: the eager forward computes the same thing
        _COMPILED.pop(decoder, None)
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        print(f"train.compile: torch.compile failed ({type(exc).__name__}: {first}); running eager", file=sys.stderr)
        return decoder(**inputs)


# FSDP2 roots whose forward is, right now, token_logps itself (see _as_root_forward)
_INSIDE_ROOT: weakref.WeakSet = weakref.WeakSet()


def _as_root_forward(model: torch.nn.Module, seqs: Seqs, run):
    """`run()` (token_logps, or the packing check) on an FSDP2 root, chunked as in one process. FSDP2
    all-gathers the root's own weights (embeddings, final norm, LM head) and arms its backward (gradient
    reduce-scatter, reshard) in hooks around the root's __call__; calling get_decoder() and the head
    directly would skip them. So the computation runs AS the root's forward for this one call: the hooks
    fire exactly as for model(...), and no (N, T, V) logits are built (one chunk at a time, as without FSDP)."""
    _INSIDE_ROOT.add(model)
    try:
        return _run_as_forward(model, model, seqs, run)
    finally:
        _INSIDE_ROOT.discard(model)


def _run_as_forward(owner: torch.nn.Module, wrapper: torch.nn.Module, seqs: Seqs, run):
    """`wrapper(input_ids, attention_mask)` with `owner`'s forward shadowed by `run()` for this one call: a
    wrapper's hooks around __call__ (FSDP2's gathers and backward, DDP's gradient all-reduce, armed from the
    outputs it returns) fire as for a plain call, while the computation is the chunked one. For DDP the owner
    is the wrapped module: the chunked head of one process, never DDP's full (N, T, V) float32 logits
    (8 x 2,048 tokens x a 128k vocabulary: 8.4 GB)."""
    def forward(input_ids, attention_mask):  # the tensors pass through the wrapper's input handling
        return run()

    owner.forward = forward  # an instance attribute: shadows the class's forward for this call only
    try:
        return wrapper(seqs.input_ids, seqs.attention_mask)
    finally:
        del owner.forward


def _head_logps(model: torch.nn.Module, head: torch.nn.Module, h: torch.Tensor, targets: torch.Tensor,
                chunk_size: int | None, temperature: float = 1.0) -> torch.Tensor:
    """(M, H) hidden states, (M,) targets -> (M,) float32 log-probs of softmax(logits / temperature), the
    head applied chunk by chunk."""
    size = chunk_size or max(1, LOGITS_PER_CHUNK // _vocab_size(model))
    # Checkpointing frees each chunk's logits until the backward recomputes them, one chunk alive at a time. With
    # one chunk there is nothing to take turns with: its logits are alive again at the head's backward, the first
    # op the backward runs, so keeping them adds nothing to the step's peak and saves the recomputing matmul.
    checkpointed = torch.is_grad_enabled() and len(targets) > size
    pieces = []
    for start in range(0, max(len(targets), 1), size):  # one (empty) chunk keeps an empty batch in the graph
        h_c, t_c = h[start : start + size], targets[start : start + size]
        if checkpointed:
            pieces.append(checkpoint(_chunk_logps, head, h_c, t_c, temperature, use_reentrant=False,
                                     preserve_rng_state=False))
        else:
            pieces.append(_chunk_logps(head, h_c, t_c, temperature))
    return torch.cat(pieces)


def _shared_plan(model: torch.nn.Module, seqs: Seqs, options: ForwardOptions) -> shared_prefix.Plan | None:
    """The shared-prefix layout where `options.share_prefix` asks for it and it applies: unpacked rows (packing runs
    its own layout), a split model (not inside an FSDP2 root, whose hooks expect one call per layer), no gradient
    checkpointing (which drops the cache), and prompts that repeat enough to pay (shared_prefix.plan)."""
    if not options.share_prefix or runs_packed(model, seqs, options) or _INSIDE_ROOT or _is_fsdp_root(model):
        return None
    split = _decoder_and_head(model)
    if split is None or getattr(split[0], "gradient_checkpointing", False) or not shared_prefix.can_share(split[0]):
        return None
    return shared_prefix.cached_plan(seqs, shared_prefix.packs(split[0], seqs.input_ids.device))


def runs_packed(model: torch.nn.Module, seqs: Seqs, options: ForwardOptions) -> bool:
    """Whether token_logps takes the packed path: `options.pack`, some real token, not a prompt-learning model."""
    return options.pack and not _is_prompt_learning(model) and bool(seqs.attention_mask.any())


def processed_tokens(model: torch.nn.Module, seqs: Seqs, options: ForwardOptions) -> int:
    """Token positions the decoder runs on for `seqs`: N x T padded, the real tokens packed, the prefixes once
    and the suffixes where prompts are shared."""
    shared = _shared_plan(_unwrap_ddp(model), seqs, options)
    if shared is not None:
        return shared.positions()
    return int(seqs.attention_mask.sum()) if runs_packed(model, seqs, options) else seqs.input_ids.numel()


def pack_seqs(seqs: Seqs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (N, T) rows -> packed ids (1, L) (the real tokens, row after row), position ids (1, L)
    restarting at 0 for each sequence, and index (N, T): the packed position of each real (row, col)
    (offset of the row + col; meaningless on padding)."""
    real = seqs.attention_mask.bool()
    within = real.long().cumsum(1) - 1  # position inside its own sequence
    index = real.flatten().long().cumsum(0).view_as(within) - 1
    return seqs.input_ids[real].unsqueeze(0), within[real].unsqueeze(0), index


def _packed_token_logps(model: torch.nn.Module, seqs: Seqs, chunk_size: int | None,
                        temperature: float = 1.0) -> torch.Tensor:
    """token_logps on the packed row (chunked head, or the model's own logits on the fallback route),
    gathered at the packed positions of the padded completion positions -> (N, T-1) as padded."""
    packed, pos, index = pack_seqs(seqs)
    rows, cols = seqs.loss_mask[:, 1:].nonzero(as_tuple=True)  # position t predicts token t+1
    at = index[rows, cols]  # (M,) packed positions
    targets = seqs.input_ids[rows, cols + 1]  # (M,)
    split = _decoder_and_head(model)
    if split is None:  # DDP wrappers, FSDP2 roots, logit transforms: the model's own forward
        logits = model(input_ids=packed, position_ids=pos, use_cache=False).logits[0]
        sel = _tempered(_at_least_fp32(logits[at]), temperature)  # (M, V)
        picked = picked_logps(sel, targets)
    else:
        decoder, head = split
        out = _run_decoder(decoder, input_ids=packed, position_ids=pos, use_cache=False)
        hidden = shared_prefix.last_hidden(out)
        picked = _head_logps(model, head, hidden[0, at], targets, chunk_size, temperature)
    logps = torch.zeros(seqs.input_ids.shape[0], seqs.input_ids.shape[1] - 1, dtype=picked.dtype,
                        device=picked.device)
    return logps.index_put((rows, cols), picked)


def packing_probe(model: torch.nn.Module, device) -> Seqs:
    """Four sequences of different lengths (ids below 64, inside any vocabulary; prompts then completions)
    for `check_packing`: enough to leak between when a model ignores the restarting position ids."""
    vocab = min(_vocab_size(model), 64)
    lengths, prompt = (9, 13, 6, 11), 3
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = (torch.arange(n) * 7 + i * 13) % (vocab - 1) + 1
        mask[i, :n] = 1
    loss = mask.bool() & (torch.arange(max(lengths)) >= prompt)
    return Seqs(ids.to(device), mask.to(device), loss.to(device))


def check_packing(model: torch.nn.Module, seqs: Seqs, chunk_size: int | None = None) -> None:
    """The setup step of a run with train.packing (`seqs` of two sequences or more, so that there is something
    to leak between): packed vs padded log-probs, no grad, eval mode (no dropout),
    autocast off unless the attention kernel needs 16-bit. A model that ignores the restarting position ids
    lets sequences attend to each other: UserError, one line. Under FSDP2 every rank calls it (a forward)."""
    if not runs_packed(model, seqs, PACKED):
        return
    if _is_fsdp_root(model) and model not in _INSIDE_ROOT:
        return _as_root_forward(model, seqs, lambda: check_packing(model, seqs, chunk_size))
    several = int((seqs.attention_mask.sum(1) > 0).sum()) >= 2 and bool(seqs.loss_mask[1:, 1:].any())
    if not several:
        return
    inner = _unwrap_ddp(model)
    config = getattr(inner, "config", None)
    flash = "flash" in str(getattr(config, "_attn_implementation", "") or "")
    device_type = seqs.input_ids.device.type
    half = any(p.dtype in (torch.float16, torch.bfloat16) for p in inner.parameters()) or (
        flash and torch.is_autocast_enabled(device_type))
    modes = [(m, m.training) for m in inner.modules()]
    inner.eval()
    try:
        with torch.no_grad(), (nullcontext() if flash else torch.autocast(device_type, enabled=False)):
            packed = _packed_token_logps(inner, seqs, chunk_size)
            padded = token_logps(inner, seqs, PLAIN, chunk_size)
    finally:
        for m, training in modes:
            m.training = training
    diff = (packed - padded)[seqs.loss_mask[:, 1:]].abs()
    if (float(diff.mean()) > PACK_CHECK_TOL_16BIT) if half else (float(diff.max()) > PACK_CHECK_TOL):
        base = inner.get_base_model() if callable(getattr(inner, "get_base_model", None)) else inner
        raise UserError(f"{type(base).__name__} does not support packed sequences (position ids restarting per "
                        f"sequence): set train.packing=false")


def _unwrap_ddp(model: torch.nn.Module) -> torch.nn.Module:
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:
        return model
    return model.module if isinstance(model, DistributedDataParallel) else model


def _is_prompt_learning(model: torch.nn.Module) -> bool:
    """A peft prompt-learning model (virtual tokens prepended inside its forward): never packed."""
    for m in (model, _unwrap_ddp(model)):
        peft_cfg = getattr(m, "active_peft_config", None)
        if peft_cfg is not None and getattr(peft_cfg, "is_prompt_learning", False):
            return True
    return False


def _chunk_logps(head: torch.nn.Module, h: torch.Tensor, targets: torch.Tensor,
                 temperature: float = 1.0) -> torch.Tensor:
    """(C, H) hidden states, (C,) targets -> (C,) float32 log-probs (float64 for a float64 model) of
    softmax(logits / temperature)."""
    logits = _tempered(_at_least_fp32(head_logits(head, h)), temperature)
    return picked_logps(logits, targets)


def head_logits(head: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The LM head on (C, H) hidden states in its weights' precision, autocast off: float32 logits from float32
    master weights under bf16 autocast (CPU or CUDA) and under FSDP2 mixed precision (whose root, holding the
    head, is gathered in float32: backend.shard_model). A bf16 logit moves in steps of 0.06-0.25 nats, so bf16
    logits would quantise every log-ratio and push a PPO ratio outside [0.8, 1.2] by rounding alone; the head
    is ~1/16 of an 8B model's matmul FLOPs. Under 16-bit autocast a plain nn.Linear head runs its backward in the
    autocast dtype (_Float32Head), as autocast runs every other layer's. A 16-bit head (a LoRA run's frozen bf16
    base) runs as it is."""
    weight = getattr(head, "weight", None)
    if weight is None or weight.dtype not in (torch.float32, torch.float64):
        return head(h)
    device = h.device.type
    low = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    with torch.autocast(device, enabled=False):
        x = h.to(weight.dtype)  # bf16 hidden states (FSDP2 layers, a bf16 final norm) -> the head's dtype
        if low in (torch.bfloat16, torch.float16) and weight.dtype == torch.float32 and _plain_linear(head):
            return _Float32Head.apply(x, weight, head.bias, low)
        return head(x)


def _plain_linear(head: torch.nn.Module) -> bool:
    """An nn.Linear itself, no hooks: its forward is F.linear, which _Float32Head computes in its place (a LoRA
    layer, a wrapper's hook on the head run as modules, in float32 both ways)."""
    return (type(head) is torch.nn.Linear and not head._forward_hooks and not head._forward_pre_hooks
            and not head._backward_hooks)


class _Float32Head(torch.autograd.Function):
    """F.linear(x, weight, bias) in float32 forward (the logits every log-ratio is made of), its backward in `low`
    (bf16 under autocast) as autocast computes every other layer's: the two backward GEMMs of a vocabulary-wide head
    (SmolLM2's 49,152 x 576 is 21% of its matmul FLOPs a token) then run at the 16-bit rate instead of float32's
    (6x slower on an AMX CPU), with gradients rounded as every other weight's. The forward values, and so the
    log-ratios and their exact 0 at a sync, are float32's."""

    @staticmethod
    def forward(ctx, x, weight, bias, low):
        ctx.save_for_backward(x, weight)
        ctx.low, ctx.has_bias = low, bias is not None
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1]).to(ctx.low)
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = (g @ weight.to(ctx.low)).to(x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            gw = (g.t() @ x.reshape(-1, x.shape[-1]).to(ctx.low)).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = grad.reshape(-1, grad.shape[-1]).sum(0)
        return gx, gw, gb, None


def _full_logits_token_logps(model: torch.nn.Module, seqs: Seqs, temperature: float = 1.0) -> torch.Tensor:
    """The reference path: the model's own forward, the full (N, T, V) logits cast to float32 (at least)."""
    logits = model(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask, use_cache=False).logits
    logits = _tempered(_at_least_fp32(logits[:, :-1]), temperature)
    targets = seqs.input_ids[:, 1:]
    return picked_logps(logits, targets) * completion_mask(seqs)


def picked_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(..., V) logits, (...) targets -> (...) log softmax(logits)[target]: torch's fused log-softmax kernel, one pass
    to write and one to differentiate, where gather - logsumexp makes five passes over the (..., V) logits forward
    and four backward (at SmolLM2's 49,152-token vocabulary, 376 positions, one thread: 113 against 220 ms forward and
    backward; the same value to float32 rounding)."""
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / T (TRL divides the logits by the sampling temperature before the log-softmax); T = 1 is
    returned as is, so runs without objective.tempered_logps compute exactly what they did before."""
    return logits if temperature == 1.0 else logits / temperature


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """16-bit logits -> float32 for the log-softmax; float64 (backend.precision=fp64) stays float64."""
    return x if x.dtype == torch.float64 else x.float()


def _decoder_and_head(model: torch.nn.Module):
    """(decoder, lm_head) modules when `model(x).logits == lm_head(decoder(x).last_hidden_state)`, else None."""
    if _is_fsdp_root(model) and model not in _INSIDE_ROOT:  # inside: the root's hooks gathered its weights
        return None
    if _is_prompt_learning(model):
        return None
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if any(getattr(text_config, key, None) is not None for key in _HEAD_EXTRAS):
        return None
    get_decoder = getattr(model, "get_decoder", None)
    get_head = getattr(model, "get_output_embeddings", None)
    if not (callable(get_decoder) and callable(get_head)):
        return None
    decoder, head = get_decoder(), get_head()
    if not isinstance(decoder, torch.nn.Module) or not isinstance(head, torch.nn.Module) or decoder is model:
        return None
    return decoder, head


def _is_fsdp_root(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return False
    return isinstance(model, FSDPModule)


def _vocab_size(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(getattr(text_config, "vocab_size", None) or 2**17)


def completion_mask(seqs: Seqs) -> torch.Tensor:
    """Float mask (N, T-1) aligned with token_logps: 1 where the predicted token is a completion token."""
    return seqs.loss_mask[:, 1:].float()


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence sum over tokens: (N, T) -> (N,)."""
    return (x * mask).sum(-1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over every masked token of the batch: (N, T) -> scalar (0 if the mask is empty)."""
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def seq_masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence token mean: (N, T) -> (N,) (0 for an empty sequence)."""
    return (x * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
