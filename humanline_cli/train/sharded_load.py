"""Sharded loading under FSDP2: no rank ever holds the whole model (policy or reference).

Each rank builds the model with its parameters on the meta device (no memory; buffers such as RoPE's
inv_freq, which are computed at construction and are not in the checkpoint, stay real), shards it
with FSDP2 (`fully_shard` per decoder layer, then the root: still meta), allocates only its own shards
(`to_empty`) and reads only its own rows of each tensor from the safetensors files (`get_slice`: the
file is memory-mapped, the other ranks' rows are never read). FSDP2 shards every parameter on dim 0 in
torch.chunk's way: rank r holds rows [r * c, min((r + 1) * c, D)) with c = ceil(D / ranks).

The reference is built the same way (meta, cast to its dtype, sharded) and its shards are copied from
the policy's own shards (`sync_reference`, shard to shard, no gather), so it equals the policy's
starting weights as the full-copy path's deepcopy does.

Peak per rank while loading: the policy's and the reference's shards plus one tensor's rows at a time
(memory.estimate(loading="sharded")). Against the full path (every rank loads the whole policy and
deep-copies it before sharding: 2 x the model in the weights' dtype) this is measured by
`just memory-check` (`--loading both`: full, then sharded).

A checkpoint whose tensor names do not match the model's own (transformers renames some legacy
checkpoints while loading) returns None: the caller takes the full path.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from humanline_cli.backend import cast_layers
from humanline_cli.config import RunSpec
from humanline_cli.errors import UserError


@contextmanager
def params_on_meta() -> Iterator[None]:
    """Every nn.Parameter registered inside goes to the meta device; buffers stay where they are made."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":  # a tie (lm_head.weight = embed's) keeps its object
            p = module._parameters[name]
            module._parameters[name] = torch.nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def local_model_dir(path: str) -> str | None:
    """The local folder holding `path`'s files: the folder itself, or a hub id's snapshot in the
    huggingface_hub cache (HF_HUB_CACHE; never downloaded here: the full path's from_pretrained does
    that), else None. A hub id is what the paper configs name, so without this every rank would load
    the whole model."""
    if os.path.isdir(path):
        return path
    if not is_hub_id(path):
        return None
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, local_files_only=True)
    except Exception:  # not cached (or not a valid id): the full path loads (and downloads) it
        return None


def loads_sharded(spec: RunSpec) -> bool:
    """Whether the policy loads sharded (FSDP2 full fine-tuning without remote code) where its files can be read."""
    b = spec.backend_cfg
    return (b.strategy.value == "fsdp" and b.nproc > 1 and spec.model_cfg.lora.r == 0
            and not spec.model_cfg.trust_remote_code)


def is_hub_id(path: str) -> bool:
    return not os.path.isdir(path) and path.count("/") == 1 and not path.startswith((".", "/", "~"))


# a snapshot sharded loading can read: safetensors weights, configs and tokenizer files (never pickled weights)
SNAPSHOT_FILES = ["*.safetensors", "*.json", "*.model", "*.txt", "*.tiktoken", "*.py"]


def fetch_snapshot(path: str) -> str | None:
    """A hub id's snapshot in the huggingface_hub cache, downloaded first where it is not there yet (weights as
    safetensors, configs, tokenizer files), so that sharded loading can read it on a first run; None where it
    cannot be had (offline, no such repository, no network)."""
    local = local_model_dir(path)
    if local is not None or not is_hub_id(path):
        return local
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, allow_patterns=SNAPSHOT_FILES)
    except Exception:  # the whole-model path reports what is wrong with the id in one line
        return None


def sharded_loadable(path: str) -> bool:
    """Whether load_policy_sharded can read `path` (a local folder or cached hub snapshot of safetensors);
    the memory estimate takes the same loading mode as build_parts."""
    from safetensors import SafetensorError

    local = local_model_dir(path)
    try:
        return local is not None and weight_map(local) is not None
    except (SafetensorError, OSError):  # an unreadable header: the whole-model load names the file in one line
        return False


def weight_map(path: str) -> dict[str, str] | None:
    """Tensor name -> safetensors file of a local model folder (one file or an index), else None."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        return None
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def _rows(param: torch.Tensor) -> tuple[int, int]:
    """This rank's rows [start, end) of an FSDP2 parameter (Shard(0), torch.chunk's split)."""
    mesh = param.device_mesh
    ranks, rank = mesh.size(), mesh.get_local_rank()
    dim0 = param.shape[0]
    chunk = -(-dim0 // ranks)
    start = min(rank * chunk, dim0)
    return start, min(start + chunk, dim0)


def build_sharded(config, dtype: torch.dtype, device: torch.device, shard: Callable[[torch.nn.Module], None],
                  prepare: Callable[[torch.nn.Module], None] | None = None) -> torch.nn.Module:
    """The model of `config` with meta parameters, `prepare`d (gradient checkpointing), cast to `dtype`,
    sharded by `shard` and given uninitialised local shards on `device`; buffers kept as built."""
    from transformers import AutoModelForCausalLM

    with params_on_meta():
        model = AutoModelForCausalLM.from_config(config)
    for p in model.parameters():  # meta: free. Buffers (RoPE's inv_freq) stay fp32, as from_pretrained's do
        p.data = p.data.to(dtype)
    model.config.use_cache = False
    if prepare is not None:
        prepare(model)
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    shard(model)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in buffers:
                b.copy_(buffers[name])
    return model


@torch.no_grad()
def load_shards(model: torch.nn.Module, files: dict[str, str], path: str, key: str) -> bool:
    """Copy this rank's rows of every parameter (and whole persistent buffers) from the safetensors files;
    False when a tensor the model needs is not in the checkpoint under its own name."""
    from safetensors import safe_open

    params = dict(model.named_parameters())  # tied weights appear once
    buffers = {n: b for n, b in model.named_buffers() if n in files}
    if any(name not in files for name in params):
        return False
    handles: dict[str, object] = {}
    try:
        for name, tensor in [*params.items(), *buffers.items()]:
            file = files[name]
            if file not in handles:
                handles[file] = safe_open(file, framework="pt")
            sl = handles[file].get_slice(name)
            if tuple(sl.get_shape()) != tuple(tensor.shape):
                raise UserError(f"{key}={path}: the checkpoint has weights of another shape than those the policy "
                                f"needs: {name} {tuple(sl.get_shape())} vs {tuple(tensor.shape)}")
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            if hasattr(tensor, "device_mesh") and local.dim() > 0:
                start, end = _rows(tensor)
                if end - start != local.shape[0]:
                    raise RuntimeError(f"FSDP2 shard of {name}: {local.shape[0]} rows, expected {end - start}")
                if end > start:
                    local.copy_(sl[start:end])
            else:
                local.copy_(sl[:] if local.dim() else handles[file].get_tensor(name))
    finally:
        handles.clear()
    return True


def load_policy_sharded(path: str, device: torch.device, dtype: torch.dtype,
                        shard: Callable[[torch.nn.Module], None],
                        prepare: Callable[[torch.nn.Module], None] | None = None,
                        trust_remote_code: bool = False, key: str = "model.name_or_path") -> torch.nn.Module | None:
    """The policy, sharded by `shard` as it loads (see the module docstring), in train mode; None when
    `path` is not a local folder of safetensors whose names match the model's (take the full path)."""
    from transformers import AutoConfig

    path = local_model_dir(path)
    files = weight_map(path) if path is not None else None
    if files is None:
        return None
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    names = set(files)
    with torch.device("meta"):  # a dry run on meta: do the names match? (no memory, no sharding yet)
        from transformers import AutoModelForCausalLM

        probe = AutoModelForCausalLM.from_config(config)
    if any(name not in names for name, _ in probe.named_parameters()):
        return None
    del probe
    model = build_sharded(config, dtype, device, shard, prepare)
    if not load_shards(model, files, path, key):
        return None
    return model.train()


def sharded_reference(policy: torch.nn.Module, dtype: torch.dtype, device: torch.device,
                      shard: Callable[[torch.nn.Module], None]) -> torch.nn.Module:
    """A frozen copy of a sharded policy, built sharded (never whole): its shards copied from the policy's. Its
    decoder layers in `dtype` (bf16 under FSDP2 mixed precision), the root (embeddings, final norm, head) in
    the policy's own precision, as the policy's root computes (backend.cast_layers)."""
    from humanline_cli.core.humanline import sync_reference

    root_dtype = policy.get_input_embeddings().weight.dtype
    reference = build_sharded(policy.config, root_dtype, device, shard, prepare=lambda m: cast_layers(m, dtype))
    reference.eval().requires_grad_(False)
    with torch.no_grad():
        sync_reference(policy, reference)
    return reference
