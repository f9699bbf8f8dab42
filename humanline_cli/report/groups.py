"""How `humanline report` decides which runs are the same experiment: runs are grouped by their full
resolved config minus the seed, result-neutral keys, inactive humanline knobs and the user's --ignore
keys; the keys that vary between groups label them; speedups compare only groups whose configs agree
outside the family-defining keys. Consumes report.Run objects (duck-typed: .config, .task, ...)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

# regime_meta names a run's regime (a label, conf/regime/): the keys it describes are the ones compared
DEFAULT_IGNORE = ("seed", "hydra", "wandb", "threads", "world_cache", "resume", "experiment_name", "regime_meta")
# Define the data regime / humanline family: a speedup compares groups that differ only here.
FAMILY_KEYS = ("data", "humanline", "hl", "sampler", "reward")
# The table's own axes (sections, rows, columns), never repeated as extra columns.
AXIS_KEYS = ("task.name", "objective.name", "data.regime", "humanline")
NO_CONFIG = "config.yaml"  # pseudo-key telling groups without .hydra/config.yaml apart when mixed with others
_INTERP = re.compile(r"\$\{(?:oc\.select:)?([A-Za-z_][\w.]*)(?=[},])")  # ${a.b} or ${oc.select:a.b,default}


def _under(key: str, prefixes) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def parse_ignore(values) -> tuple[str, ...]:
    """--ignore values (repeatable, comma-separated; `train.*` means `train`) -> dotted prefixes."""
    keys = (k.strip().removesuffix(".*") for v in values or () for k in str(v).split(","))
    return tuple(dict.fromkeys(k for k in keys if k))


def comparable_config(run, ignore=()) -> dict:
    """The run's resolved config minus what never changes results, hl.* when humanline is off, and `ignore`.
    `humanline` itself goes too: absent and `false` both mean off, and the family (a group's axis) carries it."""
    drop = DEFAULT_IGNORE + ("humanline",) + tuple(ignore) + (() if run.config.get("humanline") is True else ("hl",))
    return {k: v for k, v in run.config.items() if not _under(k, drop)}


def _canon(v) -> str:
    return json.dumps(v, sort_keys=True, default=str)


def show(v) -> str:
    return v if isinstance(v, str) else _canon(v)


@dataclass
class Group:
    """Complete runs that differ only by seed (or by ignored keys): the unit of n, mean, sd and CI."""
    task: str
    objective: str
    family: str
    runs: list
    cfg: dict | None  # comparable_config of its runs; None for run dirs without .hydra/config.yaml
    raw: dict


def group_runs(runs: list, ignore=()) -> list[Group]:
    groups: dict[tuple, Group] = {}
    for r in runs:
        cfg = comparable_config(r, ignore) if r.config is not None else None
        ident = None if cfg is None else tuple(sorted((k, _canon(v)) for k, v in cfg.items()))
        g = groups.setdefault((r.task, r.objective, r.family, ident), Group(r.task, r.objective, r.family, [], cfg, r.raw))
        g.runs.append(r)
    return list(groups.values())


@dataclass(frozen=True)
class Duplicate:
    """A run dir counted once: `dropped` is the same run as `kept` (same config and seed)."""
    dropped: object
    kept: object
    same_outputs: bool  # a copy (identical summary.json and metrics.jsonl) or a rerun of the same seed

    def describe(self) -> str:
        how = "a copy: identical outputs" if self.same_outputs else "a rerun of the same seed: outputs differ"
        return f"{self.dropped.path} duplicates {self.kept.path} ({how}); counted once"


def collapse_duplicates(runs: list) -> tuple[list, list[Duplicate]]:
    """One run per identity, so a copied run dir (to re-judge it, say) is never a second seed.

    Identity: the resolved config (less the keys that never change results, DEFAULT_IGNORE, but with the
    seed) when the run has one, else the fingerprint of its outputs. The first dir (sorted) is kept."""
    kept: dict[tuple, object] = {}
    out, dups = [], []
    for r in sorted(runs, key=lambda r: str(r.path)):
        if r.config is not None:
            ident = ("config", r.task, r.objective, r.family, _canon(r.seed), _canon(comparable_config(r)))
        else:
            ident = ("outputs", r.fingerprint)
        first = kept.setdefault(ident, r)
        if first is r:
            out.append(r)
        else:
            dups.append(Duplicate(r, first, r.fingerprint == first.fingerprint))
    return out, dups


def derived_from(groups: list[Group]) -> dict[str, str]:
    """key -> the one other subtree its value interpolates in every group that has the key
    (train.batch_size: ${objective.batch_size}). A key that is a literal anywhere is its own."""
    seen: dict[str, set] = {}
    for g in groups:
        for k in g.cfg or ():
            refs = {r.split(".")[0] for r in _INTERP.findall(str(g.raw.get(k, "")))} - {k.split(".")[0]}
            seen.setdefault(k, set()).add(next(iter(refs)) if len(refs) == 1 else None)
    return {k: next(iter(s)) for k, s in seen.items() if len(s) == 1 and None not in s}


def family_defining(key: str, derived: dict) -> bool:
    return key.split(".")[0] in FAMILY_KEYS or derived.get(key) in FAMILY_KEYS


def scope(g: Group, key: str, derived: dict):
    """Which groups a key is compared with: a config group's keys (model.*, data.*, objective.*, and keys that only
    interpolate one) only between groups that chose the same option (its name/regime/kind), so the defaults of
    dpo vs grpo or of offline vs online data never show as differences. None: the key does not apply here
    (an axis of the table, or hl.* with humanline off)."""
    if g.cfg is None or key in AXIS_KEYS or (_under(key, ("hl",)) and not g.family.startswith("humanline-")):
        return None
    parts = []
    for top in (key.split(".")[0], derived.get(key)):
        if top is not None:
            sel = next((f"{top}.{s}" for s in ("name", "regime", "kind") if f"{top}.{s}" in g.cfg), None)
            parts.append((top, None if sel is None or sel == key else _canon(g.cfg[sel])))
    return tuple(parts)


def signature(g: Group, derived: dict) -> tuple:
    """What must match for a speedup: everything but the family-defining keys."""
    if g.cfg is None:
        return (g.task, g.objective, None)
    return (g.task, g.objective, tuple(sorted((k, _canon(v)) for k, v in g.cfg.items()
                                              if not family_defining(k, derived))))


def varying_keys(groups: list[Group], derived: dict) -> dict[str, set]:
    """key -> the scopes in which it takes more than one value (an absent key counts as a value)."""
    seen: dict[str, dict] = {}
    for k in sorted({k for g in groups if g.cfg for k in g.cfg}):
        for g in groups:
            sc = scope(g, k, derived)
            if sc is not None:
                seen.setdefault(k, {}).setdefault(sc, set()).add(_canon(g.cfg[k]) if k in g.cfg else None)
    out = {k: {sc for sc, vals in by.items() if len(vals) > 1} for k, by in seen.items()}
    out = {k: scs for k, scs in out.items() if scs}
    if any(g.cfg is None for g in groups) and any(g.cfg is not None for g in groups):
        out[NO_CONFIG] = {None}
    return out


def group_labels(g: Group, varying: dict, derived: dict) -> dict:
    """The varying keys this group has a distinguishing value for, as display strings."""
    if g.cfg is None:
        return {NO_CONFIG: "missing"} if NO_CONFIG in varying else {}
    return {k: (show(g.cfg[k]) if k in g.cfg else "unset") for k, scs in varying.items()
            if k != NO_CONFIG and scope(g, k, derived) in scs}


# ---------------------------------------------------------------- aggregation
