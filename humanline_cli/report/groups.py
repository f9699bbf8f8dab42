"""Which runs are the same experiment: runs group by their resolved config less the seed, result-neutral keys,
inactive humanline knobs and --ignore keys; the keys that vary between groups label them; comparisons pair only
groups whose configs agree outside the family-defining keys."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

import pandas as pd

# regime_meta names a run's regime (a label, conf/regime/): the keys it describes are the ones compared
DEFAULT_IGNORE = ("seed", "hydra", "wandb", "threads", "world_cache", "resume", "experiment_name", "regime_meta")
# Define the data regime / humanline family and the stale-data correction: a speedup or a paired difference compares
# groups that differ only here (correction=tis beside none and humanline, each a label within one comparison set).
FAMILY_KEYS = ("data", "humanline", "hl", "sampler", "reward", "correction")
# The table's own axes (sections, rows, columns), never repeated as extra columns.
AXIS_KEYS = ("task.name", "objective.name", "data.regime", "humanline")
NO_CONFIG = "config.yaml"  # pseudo-key telling groups without .hydra/config.yaml apart when mixed with others
INTERPOLATION = re.compile(r"\$\{(?:oc\.select:)?([A-Za-z_][\w.]*)(?=[},])")  # ${a.b} or ${oc.select:a.b,default}


def under(key: str, prefixes) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def parse_ignore(values) -> tuple[str, ...]:
    """--ignore values (repeatable, comma-separated; `train.*` means `train`) -> dotted prefixes."""
    keys = (k.strip().removesuffix(".*") for v in values or () for k in str(v).split(","))
    return tuple(dict.fromkeys(k for k in keys if k))


def comparable_config(config: dict, ignore=()) -> dict:
    """A resolved config less what never changes results, hl.* with humanline off, `ignore`, and `humanline`
    itself (absent and false both mean off; the family carries it)."""
    on = config.get("humanline") is True or config.get("correction.kind") == "humanline"  # one switch
    drop = DEFAULT_IGNORE + ("humanline",) + tuple(ignore) + (() if on else ("hl",))
    return {k: v for k, v in config.items() if not under(k, drop)}


def canon(v) -> str:
    return json.dumps(v, sort_keys=True, default=str)


def show(v) -> str:
    return v if isinstance(v, str) else canon(v)


@dataclass(frozen=True)
class Duplicate:
    """A run dir counted once: `dropped` is the same run (config and seed) as `kept`; both are run rows."""
    dropped: object
    kept: object
    same_outputs: bool  # a copy (identical summary.json and metrics.jsonl) or a rerun of the same seed

    def describe(self) -> str:
        how = "a copy: identical outputs" if self.same_outputs else "a rerun of the same seed: outputs differ"
        return f"{self.dropped.path} duplicates {self.kept.path} ({how}); counted once"


def collapse_duplicates(runs: pd.DataFrame) -> tuple[pd.DataFrame, list[Duplicate]]:
    """One run per identity (its config with the seed, else its outputs' fingerprint), so a copied run dir is
    never a second seed; the first dir (sorted) is kept."""
    runs = runs.sort_values("path", key=lambda p: p.map(str))
    ident = pd.Series([canon(["config", r.task, r.objective, r.family, canon(r.seed), comparable_config(r.config)])
                       if r.config is not None else r.fingerprint for r in runs.itertuples()], index=runs.index)
    kept = pd.Series(ident.index, index=ident.to_numpy()).groupby(level=0).first()  # identity -> the first run
    dups = [Duplicate(runs.loc[i], runs.loc[k], runs.at[i, "fingerprint"] == runs.at[k, "fingerprint"])
            for i, k in zip(ident.index, kept[ident].to_numpy()) if i != k]
    return runs[~ident.duplicated()], dups


def groups(runs: pd.DataFrame, ignore=()) -> pd.DataFrame:
    """One row per group of runs differing only by seed (or ignored keys), first-seen order: task, objective,
    family, cfg (comparable config; None without .hydra/config.yaml), raw, members (index labels)."""
    if runs.empty:
        return pd.DataFrame(columns=["task", "objective", "family", "cfg", "raw", "members"])
    cfg = [None if c is None else comparable_config(c, ignore) for c in runs["config"]]
    ident = [None if c is None else canon(sorted((k, canon(v)) for k, v in c.items())) for c in cfg]
    key = pd.Series([canon([t, o, f, i]) for t, o, f, i in zip(runs.task, runs.objective, runs.family, ident)],
                    index=runs.index)
    members = [list(g.index) for _, g in runs.groupby(key, sort=False)]
    out = runs.assign(cfg=cfg).loc[[m[0] for m in members], ["task", "objective", "family", "cfg", "raw"]]
    return out.assign(members=members).reset_index(drop=True)


def derived_from(groups_: pd.DataFrame) -> dict[str, str]:
    """key -> the one other subtree it interpolates in every group (train.batch_size: ${objective.batch_size})."""
    seen: dict[str, set] = {}
    for cfg, raw in zip(groups_.cfg, groups_.raw):
        for k in cfg or ():
            refs = {r.split(".")[0] for r in INTERPOLATION.findall(str(raw.get(k, "")))} - {k.split(".")[0]}
            seen.setdefault(k, set()).add(next(iter(refs)) if len(refs) == 1 else None)
    return {k: next(iter(s)) for k, s in seen.items() if len(s) == 1 and None not in s}


def family_defining(key: str, derived: dict) -> bool:
    return key.split(".")[0] in FAMILY_KEYS or derived.get(key) in FAMILY_KEYS


def scope(g, key: str, derived: dict):
    """Which groups a key is compared among: those that chose the same option of its subtree (name/regime/kind),
    so two objectives' defaults never show as differences. None: the key does not apply (an axis, hl.* off)."""
    if g.cfg is None or key in AXIS_KEYS or (under(key, ("hl",)) and not g.family.startswith("humanline-")):
        return None
    parts = []
    for top in (key.split(".")[0], derived.get(key)):
        if top is not None:
            sel = next((f"{top}.{s}" for s in ("name", "regime", "kind") if f"{top}.{s}" in g.cfg), None)
            parts.append((top, None if sel is None or sel == key else canon(g.cfg[sel])))
    return tuple(parts)


def hl_settings(g) -> tuple:
    """A group's hl.* settings, what tells two humanline groups of one comparison set apart."""
    return tuple(sorted((k, str(v)) for k, v in (g.cfg or {}).items() if k.startswith("hl.")))


def plain(cfgs) -> list[bool]:
    """Of groups that share one data regime (their comparable configs, None without one), which are its plain one,
    the baseline its comparisons read: where they differ in the stale-data correction (correction=tis beside
    none), those with correction=none; else all of them."""
    kinds = [(c or {}).get("correction.kind", "none") for c in cfgs]
    return [k == "none" for k in kinds] if len(set(kinds)) > 1 else [True] * len(kinds)


def differing_keys(signatures: list) -> set:
    dicts = [dict(s) for s in signatures if s is not None]
    keys = {k for d in dicts for k in d}
    return {k for k in keys if len({d.get(k) for d in dicts}) > 1}


def comparison_sets(runs: pd.DataFrame, ignore=()) -> list[tuple[str, str, str, pd.DataFrame]]:
    """(task, objective, label, groups) per set of groups (label's rows) agreeing outside the family-defining
    keys; the label names the keys that tell the set apart from the objective's other sets."""
    gs = label(runs, ignore)[1]
    out = []
    for (task, _), members in gs.groupby([gs.task, gs.sig.map(lambda s: str(s[1:]))], sort=True):
        _, objective, sig = members.sig.iloc[0]
        differing = differing_keys({s for t, o, s in gs.sig if (t, o) == (task, objective)})
        out.append((task, objective, ", ".join(f"{k}={v}" for k, v in (sig or ()) if k in differing), members))
    return out


def varying_keys(groups_: pd.DataFrame, derived: dict) -> dict[str, set]:
    """key -> the scopes in which it takes more than one value (absent counts as a value)."""
    rows = list(groups_.itertuples())
    seen = pd.DataFrame([(k, sc, canon(g.cfg[k]) if k in g.cfg else None)
                         for k in sorted({k for g in rows if g.cfg for k in g.cfg})
                         for g in rows if (sc := scope(g, k, derived)) is not None], columns=["key", "scope", "value"])
    many = seen.groupby(["key", seen.scope.map(str)], sort=False).filter(lambda g: g.value.nunique(dropna=False) > 1)
    out = many.groupby("key", sort=False).scope.agg(set).to_dict()
    if any(g.cfg is None for g in rows) and any(g.cfg is not None for g in rows):
        out[NO_CONFIG] = {None}
    return out


GROUP_COLUMNS = ("task", "objective", "family", "cfg", "raw", "members", "row_keys", "label", "variant", "sig")


def label(runs: pd.DataFrame, ignore=()) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Complete runs -> (runs with `group`, `variant`; groups with GROUP_COLUMNS and a column per varying key, the
    text of the group's value where it tells the group apart). Per task the varying keys outside the
    family-defining subtrees make a table's rows (`row_keys`), the others label a cell (`label`); `variant` is every
    label; `sig` is (task, objective, signature)."""
    gs = groups(runs, ignore)
    parts = [_label_task(tg) for _, tg in gs.groupby("task", sort=True)]
    gs = pd.concat(parts).sort_index() if parts else gs.assign(row_keys=None, label="", variant="", sig=None)
    member = gs.members.explode()
    at = pd.Series(member.index, index=member.to_numpy(), dtype=int)  # run -> its group
    return runs.assign(group=at, variant=pd.Series(gs.variant[at].to_numpy(), index=at.index, dtype=object)), gs


def _label_task(tg: pd.DataFrame) -> pd.DataFrame:
    derived = derived_from(tg)
    varying = varying_keys(tg, derived)
    row_keys = tuple(sorted(k for k in varying if not family_defining(k, derived)))
    # the varying keys each group has a distinguishing value for, as text
    labels = [({NO_CONFIG: "missing"} if NO_CONFIG in varying else {}) if g.cfg is None else {
        k: (show(g.cfg[k]) if k in g.cfg else "unset") for k, scs in varying.items()
        if k != NO_CONFIG and scope(g, k, derived) in scs} for g in tg.itertuples()]
    # what must match for a speedup or a comparison: all but the family-defining keys
    sig = [(g.task, g.objective, None if g.cfg is None else tuple(sorted(
        (k, canon(v)) for k, v in g.cfg.items() if not family_defining(k, derived)))) for g in tg.itertuples()]
    out = tg.assign(row_keys=[row_keys] * len(tg), sig=sig,
                    label=[", ".join(f"{k}={v}" for k, v in d.items() if k not in row_keys) for d in labels],
                    variant=[", ".join(f"{k}={v}" for k, v in d.items()) for d in labels])
    return pd.concat([out, pd.DataFrame(labels, index=tg.index, dtype=object)], axis=1)
