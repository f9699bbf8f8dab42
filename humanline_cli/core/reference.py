"""The reference policy: what the objectives' log-ratios are measured against.

Every kind implements core/interfaces.Reference (`logps(seqs)` without gradient, `sync(policy)` for the
humanline sync and the online round reset, `model`, `n_params()`):
- `FrozenCopy`: a full, frozen second copy of the policy (full fine-tuning). Sync copies every
  parameter in place; under FSDP each rank copies its own shard (no gather).
- LoRA references (see lora.py): the base model with adapters disabled, or a second frozen
  "reference" adapter that the sync overwrites with the policy adapter; no second model copy.
- `CachedReference`: either kind, its log-probs stored per sequence while it cannot move.
`build_reference` is the one place a run's reference is made (which kind, its dtype and sharding under
FSDP, whether it is cached); `reference_moves` says whether it can move, from the rule that moves it
(humanline.ReferenceRule: the humanline sync and the online round reset), which the trainer applies.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from humanline_cli.core.batches import Seqs
from humanline_cli.core.corrections import mix_reference
from humanline_cli.core.humanline import HumanlineSpec, ReferenceRule, sync_reference
from humanline_cli.core.interfaces import Reference
from humanline_cli.core.logprobs import PLAIN, ForwardOptions, token_logps


class FrozenCopy:
    def __init__(self, policy: torch.nn.Module, built: torch.nn.Module | None = None, options: ForwardOptions = PLAIN):
        """A deep copy of `policy`, or `built`: a copy made elsewhere (sharded loading builds it sharded); its
        forwards run with `options`, the policy's."""
        self.model = (copy.deepcopy(policy) if built is None else built).eval()
        self.model.requires_grad_(False)
        self.options = options

    @torch.no_grad()
    def logps(self, seqs: Seqs) -> torch.Tensor:
        out = token_logps(self.model, seqs, self.options)
        if hasattr(self.model, "reshard"):  # FSDP2 keeps a root unsharded after forward, and a frozen copy has
            self.model.reshard()            # no backward to reshard it: its gathered embeddings and head would
        return out                          # stay alive through the policy's forward and backward (measured)

    def sync(self, policy: torch.nn.Module) -> None:
        for m in (policy, self.model):  # FSDP2 keeps the root unsharded after forward: back to shards
            if hasattr(m, "reshard"):
                m.reshard()
        sync_reference(policy, self.model)

    def mix(self, policy: torch.nn.Module, alpha: float) -> None:
        """TR-DPO's soft update: ref <- alpha * policy + (1 - alpha) * ref (under FSDP each rank its shards)."""
        for m in (policy, self.model):
            if hasattr(m, "reshard"):
                m.reshard()
        mix_reference(policy, self.model, alpha)

    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def step_stats(self) -> dict:
        return {}


# ------------------------------------------------------------------ LoRA references (no second model copy)
# Both run the one shared peft model. peft's adapter switches (disable_adapter, set_adapter) rewrite
# requires_grad on adapter weights as a side effect, so both snapshot every parameter's flag and put it
# back afterwards: the policy adapter stays trainable, the reference adapter never is. They also run in
# eval mode (no LoRA dropout), as FrozenCopy does, and restore each module's own train/eval flag.


@contextmanager
def _reference_pass(model: torch.nn.Module) -> Iterator[None]:
    flags = [(p, p.requires_grad) for p in model.parameters()]
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training
        for p, requires_grad in flags:
            p.requires_grad_(requires_grad)


class BaseReference:
    """The starting model for a LoRA policy: the same weights with the adapters switched off.

    Costs no parameters. It cannot move, so it serves plain OFFLINE runs only; a plain online run
    (reference reset each round) and a humanline run (sync) need `AdapterReference`. Choose with
    `make_lora_reference(model, moving=...)`.
    """

    def __init__(self, peft_model: torch.nn.Module, options: ForwardOptions = PLAIN):
        from humanline_cli.core.lora import base_model_of

        base_model_of(peft_model)  # type check: a PeftModel
        self.model = peft_model
        self.options = options

    @torch.no_grad()
    def logps(self, seqs: Seqs) -> torch.Tensor:
        with _reference_pass(self.model), self.model.disable_adapter():
            return token_logps(self.model, seqs, self.options)

    def sync(self, policy: torch.nn.Module) -> None:
        raise RuntimeError("BaseReference (a LoRA policy's base model, adapters off) cannot take the policy's "
                           "weights; runs whose reference moves (humanline sync, online round resets) need "
                           "AdapterReference: make_lora_reference(model, moving=True)")

    def mix(self, policy: torch.nn.Module, alpha: float) -> None:
        raise RuntimeError(f"{type(self).__name__} cannot take a weighted mix of the policy (correction=trdpo needs "
                           f"full fine-tuning and an uncached reference)")

    def n_params(self) -> int:
        return 0

    def step_stats(self) -> dict:
        return {}


class AdapterReference:
    """A second, frozen LoRA adapter "reference" on the policy's own base model.

    Same LoRA config as the policy adapter and initialised equal to it, so at step 1 every log-ratio
    is exactly 0. `sync` copies the policy adapter's tensors into it in place; the base weights are
    shared and frozen, so that makes the reference equal to the policy. Costs one adapter's
    parameters. For humanline runs and plain online runs (round resets).
    """

    def __init__(self, peft_model: torch.nn.Module, options: ForwardOptions = PLAIN):
        from humanline_cli.core.lora import POLICY_ADAPTER, REFERENCE_ADAPTER, base_model_of

        base_model_of(peft_model)  # type check: a PeftModel
        if POLICY_ADAPTER not in peft_model.peft_config:
            raise ValueError(f"the model has no '{POLICY_ADAPTER}' adapter (build it with lora.apply_lora)")
        self.model = peft_model
        self.options = options
        flags = [(p, p.requires_grad) for p in peft_model.parameters()]
        # add_adapter marks every lora_ weight trainable and may touch other flags: restore, then freeze ours
        peft_model.add_adapter(REFERENCE_ADAPTER, copy.deepcopy(peft_model.peft_config[POLICY_ADAPTER]))
        for p, requires_grad in flags:
            p.requires_grad_(requires_grad)
        for p in self._tensors(REFERENCE_ADAPTER).values():
            p.requires_grad_(False)
        self.sync(peft_model)

    def _tensors(self, adapter: str) -> dict[str, torch.Tensor]:
        from humanline_cli.core.lora import adapter_tensors

        # looked up on every call, never cached: FSDP2 replaces parameters after construction
        return adapter_tensors(self.model, adapter)

    @torch.no_grad()
    def logps(self, seqs: Seqs) -> torch.Tensor:
        from humanline_cli.core.lora import POLICY_ADAPTER, REFERENCE_ADAPTER

        with _reference_pass(self.model):
            self.model.set_adapter(REFERENCE_ADAPTER)  # (no inference_mode: peft < 0.15 lacks it; flags restored)
            try:
                return token_logps(self.model, seqs, self.options)
            finally:
                # switch back before anything else runs: a checkpointed policy forward recomputes in backward
                self.model.set_adapter(POLICY_ADAPTER)

    @torch.no_grad()
    def sync(self, policy: torch.nn.Module) -> None:
        """reference adapter <- policy adapter, in place. `policy` must be this model (or DDP around it)."""
        from humanline_cli.core.lora import POLICY_ADAPTER, REFERENCE_ADAPTER

        target = policy
        while target is not self.model and hasattr(target, "module"):
            target = target.module
        if target is not self.model:
            raise ValueError("AdapterReference.sync: `policy` is not the peft model this reference lives in")
        if hasattr(self.model, "reshard"):  # FSDP2: copy shard to shard, never a gathered (unsharded) root
            self.model.reshard()
        src, dst = self._tensors(POLICY_ADAPTER), self._tensors(REFERENCE_ADAPTER)
        if src.keys() != dst.keys():
            raise RuntimeError("policy and reference adapters do not have the same tensors")
        for key, p in src.items():
            dst[key].copy_(p.detach())

    def mix(self, policy: torch.nn.Module, alpha: float) -> None:
        raise RuntimeError(f"{type(self).__name__} cannot take a weighted mix of the policy (correction=trdpo needs "
                           f"full fine-tuning and an uncached reference)")

    def n_params(self) -> int:
        from humanline_cli.core.lora import REFERENCE_ADAPTER

        return sum(p.numel() for p in self._tensors(REFERENCE_ADAPTER).values())

    def step_stats(self) -> dict:
        return {}


def make_lora_reference(peft_model: torch.nn.Module, moving: bool,
                        options: ForwardOptions = PLAIN) -> BaseReference | AdapterReference:
    """moving=False (plain offline): BaseReference; moving=True (humanline sync or online round resets):
    AdapterReference. Build it BEFORE the optimizer and any DDP/FSDP wrapping, since it adds parameters."""
    return AdapterReference(peft_model, options) if moving else BaseReference(peft_model, options)


# ------------------------------------------------------------------ reference log-prob cache
class CachedReference:
    """A FIXED reference (plain offline runs) whose per-token log-probs are computed once per sequence.

    Keyed by the sequence's content (its real token ids and where its completion starts), so the same
    pair seen again in a later epoch, in another micro-batch or on another step, reuses the numbers the
    reference produced the first time; only the policy forward and backward run again. A batch whose
    sequences are all known skips the reference forward; otherwise the whole batch runs as it would
    uncached (the same shapes, the same numbers) and the new sequences are stored. Values returned are
    always the ones first computed for that sequence, bitwise; note the uncached path itself is not
    batch-invariant (one sequence's log-probs differ in the last float32 bits between two batches of
    different padding), so a cached run equals an uncached one bitwise until the first repeat and to
    float32 rounding after. Kept in host memory: 4 bytes per completion token.

    `sync` refuses: a reference that moves (humanline sync, online round resets) is never wrapped.
    (Online rounds use each sample in one step, so there is nothing to reuse there.)
    """

    def __init__(self, inner: Reference, agree=None):
        self.inner = inner
        # agree(flag) -> flag on every rank (backend.all_agree): under FSDP the forward is a collective,
        # so whether to skip it must be the same decision on all ranks
        self.agree = agree or (lambda flag: flag)
        self.store: dict[bytes, torch.Tensor] = {}
        self.hits = 0    # sequences served from the store (since construction)
        self.misses = 0  # sequences the reference model computed
        self._seen = (0, 0)  # (hits, misses) at the last step_stats() call

    @property
    def model(self) -> torch.nn.Module:
        return self.inner.model

    def n_params(self) -> int:
        return self.inner.n_params()

    @staticmethod
    def _keys(seqs: Seqs) -> list[bytes]:
        ids, real, comp = seqs.input_ids.cpu(), seqs.attention_mask.cpu().bool(), seqs.loss_mask.cpu()
        keys = []
        for i in range(ids.shape[0]):
            start = int(comp[i].nonzero()[0]) if comp[i].any() else -1
            keys.append(start.to_bytes(4, "little", signed=True) + ids[i][real[i]].numpy().tobytes())
        return keys

    @torch.no_grad()
    def logps(self, seqs: Seqs) -> torch.Tensor:
        keys = self._keys(seqs)
        known = [self.store.get(k) for k in keys]
        mask = seqs.loss_mask[:, 1:]
        if self.agree(all(v is not None for v in known)):
            self.hits += len(keys)
            values = torch.cat(known) if known else torch.zeros(0)
            out = torch.zeros(mask.shape, dtype=values.dtype, device=seqs.input_ids.device)  # as computed
            rows, cols = mask.nonzero(as_tuple=True)
            return out.index_put((rows, cols), values.to(out.device))
        out = self.inner.logps(seqs)
        host = out.cpu()
        host_mask = mask.cpu()
        for i, (key, value) in enumerate(zip(keys, known)):
            if value is None:
                self.misses += 1
                self.store[key] = host[i][host_mask[i]].clone()
            else:  # known from an earlier batch: serve the first-computed numbers
                self.hits += 1
                out[i][mask[i]] = value.to(out.device)
        return out

    def export(self) -> tuple[list[str], dict[str, torch.Tensor]]:
        """For checkpoints: the keys (hex, in order) and two tensors, every value back to back and each
        one's length, so a resumed run serves the same first-computed numbers."""
        keys = list(self.store)
        values = [self.store[k] for k in keys]
        flat = torch.cat(values) if values else torch.zeros(0)
        lengths = torch.tensor([len(v) for v in values], dtype=torch.int64)
        return [k.hex() for k in keys], {"values": flat, "lengths": lengths}

    def restore(self, keys: list[str], tensors: dict[str, torch.Tensor]) -> None:
        pieces = torch.split(tensors["values"], tensors["lengths"].tolist()) if keys else []
        self.store = {bytes.fromhex(k): v.clone() for k, v in zip(keys, pieces)}

    def sync(self, policy: torch.nn.Module) -> None:
        raise RuntimeError("CachedReference wraps a fixed reference only; a moving reference must not be cached")

    def mix(self, policy: torch.nn.Module, alpha: float) -> None:
        raise RuntimeError(f"{type(self).__name__} cannot take a weighted mix of the policy (correction=trdpo needs "
                           f"full fine-tuning and an uncached reference)")

    def stats(self) -> dict:
        """Since construction: the hit fraction and how many sequences are stored."""
        total = self.hits + self.misses
        return {"reference_cache/hit_fraction": self.hits / total if total else 0.0,
                "reference_cache/sequences": len(self.store)}

    def step_stats(self) -> dict:
        """The fraction of reference sequences served from the store since the last call (the trainer
        logs it per step; it depends only on the data, so a resumed run logs what it would have)."""
        hits, misses = self.hits - self._seen[0], self.misses - self._seen[1]
        self._seen = (self.hits, self.misses)
        return {"reference_cache/hit_fraction": hits / (hits + misses) if hits + misses else 0.0}


def reference_moves(humanline: HumanlineSpec, regime: str, correction=None) -> bool:
    """Whether the reference can leave the starting weights (humanline sync, online round resets, TR-DPO's soft
    update: `correction`, the run's CorrectionSpec)."""
    return ReferenceRule.from_spec(humanline, regime, correction).moves


def build_reference(policy: torch.nn.Module, *, lora: bool, moving: bool, cache: bool,
                    shard: Callable[[torch.nn.Module], None] | None = None,
                    cast: Callable[[torch.nn.Module], None] | None = None,
                    agree: Callable[[bool], bool] | None = None, built: torch.nn.Module | None = None,
                    options: ForwardOptions = PLAIN) -> Reference:
    """The run's reference, from the unwrapped, unsharded policy (a peft model when `lora`), its forwards run with
    `options` (the policy's: packing, shared prompts and the log-prob temperature alike on both sides):
    - LoRA: the base model with adapters disabled (fixed) or a second "reference" adapter (`moving`);
    - else a frozen copy, `cast` in place (backend.cast_layers under FSDP2 bf16: the decoder layers in bf16, as
      it never gets gradients or AdamW; the root, holding the head, stays fp32 as the policy's computes; buffers
      such as RoPE's inv_freq stay fp32) and sharded with `shard` as the policy is (the same mixed-precision
      policies: both forwards compute alike, so a sync makes every log-ratio exactly 0), so the sync copies
      (and casts) each rank's local shards; `built`: that copy already made, cast and sharded (sharded
      loading: train/sharded_load.py);
    - `cache` and not `moving` (plain offline): each sequence's log-probs computed once (`agree`: under
      FSDP the forward all-gathers shards, so every rank skips it or none does)."""
    if lora:
        reference = make_lora_reference(policy, moving=moving, options=options)
    elif built is not None:
        reference = FrozenCopy(policy, built, options)
    else:
        reference = FrozenCopy(policy, options=options)
        if cast is not None:
            cast(reference.model)
        if shard is not None:
            shard(reference.model)
    return CachedReference(reference, agree=agree) if cache and not moving else reference
