"""The sharded part of a checkpoint under FSDP2: torch.distributed.checkpoint (DCP).

Under FSDP2 no rank holds the whole policy, its AdamW states or a moving reference: each rank holds
1/N of every parameter (DTensor shards). So every rank writes its own shards with DCP into
`<checkpoint tmp dir>/shards/` (one file per rank plus DCP's `.metadata`, written by rank 0), and the
rest of the checkpoint (RNGs, scheduler, data position, timers, baselines, the reference log-prob
cache, state.json, checksums) is written by rank 0 next to it as without FSDP (checkpoint.py), then
the whole temp dir is renamed: a kill mid-write never leaves half a checkpoint.

Loading goes the other way: torch.distributed.checkpoint.state_dict builds each rank's sharded state
dict (initialising AdamW's states first, with lr 0), DCP fills it from the files, and set_state_dict
puts it in. DCP could reshard N ranks' files onto M ranks, but the data position and the per-rank
reference cache are per world size, so checkpoint.py refuses a different world size in one line.
"""
from __future__ import annotations

from pathlib import Path

import torch

SHARDS = "shards"


def is_sharded(parts) -> bool:
    """The policy is an FSDP2 module on 2+ ranks (its parameters are DTensor shards)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return parts.dist.enabled and isinstance(parts.policy, FSDPModule)


def _state(parts, opt, with_reference: bool) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    model_sd, optim_sd = get_state_dict(parts.policy, opt)
    state = {"model": model_sd, "optim": optim_sd}
    if with_reference:  # a moving FrozenCopy (humanline sync, online resets), sharded like the policy
        state["reference"] = get_model_state_dict(parts.reference.model)
    return state


def save_shards(tmp: Path, parts, opt, moving: bool) -> None:
    """Every rank: its shards of the policy, AdamW and (when it moves) the reference into tmp/shards.
    A collective; a failure on any rank raises on every rank (DCP gathers the ranks' results)."""
    import torch.distributed.checkpoint as dcp

    for m in (parts.policy, parts.reference.model):
        if hasattr(m, "reshard"):  # after a forward the root may hold unsharded tensors: save the shards
            m.reshard()
    dcp.save(_state(parts, opt, moving), checkpoint_id=str(Path(tmp) / SHARDS))


@torch.no_grad()
def load_shards(path: Path, parts, opt, reference_saved: bool) -> None:
    """Every rank: fill its shards of the policy, AdamW (and the reference) from `path`/shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    shards = Path(path) / SHARDS
    if not (shards / ".metadata").is_file():
        from humanline_cli.errors import UserError

        raise UserError(f"checkpoint {path} has no {SHARDS}/.metadata (not written under backend.strategy=fsdp, "
                        f"or damaged); resume=false starts over")
    state = _state(parts, opt, reference_saved)
    dcp.load(state, checkpoint_id=str(shards))
    set_state_dict(parts.policy, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if reference_saved:
        set_model_state_dict(parts.reference.model, state["reference"])
