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
    """The full weights with `adapter` merged in, keyed by the base model's own parameter names.

    For a LoRA layer at prefix P: P.weight = base weight + the adapter's delta (peft's
    `get_delta_weight`, the same sum `merge_and_unload` performs), P.bias = the base bias; the
    adapters' own tensors (P.lora_*) are left out, whatever adapters exist. Every other entry is the
    live tensor itself (not a copy; detach-only), so the caller must not modify them in place. The
    live model is never changed (no merge/unmerge).
    """
    base = base_model_of(peft_model)
    layers = dict(lora_layers(peft_model))
    out: dict[str, torch.Tensor] = {}
    for key, value in base.state_dict(keep_vars=True).items():
        owner = _owning_layer(key, layers)
        if owner is None:
            out[key] = value.detach()
            continue
        prefix, layer = owner
        rest = key[len(prefix) + 1:]
        if not rest.startswith("base_layer."):
            continue  # the adapters' own tensors (lora_A, lora_B, ... of every adapter)
        rest = rest[len("base_layer."):]
        if rest == "weight" and adapter in _adapter_names(layer):
            out[f"{prefix}.weight"] = value.detach() + layer.get_delta_weight(adapter).to(value.dtype)
        else:
            out[f"{prefix}.{rest}"] = value.detach()
    return out


def save_merged(peft_model: PeftModel, tokenizer, dest: str | Path, save_adapter: bool = True,
                adapter: str = POLICY_ADAPTER) -> Path:
    """Write a plain transformers model dir (config + safetensors + tokenizer) with `adapter` merged in.

    The result loads with `AutoModelForCausalLM.from_pretrained(dest, use_safetensors=True)` like any
    model, so `humanline eval` and vLLM need not know about LoRA. The model is assembled on the meta
    device and filled with `merged_state_dict` (no second copy of the live model, which is not
    changed). With `save_adapter`, the adapter alone also goes to dest/adapter/<adapter name>/ (peft
    puts a non-"default" adapter in a subfolder named after it). Writes to dest.tmp, then renames.
    """
    from transformers import AutoModelForCausalLM

    dest = Path(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    base = base_model_of(peft_model)
    state = {k: v.to("cpu") for k, v in merged_state_dict(peft_model, adapter).items()}
    config = copy.deepcopy(base.config)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(state, strict=True, assign=True)
    plain.tie_weights()  # assign=True replaced tied Parameters by two tensors; tie them again
    if getattr(base, "generation_config", None) is not None:
        plain.generation_config = copy.deepcopy(base.generation_config)
    plain.save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if save_adapter:
        peft_model.save_pretrained(tmp / "adapter", selected_adapters=[adapter], safe_serialization=True)
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
