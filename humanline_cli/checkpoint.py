"""Exact mid-run checkpoints, and the rules for rerunning a command into a run dir that has outputs.

A checkpoint is written after optimizer step N to `<run_dir>/checkpoints/step_<N>/` (a temp dir, then a
rename, so a kill mid-write never leaves half a checkpoint; older ones are pruned to K):
- `tensors.safetensors`: the policy's trainable parameters (`policy.<name>`; a peft LoRA policy's
  adapter), the reference when it can differ from the starting weights (`reference.<name>`: a moving
  FrozenCopy's model or AdapterReference's adapter; nothing for a fixed reference), the optimizer's
  per-parameter state (`optimizer.<index>.<key>`), torch's CPU/CUDA RNG states (`rng.*`) and the
  reference log-prob cache of a fixed reference (`reference_cache.values/lengths`, keys in state.json;
  rank 0's under DDP, the other ranks recompute theirs).
- `state.json`: the step, optimizer param groups, scheduler, python/numpy RNG states, the data
  source's `state_dict()` (units as tagged JSON), the phase timers, the last logged train metrics
  and the evaluator's baselines (the starting policy's eval texts and scores, sampled and greedy).
Loading reads safetensors and JSON only, never pickle. Rank 0 writes, every rank loads.

Rerunning into a run dir (`is_complete`, `prepare_run_dir`, called by the CLI before any rank starts):
the saved `resolved_config.json` is compared with the new config, minus keys that never change
results (IGNORED). Same config and complete: nothing to do. Same config, incomplete: resume from the
last checkpoint (step-indexed outputs rewound to it) or start over. Another config: refused
(RunDirConflict) unless `resume=false`, which moves the old outputs to `previous-<n>/`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from .backend import Dist
from .data.examples import BinaryExample, GroupExample, PairExample
from .errors import UserError
from .sources.online import TokenCompletion
from .tracking import scrub

FORMAT = 1
# keys that never change results: a rerun that differs only in these resumes
IGNORED = ("resume", "threads", "wandb", "world_cache", "hydra")
IGNORED_TRAIN = ("checkpoint_every", "keep_checkpoints")  # exact resume makes checkpointing invisible
RESOLVED = "resolved_config.json"
HYDRA_COPY = ".hydra.saved"  # the accepted run's .hydra, to undo Hydra's rewrite when a rerun is refused
STEP_FILES = ("metrics.jsonl", "logratios.jsonl")
UNIT_TYPES = {c.__name__: c for c in (PairExample, BinaryExample, GroupExample, TokenCompletion)}


class RunDirConflict(UserError):
    """The run dir holds a run made with another config (or one that cannot be checked)."""


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
    if UNIT_TYPES.get(kind.__name__) is kind:
        return {"__unit__": kind.__name__, **{f.name: to_json(getattr(obj, f.name)) for f in dataclasses.fields(obj)}}
    raise TypeError(f"cannot write {kind.__name__} into a checkpoint's state.json")


def from_json(obj):
    if type(obj) is list:
        return obj if all(type(v) in _PLAIN for v in obj) else [from_json(v) for v in obj]
    if type(obj) is dict:
        if "__tuple__" in obj:
            return tuple(from_json(obj["__tuple__"]))
        if "__unit__" in obj:  # only the known unit types, never an arbitrary class
            cls = UNIT_TYPES[obj["__unit__"]]
            return cls(**{k: from_json(v) for k, v in obj.items() if k != "__unit__"})
        return {k: from_json(v) for k, v in obj.items()}
    return obj


# ------------------------------------------------------------------ what a checkpoint holds
def policy_tensors(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The policy's trainable parameters: a peft LoRA policy's adapter, else every trainable parameter."""
    if hasattr(policy, "peft_config"):
        from .lora import POLICY_ADAPTER, adapter_tensors

        return adapter_tensors(policy, POLICY_ADAPTER)
    return {n: p for n, p in policy.named_parameters() if p.requires_grad}


def reference_tensors(reference, moving: bool) -> dict[str, torch.Tensor]:
    """The reference's weights when they can differ from the starting policy's (humanline sync, online
    round resets): a FrozenCopy's model or an AdapterReference's adapter. A fixed reference (plain
    offline FrozenCopy, BaseReference) is rebuilt from the starting weights, so nothing is saved."""
    if not moving:
        return {}
    from .reference import AdapterReference

    if isinstance(reference, AdapterReference):
        from .lora import REFERENCE_ADAPTER, adapter_tensors

        return adapter_tensors(reference.model, REFERENCE_ADAPTER)
    return dict(reference.model.named_parameters())


def _rng_state() -> tuple[dict, dict]:
    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return tensors, {"python": random.getstate(), "numpy": [name, keys.tolist(), pos, has_gauss, cached]}


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

    def __init__(self, run_dir: Path, every: int, keep: int = 2, dist: Dist = Dist(), console=None):
        self.root = Path(run_dir) / "checkpoints"
        self.every, self.keep, self.dist, self.console = every, max(1, keep), dist, console

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
        """Rank 0 writes; every rank waits for it (a barrier), so no rank runs ahead of a checkpoint."""
        path = None
        if self.dist.is_main:
            path = self._write(step, parts, opt, sched, timer, last, moving)
        if self.dist.enabled:
            import torch.distributed as tdist

            tdist.barrier()
        return path

    def _write(self, step, parts, opt, sched, timer, last, moving) -> Path | None:
        from safetensors.torch import save_file

        source_state = getattr(parts.source, "state_dict", None)
        if source_state is None:
            raise UserError(f"train.checkpoint_every > 0 needs a data source with state_dict() "
                            f"({type(parts.source).__name__} has none)")
        tensors = {f"policy.{k}": v for k, v in policy_tensors(parts.policy).items()}
        tensors.update({f"reference.{k}": v for k, v in reference_tensors(parts.reference, moving).items()})
        osd = opt.state_dict()
        extra = {}
        for i, st in osd["state"].items():
            for k, v in st.items():
                if torch.is_tensor(v):
                    tensors[f"optimizer.{i}.{k}"] = v
                else:
                    extra.setdefault(str(i), {})[k] = v
        rng_tensors, rng = _rng_state()
        tensors.update(rng_tensors)
        cache_keys = None
        if hasattr(parts.reference, "export"):  # the reference log-prob cache: resumed runs reuse its numbers
            cache_keys, cache = parts.reference.export()
            tensors.update({f"reference_cache.{k}": v for k, v in cache.items()})
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        from .evaluate import Side

        # the starting policy's evaluation samples (sampled, and greedy when configured; scores are None
        # under a pairwise judge): its weights are gone once training starts, so a resumed run reads them here
        baselines = {k: {"texts": v.texts, "scores": v.scores}
                     for k, v in vars(parts.evaluator or SimpleNamespace()).items() if isinstance(v, Side)}
        state = {"format": FORMAT, "step": step, "world_size": self.dist.world_size, "reference_saved": moving,
                 "optimizer": {"param_groups": osd["param_groups"], "state_extra": extra},
                 "scheduler": sched.state_dict(), "rng": rng, "source": source_state(), "timer": timer.state_dict(),
                 "last_metrics": last, "baselines": baselines, "reference_cache_keys": cache_keys}
        final = self.root / f"step_{step}"
        tmp = self.root / f".tmp-step_{step}"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            save_file(tensors, tmp / "tensors.safetensors")
            _write_synced(tmp / "state.json", json.dumps(to_json(state)))
            _fsync(tmp / "tensors.safetensors")
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _fsync(self.root)
        except OSError as e:  # a full disk must not kill the run: the previous checkpoint stays
            shutil.rmtree(tmp, ignore_errors=True)
            if self.console is not None:
                self.console.print(f"humanline: warning: checkpoint at step {step} not written ({type(e).__name__}: "
                                   f"{e}); training goes on, a rerun would resume from an earlier checkpoint",
                                   soft_wrap=True, markup=False, highlight=False)
            return None
        for old in self.steps()[:-self.keep]:
            shutil.rmtree(self.root / f"step_{old}", ignore_errors=True)
        return final

    def load(self, path: Path, parts, opt, sched, timer) -> tuple[int, dict]:
        """Restore everything `save` wrote; returns (step, the last logged train metrics)."""
        from safetensors.torch import load_file

        state = read_state(path)
        if state.get("format") != FORMAT:
            raise UserError(f"{path}: checkpoint format {state.get('format')} is not {FORMAT}")
        if state["world_size"] != self.dist.world_size:
            raise UserError(f"{path} was written by {state['world_size']} rank(s), this run has "
                            f"{self.dist.world_size}; resume=false starts over")
        tensors = load_file(path / "tensors.safetensors")
        part = lambda prefix: {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}  # noqa: E731
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
            from .evaluate import Side

            for name, side in state["baselines"].items():  # baseline, greedy_baseline
                setattr(parts.evaluator, name, Side(side["texts"], side["scores"]))
        if state.get("reference_cache_keys") is not None and hasattr(parts.reference, "restore"):
            parts.reference.restore(state["reference_cache_keys"], part("reference_cache."))
        _set_rng_state({k: v for k, v in tensors.items() if k.startswith("rng.")}, state["rng"])
        return int(state["step"]), dict(state["last_metrics"])


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


# ------------------------------------------------------------------ rerunning into a run dir
def comparable(config: dict) -> dict:
    """The resolved config minus the keys that never change results (secrets masked, as saved)."""
    out = {k: v for k, v in scrub(config).items() if k not in IGNORED}
    if isinstance(out.get("train"), dict):
        out["train"] = {k: v for k, v in out["train"].items() if k not in IGNORED_TRAIN}
    return out


def _flat(d, prefix: str = "") -> dict:
    if not isinstance(d, dict) or not d:
        return {prefix: d}
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}" if not prefix else f"{prefix}.{k}"))
    return out


_UNSET = object()


def _show(value) -> str:
    text = "<unset>" if value is _UNSET else json.dumps(value, default=str)
    return text if len(text) <= 24 else text[:21] + "..."


def config_diff(old: dict, new: dict) -> list[str]:
    """'key: old -> new' for every dotted key whose value differs (ignored keys left out), sorted."""
    a, b = _flat(comparable(old)), _flat(comparable(new))
    return [f"{k}: {_show(a.get(k, _UNSET))} -> {_show(b.get(k, _UNSET))}"
            for k in sorted(a.keys() | b.keys()) if a.get(k, _UNSET) != b.get(k, _UNSET)]


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _restore_hydra(run_dir: Path, hydra_subdir: str | None) -> None:
    """Hydra rewrote <run_dir>/.hydra before this job ran: put the accepted run's files back (mtimes too)."""
    saved = run_dir / HYDRA_COPY
    if not hydra_subdir or not saved.is_dir():
        return
    for f in saved.iterdir():
        shutil.copy2(f, run_dir / hydra_subdir / f.name)


def _conflict(run_dir: Path, config: dict, hydra_subdir: str | None) -> None:
    """Raise RunDirConflict if the run dir's saved config differs from `config` (restoring .hydra first)."""
    prev = _read_json(run_dir / RESOLVED)
    if prev is None:
        if _read_json(run_dir / "summary.json") is None:
            return
        raise RunDirConflict(f"{run_dir} holds a complete run without {RESOLVED} (made by an older humanline), so "
                             f"its config cannot be checked; resume=false starts over (moves it to previous-<n>/)")
    diff = config_diff(prev, config)
    if diff:
        _restore_hydra(run_dir, hydra_subdir)
        more = f" and {len(diff) - 3} more" if len(diff) > 3 else ""
        raise RunDirConflict(f"{run_dir} holds a run with another config ({'; '.join(diff[:3])}{more}); "
                             f"resume=false starts over (moves its outputs to previous-<n>/)")


def is_complete(run_dir: Path, config: dict, resume: bool, hydra_subdir: str | None = ".hydra") -> bool:
    """True when the run dir holds a complete run of this same config (nothing to do: Hydra's rewrite of
    .hydra is undone); RunDirConflict when it holds a run of another config; False otherwise."""
    summary = _read_json(Path(run_dir) / "summary.json")
    if not resume or not isinstance(summary, dict) or summary.get("status") != "complete":
        return False
    _conflict(Path(run_dir), config, hydra_subdir)
    _restore_hydra(Path(run_dir), hydra_subdir)
    return True


def prepare_run_dir(run_dir: Path, config: dict, resume: bool, hydra_subdir: str | None = ".hydra") -> int | None:
    """Make the run dir ready for a (new or resumed) run of `config`, once, before any rank starts.

    resume=true: None (touching nothing) if it holds this config's complete run; refuse another
    config's outputs; rewind step-indexed outputs to the last checkpoint (or clear them when there
    is none). resume=false: move the old outputs to previous-<n>/. Then save this run's resolved
    config and a copy of its .hydra. Returns the step the run continues after (0: from the start)."""
    run_dir = Path(run_dir)
    if is_complete(run_dir, config, resume, hydra_subdir):
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    step = 0
    if resume:
        _conflict(run_dir, config, hydra_subdir)
        ckpts = Checkpoints(run_dir, 0)
        for tmp in ckpts.root.glob(".tmp-step_*") if ckpts.root.is_dir() else ():
            shutil.rmtree(tmp, ignore_errors=True)  # a checkpoint the killed run did not finish
        latest = ckpts.latest()
        rounds = None
        if latest is not None:
            state = json.loads((latest / "state.json").read_text())
            step = int(state["step"])
            rounds = state["source"].get("round")
        rewind_outputs(run_dir, step, rounds)
    else:
        move_aside(run_dir, hydra_subdir)
    write_resolved(run_dir, config)
    if hydra_subdir and (run_dir / hydra_subdir).is_dir():
        shutil.rmtree(run_dir / HYDRA_COPY, ignore_errors=True)
        shutil.copytree(run_dir / hydra_subdir, run_dir / HYDRA_COPY)
    return step


def write_resolved(run_dir: Path, config: dict) -> None:
    """This run's resolved config (secret-named keys masked), what a rerun is compared with."""
    tmp = run_dir / (RESOLVED + ".tmp")
    tmp.write_text(json.dumps(scrub(config), indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, run_dir / RESOLVED)


def _keep_rows(path: Path, keep) -> None:
    """Keep the JSON lines for which keep(row) is true (a torn last line from a kill is dropped)."""
    if not path.exists():
        return
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if keep(row):
            rows.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(rows))
    os.replace(tmp, path)


def rewind_outputs(run_dir: Path, step: int, rounds: int | None) -> None:
    """Outputs as they were at the checkpoint: metrics/logratios rows up to `step`, online samples up
    to round `rounds`; what only a finished or failed run writes is removed."""
    for name in STEP_FILES:
        _keep_rows(run_dir / name, lambda row: row.get("step", 0) <= step)
    if step == 0:
        (run_dir / "samples.jsonl").unlink(missing_ok=True)
    else:
        _keep_rows(run_dir / "samples.jsonl", lambda row: rounds is not None and row.get("round", 0) <= rounds)
    for name in ("failed.json", "eval_samples.jsonl"):
        (run_dir / name).unlink(missing_ok=True)


def move_aside(run_dir: Path, hydra_subdir: str | None) -> Path | None:
    """Move every output of the previous run into previous-<n>/ (never deleted); its .hydra comes back
    from the saved copy (Hydra has already written this run's)."""
    skip = {hydra_subdir, HYDRA_COPY}
    items = [p for p in run_dir.iterdir()
             if p.name not in skip and not p.name.startswith("previous-") and p.suffix != ".log"]
    if not items:
        return None
    taken = [int(p.name.split("-", 1)[1]) for p in run_dir.glob("previous-*") if p.name.split("-", 1)[1].isdigit()]
    dest = run_dir / f"previous-{max(taken, default=0) + 1}"
    dest.mkdir()
    for p in items:
        os.replace(p, dest / p.name)
    if (run_dir / HYDRA_COPY).is_dir():
        os.replace(run_dir / HYDRA_COPY, dest / (hydra_subdir or ".hydra"))
    return dest
