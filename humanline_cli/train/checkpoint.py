"""Exact mid-run checkpoints, and the rules for rerunning a command into a run dir that has outputs.

A checkpoint is written after optimizer step N to `<run_dir>/checkpoints/step_<N>/` (a temp dir, then a
rename, so a kill mid-write never leaves half a checkpoint; older ones are pruned to K):
- `tensors.safetensors`: the policy's trainable parameters (`policy.<name>`; a peft LoRA policy's
  adapter), the reference when it can differ from the starting weights (`reference.<name>`: a moving
  FrozenCopy's model or AdapterReference's adapter; nothing for a fixed reference), the optimizer's
  per-parameter state (`optimizer.<index>.<key>`), torch's CPU/CUDA RNG states (`rng.*`, rank r's under
  DDP/FSDP as `rng.rank<r>.*`: each rank resumes from its own) and the
  reference log-prob cache of a fixed reference (`reference_cache.values/lengths`, keys in state.json;
  rank 0's under DDP, the other ranks recompute theirs).
- `state.json`: the run that wrote it (`run`: its comparable config and micro-batch, rundir.run_record),
  the step, optimizer param groups, scheduler, python/numpy RNG states (`rng`; ranks 1..
  `rng_ranks`), the data
  source's `state_dict()` (units as tagged JSON), the phase timers, the last logged train metrics
  and the evaluator's baselines (the starting policy's eval texts and scores, sampled and greedy).
- `checksums.json`: the sha256 of every file (both above, and FSDP2's `shards/`), written last (before the
  rename). `verify` checks
  them; a resume skips a checkpoint whose files were truncated, emptied or altered (rundir.newest_intact)
  and `load` refuses one, so damage is never loaded silently.
Loading reads safetensors and JSON only, never pickle. Rank 0 writes, every rank loads.
Under FSDP2 (state.json `"sharded": true`) the policy, AdamW and a moving reference are not in
tensors.safetensors but in `shards/`, every rank's own, written and read with torch.distributed.checkpoint
(train/fsdp_checkpoint.py) inside the same temp dir before the rename.

Rerunning a command into a run dir that has outputs (resume, refuse, start over): rundir.py.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from safetensors import SafetensorError

from humanline_cli.backend import Dist, wait_for_rank0
from humanline_cli.core import objectives
from humanline_cli.core.reference import CachedReference
from humanline_cli.errors import UserError
from humanline_cli.sources.online import TokenCompletion
from humanline_cli.train import fsdp_checkpoint

FORMAT = 1
FILES = ("tensors.safetensors", "state.json")
CHECKSUMS = "checksums.json"  # {file: sha256 hex}, written after FILES and before the rename


def unit_types() -> dict[str, type]:
    """The dataclasses a checkpoint may hold, by name: every registered objective's unit, and sampled completions."""
    return {c.__name__: c for c in (*(o.example for o in objectives.OBJECTIVES.values()), TokenCompletion)}


# ------------------------------------------------------------------ JSON for units and tuples
_PLAIN = (bool, int, float, str, type(None))


def to_json(obj):
    """Units (frozen dataclasses of prompts and completions) and tuples as tagged JSON values."""
    kind = type(obj)
    if kind in _PLAIN:
        return obj
    if kind is list or kind is tuple:
        # fast path: RNG states and orders are long lists of plain numbers
        items = list(obj) if all(type(v) in _PLAIN for v in obj) else [to_json(v) for v in obj]
        return items if kind is list else {"__tuple__": items}
    if kind is dict:
        return {str(k): to_json(v) for k, v in obj.items()}
    if unit_types().get(kind.__name__) is kind:
        return {"__unit__": kind.__name__, **{f.name: to_json(getattr(obj, f.name)) for f in dataclasses.fields(obj)}}
    raise TypeError(f"cannot write {kind.__name__} into a checkpoint's state.json")


def from_json(obj):
    if type(obj) is list:
        return obj if all(type(v) in _PLAIN for v in obj) else [from_json(v) for v in obj]
    if type(obj) is dict:
        if "__tuple__" in obj:
            return tuple(from_json(obj["__tuple__"]))
        if "__unit__" in obj:  # only the known unit types, never an arbitrary class
            cls = unit_types()[obj["__unit__"]]
            return cls(**{k: from_json(v) for k, v in obj.items() if k != "__unit__"})
        return {k: from_json(v) for k, v in obj.items()}
    return obj


# ------------------------------------------------------------------ what a checkpoint holds
def policy_tensors(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The policy's trainable parameters: a peft LoRA policy's adapter, else every trainable parameter."""
    if hasattr(policy, "peft_config"):
        from humanline_cli.core.lora import POLICY_ADAPTER, adapter_tensors

        return adapter_tensors(policy, POLICY_ADAPTER)
    return {n: p for n, p in policy.named_parameters() if p.requires_grad}


def reference_tensors(reference, moving: bool) -> dict[str, torch.Tensor]:
    """The reference's weights when they can differ from the starting policy's (humanline sync, online
    round resets): a FrozenCopy's model or an AdapterReference's adapter. A fixed reference (plain
    offline FrozenCopy, BaseReference) is rebuilt from the starting weights, so nothing is saved."""
    if not moving:
        return {}
    from humanline_cli.core.reference import AdapterReference

    if isinstance(reference, AdapterReference):
        from humanline_cli.core.lora import REFERENCE_ADAPTER, adapter_tensors

        return adapter_tensors(reference.model, REFERENCE_ADAPTER)
    return dict(reference.model.named_parameters())


def _rng_state() -> tuple[dict, dict]:
    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return tensors, {"python": random.getstate(), "numpy": [name, keys.tolist(), pos, has_gauss, cached]}


def rank_rngs(dist) -> list[tuple[dict, dict]]:
    """Every rank's RNG states (_rng_state), in rank order, on every rank: a collective under DDP/FSDP. Each rank
    draws its own numbers (its CUDA device's generator, its share's CPU draws), so each resumes from its own."""
    own = _rng_state()
    if not dist.enabled:
        return [own]
    import torch.distributed as tdist

    out: list = [None] * dist.world_size
    tdist.all_gather_object(out, own)
    return out


def rng_entries(rngs: list[tuple[dict, dict]]) -> tuple[dict, dict]:
    """The checkpoint's (tensors, state.json entries) for every rank's RNG states: rank 0's under the keys a
    one-process checkpoint has (rng.*, "rng"), rank r's under rng.rank<r>.* and "rng_ranks"[r - 1]."""
    tensors, state = dict(rngs[0][0]), {"rng": rngs[0][1], "rng_ranks": [st for _, st in rngs[1:]]}
    for r, (t, _) in enumerate(rngs[1:], 1):
        tensors.update({f"rng.rank{r}.{k.removeprefix('rng.')}": v for k, v in t.items()})
    return tensors, state


def set_rank_rng(tensors: dict, state: dict, rank: int) -> None:
    """Restore `rank`'s own RNG states from a checkpoint's tensors and state (rank 0's where the checkpoint holds
    no other rank's: one written before every rank's were saved)."""
    prefix = f"rng.rank{rank}."
    if rank == 0 or prefix + "torch" not in tensors:
        _set_rng_state({k: v for k, v in tensors.items() if k.startswith("rng.") and not k.startswith("rng.rank")},
                       state["rng"])
        return
    _set_rng_state({"rng." + k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)},
                   state["rng_ranks"][rank - 1])


def _set_rng_state(tensors: dict, state: dict) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["rng.torch"])
    cuda = [tensors[f"rng.cuda.{i}"] for i in range(sum(k.startswith("rng.cuda.") for k in tensors))]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


@torch.no_grad()
def _copy_into(dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor], what: str) -> None:
    if dst.keys() != src.keys():
        missing, extra = sorted(dst.keys() - src.keys()), sorted(src.keys() - dst.keys())
        raise UserError(f"checkpoint {what} does not match the model (missing {missing[:3]}, unexpected {extra[:3]})")
    for name, p in dst.items():
        p.copy_(src[name].to(device=p.device, dtype=p.dtype))


class Checkpoints:
    """`<run_dir>/checkpoints/step_<N>/`: every `every` optimizer steps, the newest `keep` kept."""

    def __init__(self, run_dir: Path, every: int, keep: int = 2, dist: Dist = Dist(), console=None,
                 record: dict | None = None):
        """record: what the run that writes the checkpoints is (rundir.run_record: its config, its micro-batch),
        written into each state.json as "run" for a resume to check."""
        self.root = Path(run_dir) / "checkpoints"
        self.every, self.keep, self.dist, self.console = every, max(1, keep), dist, console
        self.record = record

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints (a complete one has been renamed to step_<N>)."""
        out = []
        for p in self.root.glob("step_*") if self.root.is_dir() else ():
            tail = p.name[len("step_"):]
            if tail.isdigit() and (p / "state.json").is_file():
                out.append(int(tail))
        return sorted(out)

    def latest(self) -> Path | None:
        steps = self.steps()
        return self.root / f"step_{steps[-1]}" if steps else None

    def save(self, step: int, parts, opt, sched, timer, last: dict, moving: bool) -> Path | None:
        """Rank 0 writes; every rank waits for it (a barrier), so no rank runs ahead of a checkpoint.
        Under FSDP2 every rank first writes its own shards into the temp dir (fsdp_checkpoint). Every rank
        computes the source's state (an asynchronous online source gathers its in-flight rounds' shares:
        a collective); rank 0's is written."""
        path = None
        sharded = fsdp_checkpoint.is_sharded(parts)
        if sharded and not self._save_shards(step, parts, opt, moving):
            return None
        # every rank: an asynchronous online source gathers its in-flight rounds' shares here (a collective)
        source = parts.source.state_dict()
        rngs = rank_rngs(self.dist)  # every rank's own RNG states, for rank 0 to write (a collective)
        if self.dist.is_main:
            path = self._write(step, parts, opt, sched, timer, last, moving, source, sharded, rngs)
        if self.dist.enabled:  # rank 0 writes and hashes the files (minutes at 8B): a wait, not a collective
            wait_for_rank0()
        return path

    def _save_shards(self, step: int, parts, opt, moving: bool) -> bool:
        """All ranks: the FSDP2 shards into the temp dir rank 0 made empty. False (on every rank: DCP
        raises on all of them) when a write failed; the previous checkpoint stays, training goes on."""
        import torch.distributed as tdist
        from torch.distributed.checkpoint.api import CheckpointException

        tmp = self.root / f".tmp-step_{step}"
        if self.dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        tdist.barrier()
        try:
            fsdp_checkpoint.save_shards(tmp, parts, opt, moving)
            return True
        except (OSError, CheckpointException) as e:
            if self.dist.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
                if self.console is not None:
                    self.console.print(f"humanline: warning: checkpoint at step {step} not written ({type(e).__name__}: "
                                       f"{str(e).splitlines()[0] if str(e) else ''}); training goes on",
                                       soft_wrap=True, markup=False, highlight=False)
            return False

    def _write(self, step, parts, opt, sched, timer, last, moving, source: dict, sharded: bool = False,
               rngs: list | None = None) -> Path | None:
        from safetensors.torch import save_file

        tensors = {f"policy.{k}": v for k, v in policy_tensors(parts.policy).items()}
        tensors.update({f"reference.{k}": v for k, v in reference_tensors(parts.reference, moving).items()})
        osd = opt.state_dict()
        if sharded:  # policy, reference and AdamW are in shards/ (every rank's, fsdp_checkpoint)
            tensors, osd = {}, {"state": {}, "param_groups": None}
        extra = {}
        for i, st in osd["state"].items():
            for k, v in st.items():
                if torch.is_tensor(v):
                    tensors[f"optimizer.{i}.{k}"] = v
                else:
                    extra.setdefault(str(i), {})[k] = v
        rng_tensors, rng = rng_entries(rngs or [_rng_state()])
        tensors.update(rng_tensors)
        cache_keys = None
        if isinstance(parts.reference, CachedReference):  # resumed runs reuse the cache's numbers
            cache_keys, cache = parts.reference.export()
            tensors.update({f"reference_cache.{k}": v for k, v in cache.items()})
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        from humanline_cli.eval.evaluator import Side

        # the starting policy's evaluation samples (sampled, and greedy when configured; scores are None
        # under a pairwise judge): its weights are gone once training starts, so a resumed run reads them here
        baselines = {k: {"texts": v.texts, "scores": v.scores}
                     for k, v in vars(parts.evaluator or SimpleNamespace()).items() if isinstance(v, Side)}
        state = {"format": FORMAT, "step": step, "world_size": self.dist.world_size, "reference_saved": moving,
                 "optimizer": {"param_groups": osd["param_groups"], "state_extra": extra},
                 "scheduler": sched.state_dict(), **rng, "source": source, "timer": timer.state_dict(),
                 "last_metrics": last, "baselines": baselines, "reference_cache_keys": cache_keys,
                 "sharded": sharded, "run": self.record}
        final = self.root / f"step_{step}"
        tmp = self.root / f".tmp-step_{step}"
        try:
            if not sharded:  # sharded: tmp already holds every rank's shards
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            save_file(tensors, tmp / "tensors.safetensors")
            _write_synced(tmp / "state.json", json.dumps(to_json(state)))
            _fsync(tmp / "tensors.safetensors")
            # written last, from the bytes on disk: a checkpoint proves itself on resume (verify)
            _write_synced(tmp / CHECKSUMS, json.dumps(checksums(tmp), indent=1))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _fsync(self.root)
        except (OSError, SafetensorError) as e:  # a full disk must not kill the run: the previous one stays
            shutil.rmtree(tmp, ignore_errors=True)
            if self.console is not None:
                self.console.print(f"humanline: warning: checkpoint at step {step} not written to {final} "
                                   f"({type(e).__name__}: {e}); training goes on, a rerun would resume from an "
                                   f"earlier checkpoint",
                                   soft_wrap=True, markup=False, highlight=False)
            return None
        for old in self.steps()[:-self.keep]:
            shutil.rmtree(self.root / f"step_{old}", ignore_errors=True)
        return final

    def load(self, path: Path, parts, opt, sched, timer) -> tuple[int, dict]:
        """Restore everything `save` wrote; returns (step, the last logged train metrics)."""
        from safetensors.torch import load_file

        damage = verified_by_rank0(path, self.dist)
        if damage:
            raise UserError(f"checkpoint {path} is damaged ({damage}); resume=false starts over")
        state = read_state(path)
        if state.get("format") != FORMAT:
            raise UserError(f"{path}: checkpoint format {state.get('format')} is not {FORMAT}")
        if state["world_size"] != self.dist.world_size:
            raise UserError(f"{path} was written by {state['world_size']} rank(s), this run has "
                            f"{self.dist.world_size}; resume=false starts over")
        tensors = load_file(path / "tensors.safetensors")
        part = lambda prefix: {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}  # noqa: E731
        if bool(state.get("sharded")) != fsdp_checkpoint.is_sharded(parts):
            raise UserError(f"{path} was written {'with' if state.get('sharded') else 'without'} FSDP sharding and "
                            f"this run is {'not ' if state.get('sharded') else ''}sharded; resume=false starts over")
        if state.get("sharded"):  # every rank reads its own shards (a collective)
            fsdp_checkpoint.load_shards(path, parts, opt, state["reference_saved"])
        else:
            _copy_into(policy_tensors(parts.policy), part("policy."), "policy")
            if state["reference_saved"]:
                _copy_into(reference_tensors(parts.reference, True), part("reference."), "reference")
            opt_state: dict[int, dict] = {}
            for key, v in part("optimizer.").items():
                i, name = key.split(".", 1)
                opt_state.setdefault(int(i), {})[name] = v
            for i, extra in state["optimizer"]["state_extra"].items():
                opt_state.setdefault(int(i), {}).update(extra)
            opt.load_state_dict({"state": opt_state, "param_groups": state["optimizer"]["param_groups"]})
        sched.load_state_dict(state["scheduler"])
        parts.source.load_state_dict(state["source"])
        timer.load_state_dict(state["timer"])
        if parts.evaluator is not None:
            from humanline_cli.eval.evaluator import Side

            for name, side in state["baselines"].items():  # baseline, greedy_baseline
                setattr(parts.evaluator, name, Side(side["texts"], side["scores"]))
        if state.get("reference_cache_keys") is not None and isinstance(parts.reference, CachedReference):
            parts.reference.restore(state["reference_cache_keys"], part("reference_cache."))
        set_rank_rng(tensors, state, self.dist.rank)
        return int(state["step"]), dict(state["last_metrics"])


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _files(path: Path) -> list[str]:
    """Every file of a checkpoint dir (FSDP2's `shards/` included), as relative paths, checksums.json aside."""
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file() and p.name != CHECKSUMS)


def checksums(path: Path) -> dict[str, str]:
    """{relative path: sha256} of every file in the checkpoint dir, from the bytes on disk (files hashed in
    parallel threads: hashlib releases the GIL, so an FSDP checkpoint's per-rank shards hash side by side)."""
    names = _files(Path(path))
    return dict(zip(names, _hash_all([Path(path) / n for n in names]), strict=True))


def _hash_all(files: list[Path]) -> list[str]:
    from concurrent.futures import ThreadPoolExecutor

    if len(files) <= 1:
        return [_sha256(f) for f in files]
    with ThreadPoolExecutor(max_workers=min(8, len(files))) as pool:
        return list(pool.map(_sha256, files))


def verify(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be trusted (a missing, truncated or altered file, checked
    against the sha256 sums written with it), or None when every file is as written."""
    path = Path(path)
    try:
        sums = json.loads((path / CHECKSUMS).read_text())
    except FileNotFoundError:
        return f"no {CHECKSUMS} (unfinished, or written by an older humanline)"
    except (OSError, ValueError) as e:
        return f"{CHECKSUMS} unreadable ({type(e).__name__})"
    if not isinstance(sums, dict) or not set(FILES) <= set(sums):
        return f"{CHECKSUMS} does not list {', '.join(FILES)}"
    extra = sorted(set(_files(path)) - set(sums))
    if extra:
        return f"{extra[0]} is not in {CHECKSUMS} (written after the checkpoint)"
    names = sorted(sums)
    for name in names:
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size == 0:
            return f"{name} is empty"
    for name, digest in zip(names, _hash_all([path / n for n in names]), strict=True):
        if digest != sums[name]:
            return f"{name} ({(path / name).stat().st_size} bytes) does not match its sha256 (truncated or altered)"
    return None


def verified_by_rank0(path: Path, dist: Dist) -> str | None:
    """`verify` on rank 0 alone, its verdict on every rank: the files are shared, so hashing them on every
    rank (~112 GB at 8B, 8 times over) only repeats rank 0's work; the others wait outside the training
    group's timeout."""
    damage = verify(path) if dist.is_main else None
    if not dist.enabled:
        return damage
    import torch.distributed as tdist

    wait_for_rank0()
    box = [damage]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def read_state(path: Path) -> dict:
    return from_json(json.loads((Path(path) / "state.json").read_text()))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())

