"""LoRA policies through peft: wrap a causal LM, read its merged weights, save it as a plain model.

Consumes a transformers causal LM and the `model.lora` knobs; produces a peft `PeftModel` whose
only trainable parameters are the adapter named "policy" (the base weights stay frozen and are
shared with the LoRA references in reference.py), plus the merged weights under the BASE model's
parameter names (`model.layers.0.self_attn.q_proj.weight`, `lm_head.weight`): what a vLLM weight
push or `humanline eval` needs, since neither knows about adapters.
"""
from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer

POLICY_ADAPTER = "policy"
REFERENCE_ADAPTER = "reference"
_PEFT_PREFIX = "base_model.model."  # a PeftModel's state-dict keys = this + the base model's


def apply_lora(model: torch.nn.Module, r: int, alpha: float, dropout: float,
               target_modules: str | Sequence[str] = "all-linear") -> PeftModel:
    """Wrap `model` in LoRA adapters named "policy"; only adapter weights require grad afterwards.

    target_modules: "all-linear" (peft's shorthand: every linear layer except the output head) or
    module names such as ["q_proj", "v_proj"]. The model is modified in place (peft injects its
    layers into it) and returned wrapped; use the returned object from here on.
    """
    if r <= 0:
        raise ValueError(f"LoRA rank must be > 0 (got r={r}); r=0 means full fine-tuning, no adapters")
    targets = target_modules if isinstance(target_modules, str) else [str(t) for t in target_modules]
    config = LoraConfig(r=int(r), lora_alpha=float(alpha), lora_dropout=float(dropout), target_modules=targets,
                        bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, config, adapter_name=POLICY_ADAPTER)


def lora_layers(peft_model: torch.nn.Module) -> Iterator[tuple[str, LoraLayer]]:
    """(name under the base model, layer) for every peft LoRA layer, e.g. ("model.layers.0.self_attn.q_proj", ...)."""
    base = base_model_of(peft_model)
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


def adapter_tensors(peft_model: torch.nn.Module, adapter: str = POLICY_ADAPTER) -> dict[str, torch.Tensor]:
    """Every parameter of one adapter, keyed by its name with the adapter name removed
    ("model.layers.0.self_attn.q_proj.lora_A.weight"), so two adapters' dicts share keys."""
    out = {}
    for layer_name, layer in lora_layers(peft_model):
        for attr in layer.adapter_layer_names:
            container = getattr(layer, attr)
            if adapter not in container:
                continue
            item = container[adapter]
            if isinstance(item, torch.nn.Parameter):  # ParameterDict entries (lora_embedding_A/B)
                out[f"{layer_name}.{attr}"] = item
            else:
                for pname, p in item.named_parameters():
                    out[f"{layer_name}.{attr}.{pname}"] = p
    return out


@torch.no_grad()
def merged_state_dict(peft_model: PeftModel, adapter: str = POLICY_ADAPTER) -> dict[str, torch.Tensor]:
    """The full weights with `adapter` merged in, keyed by the base model's own parameter names
    (`dict(merged_weights(...))`; see there). The live model is never changed (no merge/unmerge)."""
    return dict(merged_weights(peft_model, adapter))


@torch.no_grad()
def merged_weights(peft_model: PeftModel, adapter: str = POLICY_ADAPTER,
                   state: dict[str, torch.Tensor] | None = None,
                   skip: frozenset[str] | set[str] = frozenset(),
                   wide: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(base name, full tensor) for every weight with `adapter` merged in, one entry at a time.

    For a LoRA layer at prefix P: P.weight = base weight + the adapter's delta, transpose(B A) * (alpha / r)
    (peft's `get_delta_weight`, the sum `merge_and_unload` performs), P.bias = the base bias. The sum is taken
    in at least fp32 and, with `wide` (the samplers' push), yielded so: a bf16 base (LoRA under bf16 autocast)
    plus an update below half a bf16 step of a weight would round back to the base weight, and the sampler
    would sample the base model; the sampler rounds once, to its own dtype. `wide=False` casts each merged
    weight back to its base weight's dtype (a saved model in one dtype). The adapters'
    own tensors (P.lora_*) are left out, whatever adapters exist. Read from `state` (the base model's
    state dict, e.g. a gathered full one; default: the live model's own tensors). An unsharded live entry
    is yielded as the live tensor itself (detach-only: the caller must not modify it in place). Names in
    `skip` (a tied weight's second name) are left out before anything is gathered.

    FSDP2 (DTensor shards): each entry is gathered with `full_tensor()` as it is consumed, the base weight
    and the adapter's A and B together, so at most one layer's full tensors exist beside the shards; every
    rank must consume the whole iterator (the gathers are collectives, in the same order on every rank).
    """
    base = base_model_of(peft_model)
    layers = dict(lora_layers(peft_model))
    state = base.state_dict(keep_vars=True) if state is None else state
    for key, value in state.items():
        if key in skip:  # before any gather
            continue
        owner = _owning_layer(key, layers)
        if owner is None:
            yield key, _full(value)
            continue
        prefix, layer = owner
        rest = key[len(prefix) + 1:]
        if not rest.startswith("base_layer."):
            continue  # the adapters' own tensors (lora_A, lora_B, ... of every adapter)
        rest = rest[len("base_layer."):]
        if rest == "weight" and adapter in _adapter_names(layer):
            weight = _full(value)
            sum_dtype = torch.promote_types(weight.dtype, torch.float32)
            merged = weight.to(sum_dtype) + _delta(layer, adapter, state, prefix, value).to(sum_dtype)
            yield f"{prefix}.weight", merged if wide else merged.to(weight.dtype)
        else:
            yield f"{prefix}.{rest}", _full(value)


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor shard gathered (a collective), anything else detached as it is."""
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _delta(layer: LoraLayer, adapter: str, state: dict, prefix: str, weight: torch.Tensor) -> torch.Tensor:
    """The adapter's delta for one layer. A live, unsharded layer: peft's own get_delta_weight (every
    LoRA variant). Sharded or read from a state dict: transpose(B A, fan_in_fan_out) * scaling from the
    full A and B, which is peft's formula for a plain (non-DoRA) LoRA Linear, the only kind checked here."""
    a_key, b_key = f"{prefix}.lora_A.{adapter}.weight", f"{prefix}.lora_B.{adapter}.weight"
    live = state.get(a_key) is _live_param(layer, "lora_A", adapter) and not hasattr(weight, "full_tensor")
    if live:
        return layer.get_delta_weight(adapter)
    if a_key not in state or b_key not in state or layer.use_dora.get(adapter, False):
        raise NotImplementedError(f"merging the LoRA adapter of {prefix} ({type(layer).__name__}) from sharded or "
                                  f"saved tensors: only plain LoRA Linear layers (no DoRA, no embeddings) are supported")
    from peft.utils.other import transpose

    b, a = _full(state[b_key]), _full(state[a_key])
    return transpose(b @ a, layer.fan_in_fan_out) * layer.scaling[adapter]


def _live_param(layer: LoraLayer, attr: str, adapter: str):
    container = getattr(layer, attr, None)
    item = container[adapter] if container is not None and adapter in container else None
    return getattr(item, "weight", None)


def save_merged(peft_model: PeftModel, tokenizer, dest: str | Path, save_adapter: bool = True,
                adapter: str = POLICY_ADAPTER, state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write a plain transformers model dir (config + safetensors + tokenizer) with `adapter` merged in.

    The result loads with `AutoModelForCausalLM.from_pretrained(dest, use_safetensors=True)` like any
    model, so `humanline eval` and vLLM need not know about LoRA. The model is assembled on the meta
    device and filled with `merged_state_dict` (no second copy of the live model, which is not
    changed). With `save_adapter`, the adapter alone also goes to dest/adapter/<adapter name>/ (peft
    puts a non-"default" adapter in a subfolder named after it). Writes to dest.tmp, then renames.

    `state`: the peft model's full state dict (its own keys, `base_model.model.` + the base model's),
    when the live model is FSDP2-sharded: gathered by the caller (torch.distributed.checkpoint's
    get_model_state_dict(full_state_dict=True)), merged and saved from there.
    """
    from transformers import AutoModelForCausalLM

    dest = Path(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    base = base_model_of(peft_model)
    base_state = None if state is None else {k.removeprefix(_PEFT_PREFIX): v for k, v in state.items()}
    merged = {k: v.to("cpu") for k, v in merged_weights(peft_model, adapter, base_state, wide=False)}
    config = copy.deepcopy(base.config)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(merged, strict=True, assign=True)
    plain.tie_weights()  # assign=True replaced tied Parameters by two tensors; tie them again
    if getattr(base, "generation_config", None) is not None:
        plain.generation_config = copy.deepcopy(base.generation_config)
    plain.save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if save_adapter:
        peft_model.save_pretrained(tmp / "adapter", selected_adapters=[adapter], safe_serialization=True,
                                   **({"state_dict": state} if state is not None else {}))
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return dest


def base_model_of(peft_model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a PeftModel (with peft's layers injected into it)."""
    if not isinstance(peft_model, PeftModel):
        raise TypeError(f"expected a peft PeftModel (unwrap DDP's .module first), got {type(peft_model).__name__}")
    return peft_model.get_base_model()


def _adapter_names(layer: LoraLayer) -> set[str]:
    return {name for attr in layer.adapter_layer_names for name in getattr(layer, attr)}


def _owning_layer(key: str, layers: dict[str, LoraLayer]) -> tuple[str, LoraLayer] | None:
    """The LoRA layer whose submodule holds state-dict entry `key`, if any (longest matching prefix)."""
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in layers:
            return prefix, layers[prefix]
    return None
