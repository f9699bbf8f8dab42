"""Rerunning a command into a run dir that already has outputs (`is_complete`, `prepare_run_dir`, called by
the CLI before any rank starts): the saved `resolved_config.json` is compared with the new config, minus keys
that never change results (IGNORED). Same config and complete: nothing to do. Same config, incomplete: resume
from the newest intact checkpoint (damaged ones, whose checksums fail, are moved to damaged-step_<N>/ and
named in one line; step-indexed outputs rewound to the one used) or start over. Another config: refused
(RunDirConflict) unless `resume=false`, which moves the old outputs to `previous-<n>/`. The checkpoint a resume
continues is also checked against the config it records itself (`run_record`), so a deleted or corrupt
resolved_config.json never lets a run continue under another config; with neither readable, it is refused.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path

from omegaconf import OmegaConf

from humanline_cli.atomic import write_json_atomic, write_text_atomic
from humanline_cli.config import typed
from humanline_cli.errors import RunDirConflict, UserError
from humanline_cli.train.checkpoint import Checkpoints, verify
from humanline_cli.train.lock import LOCK
from humanline_cli.train.tracking import scrub
from humanline_cli.world.defaults import deep_merge

# keys that never change results: a rerun that differs only in these resumes
IGNORED = ("resume", "threads", "wandb", "world_cache", "hydra")
IGNORED_TRAIN = ("checkpoint_every", "keep_checkpoints")  # exact resume makes checkpointing invisible
RESOLVED = "resolved_config.json"
STEP_FILES = ("metrics.jsonl", "logratios.jsonl")


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
    """'key: old -> new' for every dotted key whose value differs (ignored keys left out), sorted. A key one side
    lacks counts at its schema default: a run saved before the key existed ran as its default runs."""
    a, b = _flat(comparable(with_defaults(old))), _flat(comparable(with_defaults(new)))
    return [f"{k}: {_show(a.get(k, _UNSET))} -> {_show(b.get(k, _UNSET))}"
            for k in sorted(a.keys() | b.keys()) if a.get(k, _UNSET) != b.get(k, _UNSET)]


def new_keys(old: dict, new: dict) -> list[str]:
    """The dotted keys `new` has and the saved `old` lacks (ignored keys left out), sorted."""
    a, b = _flat(comparable(old)), _flat(comparable(new))
    return sorted(k for k in b.keys() - a.keys() if not any(o.startswith(k + ".") for o in a))


def with_defaults(config: dict) -> dict:
    """The config with each schema key it lacks at the default of its group's schema; as it is where it no longer
    types (a group or an option since removed), so that every difference still shows."""
    try:
        groups = typed(config)
    except UserError:
        return config
    full = {f.name: OmegaConf.to_container(OmegaConf.structured(getattr(groups, f.name)), enum_to_str=True)
            for f in dataclasses.fields(groups)}
    root = full.pop("root")
    full.update({k: v for k, v in root.items() if k not in full})
    return deep_merge(full, config)


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _conflict(run_dir: Path, config: dict, say=None) -> bool:
    """Raise RunDirConflict if the run dir's saved config differs from `config`; `say` names the keys the saved
    config lacks and the values they take. False when there is no readable saved config to check (the checkpoint a
    resume continues is then checked against its own record alone: _check_checkpoint)."""
    prev = _read_json(run_dir / RESOLVED)
    if not isinstance(prev, dict):
        if _read_json(run_dir / "summary.json") is None:
            return False
        raise RunDirConflict(f"{run_dir} holds a complete run without a readable {RESOLVED}, so its config cannot "
                             f"be checked; resume=false starts over (moves it to previous-<n>/)")
    _refuse_diff(run_dir, prev, config)
    added = new_keys(prev, config)
    if added and say is not None:
        full = _flat(comparable(with_defaults(config)))
        said = ", ".join(f"{k}={_show(full.get(k, _UNSET))}" for k in added)
        say(f"{run_dir} holds a run made before {', '.join(added)} existed: resuming it with today's default(s) "
            f"({said}), which may differ from what the older code did")
    return True


def _refuse_diff(run_dir: Path, prev: dict, config: dict, what: str = "a run") -> None:
    diff = config_diff(prev, config)
    if diff:
        more = f" and {len(diff) - 3} more" if len(diff) > 3 else ""
        raise RunDirConflict(f"{run_dir} holds {what} with another config ({'; '.join(diff[:3])}{more}); "
                             f"resume=false starts over (moves its outputs to previous-<n>/)")


def run_record(config: dict, micro_batch_size: int) -> dict:
    """What a checkpoint records of the run that wrote it (checkpoint.Checkpoints `record`): the comparable config
    (secrets masked) and the micro-batch it trained with, so that a resume checks the config it continues and
    splits every step the same way, whatever happened to resolved_config.json or the host's free memory."""
    auto = (config.get("train") or {}).get("micro_batch_size") in ("auto", None)
    return {"config": comparable(config), "micro_batch_size": int(micro_batch_size), "micro_auto": auto}


def recorded_config(path: Path | None) -> dict | None:
    """The comparable config the checkpoint at `path` recorded (None: none recorded, or no checkpoint)."""
    run = _checkpoint_run(path)
    return run.get("config") if isinstance(run.get("config"), dict) else None


def recorded_micro_batch(path: Path | None) -> int | None:
    """The micro-batch train.micro_batch_size=auto chose for the run whose checkpoint is at `path` (None: set by
    hand, not recorded, or no checkpoint)."""
    run = _checkpoint_run(path)
    micro = run.get("micro_batch_size")
    return micro if run.get("micro_auto") and isinstance(micro, int) and micro > 0 else None


def _checkpoint_run(path: Path | None) -> dict:
    if path is None:
        return {}
    state = _read_json(Path(path) / "state.json")
    run = state.get("run") if isinstance(state, dict) else None
    return run if isinstance(run, dict) else {}


def is_complete(run_dir: Path, config: dict, resume: bool) -> bool:
    """True when the run dir holds a complete run of this same config (nothing to do); RunDirConflict when it
    holds a run of another config; False otherwise."""
    summary = _read_json(Path(run_dir) / "summary.json")
    if not resume or not isinstance(summary, dict) or summary.get("status") != "complete":
        return False
    _conflict(Path(run_dir), config)
    return True


def _warn(msg: str) -> None:
    print(f"humanline: warning: {msg}", file=sys.stderr)


def newest_intact(ckpts: Checkpoints, say=_warn) -> Path | None:
    """The newest checkpoint whose files match their checksums. Damaged newer ones are moved to
    `checkpoints/damaged-step_<N>/` (kept for inspection, never loaded again) and named in one line
    with the reason; with none intact, the line says the run starts over."""
    skipped = []
    for step in reversed(ckpts.steps()):
        path = ckpts.root / f"step_{step}"
        damage = verify(path)
        if damage is None:
            if skipped:
                say(f"checkpoint(s) skipped as damaged: {'; '.join(skipped)}; resuming from {path.name} instead "
                    f"(the damaged ones are kept as checkpoints/damaged-step_<N>)")
            return path
        skipped.append(f"{path.name}: {damage}")
        aside = ckpts.root / f"damaged-{path.name}"
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(path, aside)
    if skipped:
        say(f"no intact checkpoint in {ckpts.root} ({'; '.join(skipped)}); starting over from step 0 "
            f"(the damaged ones are kept as checkpoints/damaged-step_<N>)")
    return None


def prepare_run_dir(run_dir: Path, config: dict, resume: bool, say=_warn) -> int | None:
    """Make the run dir ready for a (new or resumed) run of `config`, once, before any rank starts.

    resume=true: None (touching nothing) if it holds this config's complete run; refuse another
    config's outputs; rewind step-indexed outputs to the last checkpoint (or clear them when there
    is none). resume=false: move the old outputs to previous-<n>/. Then save this run's resolved
    config. Returns the step the run continues after (0: from the start)."""
    run_dir = Path(run_dir)
    if is_complete(run_dir, config, resume):
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    step = 0
    if resume and _failed_another_config_no_checkpoint(run_dir, config):
        # nothing of it can be resumed (a data error fixed by a changed key, say): refusing would only make
        # the user type resume=false; its outputs are kept aside all the same
        dest = move_aside(run_dir)
        say(f"{run_dir} held a failed run of another config with no checkpoint: starting over "
            f"(its outputs moved to {dest.name}/)")  # failed.json was there: dest is never None
    elif resume:
        checked = _conflict(run_dir, config, say)
        ckpts = Checkpoints(run_dir, 0)
        for tmp in ckpts.root.glob(".tmp-step_*") if ckpts.root.is_dir() else ():
            shutil.rmtree(tmp, ignore_errors=True)  # a checkpoint the killed run did not finish
        latest = newest_intact(ckpts, say)
        rounds = None
        if latest is not None:
            _check_checkpoint(run_dir, latest, config, checked, say)
            state = json.loads((latest / "state.json").read_text())
            step = int(state["step"])
            rounds = state["source"].get("round")
        rewind_outputs(run_dir, step, rounds)
    else:
        move_aside(run_dir)
    write_json_atomic(run_dir / RESOLVED, scrub(config))
    return step


def _check_checkpoint(run_dir: Path, latest: Path, config: dict, checked: bool, say) -> None:
    """The checkpoint to resume from was written under this config (its own record, whatever happened to
    resolved_config.json). One written by an older humanline records none: resolved_config.json must have been
    checked (`checked`), else the resume is refused naming the file."""
    saved = recorded_config(latest)
    path = run_dir / RESOLVED
    if saved is None and not checked:
        raise RunDirConflict(f"{path} {'cannot be read' if path.exists() else 'is missing'} and {latest} records no "
                             f"config, so the run's config cannot be checked before resuming; resume=false starts "
                             f"over (moves its outputs to previous-<n>/)")
    if saved is not None:
        _refuse_diff(run_dir, saved, config, f"a checkpoint ({latest.relative_to(run_dir)}) written")
    if not checked:
        say(f"{path} {'cannot be read' if path.exists() else 'is missing'}: the config is checked against "
            f"{latest.relative_to(run_dir)}'s own record instead")


def _failed_another_config_no_checkpoint(run_dir: Path, config: dict) -> bool:
    """The run dir holds a failed run (failed.json) of another config that left no checkpoint."""
    prev = _read_json(run_dir / RESOLVED)
    return ((run_dir / "failed.json").is_file() and prev is not None and not Checkpoints(run_dir, 0).steps()
            and bool(config_diff(prev, config)))


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
    write_text_atomic(path, "".join(rows))


def rewind_outputs(run_dir: Path, step: int, rounds: int | None) -> None:
    """Outputs as they were at the checkpoint: metrics/logratios rows up to `step`, online samples up
    to round `rounds`; what only a finished or failed run writes is removed."""
    for name in STEP_FILES:
        _keep_rows(run_dir / name, lambda row: row.get("step", 0) <= step)
    if step == 0:
        (run_dir / "samples.jsonl").unlink(missing_ok=True)
    else:
        _keep_rows(run_dir / "samples.jsonl", lambda row: rounds is not None and row.get("round", 0) <= rounds)
    for name in ("failed.json", "eval_samples.jsonl", "eval_samples_greedy.jsonl"):
        (run_dir / name).unlink(missing_ok=True)


def move_aside(run_dir: Path) -> Path | None:
    """Move every output of the previous run, its .hydra record included, into previous-<n>/ (never deleted);
    the job writes its own record after this."""
    skip = {LOCK}  # the lock stays: this job holds it
    items = [p for p in run_dir.iterdir()
             if p.name not in skip and not p.name.startswith("previous-") and p.suffix != ".log"]
    if not items:
        return None
    taken = [int(p.name.split("-", 1)[1]) for p in run_dir.glob("previous-*") if p.name.split("-", 1)[1].isdigit()]
    dest = run_dir / f"previous-{max(taken, default=0) + 1}"
    dest.mkdir()
    for p in items:
        os.replace(p, dest / p.name)
    return dest
