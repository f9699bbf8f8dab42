"""Named regimes in the report: a run's regime as its conf/regime/ file declares it (`regime_meta`), and the
gap-closed rows of a sweep over named regimes, each humanline regime compared with the `baseline` and `target` its
regime_meta declares, matched by the name the runs saved. The offline data (`task.world.offline`) may differ from
online's, which does not read it.
"""
from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path

import pandas as pd
import yaml

from humanline_cli.report.gap_closed import gap_rows

# Keys a regime's runs may differ in from the online runs they are compared with (online ignores them).
SWEEP_IGNORE = ("task.world.offline",)


def regime_of(run_dir: Path) -> str | None:
    """The `regime=NAME` override a sweep job ran with (.hydra/overrides.yaml), if any."""
    f = run_dir / ".hydra" / "overrides.yaml"
    overrides = (yaml.safe_load(f.read_text()) or []) if f.is_file() else []
    return next((v for k, _, v in (str(o).lstrip("+").partition("=") for o in overrides) if k == "regime"), None)


def listed_regimes(sweep: Path) -> list[str]:
    """The `regime=` values a sweep's multirun.yaml lists, in order ([] without one)."""
    f = sweep / "multirun.yaml"
    sweep_cfg = (yaml.safe_load(f.read_text()) if f.is_file() else None) or {}
    params = ((sweep_cfg.get("hydra") or {}).get("sweeper") or {}).get("params") or {}
    return [x.strip() for x in str(params.get("regime", "")).split(",") if x.strip()]


def regime_meta(config: dict | None, path: Path) -> dict:
    """A run's regime_meta (name, family, baseline, target) as saved, else as its `regime=` file
    (conf/regime/NAME.yaml) declares it now, for runs saved before regimes declared it; {} for no regime."""
    meta = {k.removeprefix("regime_meta."): v for k, v in (config or {}).items() if k.startswith("regime_meta.")}
    if meta.get("name"):
        return meta
    name = regime_of(Path(path))
    f = files("conf").joinpath("regime", f"{name}.yaml")
    return (yaml.safe_load(f.read_text()) or {}).get("regime_meta") or {} if name and f.is_file() else {}


META = ["regime_name", "regime_family", "regime_baseline", "regime_target"]  # regime_meta's keys, as columns


def with_regimes(runs: pd.DataFrame) -> pd.DataFrame:
    """Labelled runs with META and `regime`: the declared regime, else the family (and variant)."""
    meta = pd.DataFrame([regime_meta(c, p) for c, p in zip(runs["config"], runs["path"])], index=runs.index,
                        dtype=object).add_prefix("regime_").reindex(columns=META).where(lambda m: m != "")
    fallback = [f"{f} ({v})" if v else f for f, v in zip(runs["family"], runs["variant"])]
    return runs.join(meta).assign(regime=meta.regime_name.where(meta.regime_name.notna(), fallback))


def regime_gap_rows(runs: pd.DataFrame, margin: float | None = None) -> pd.DataFrame:
    """gap_closed.gap_rows per humanline regime of a sweep over named regimes, against the baseline and target
    its regime_meta names, in the order multirun.yaml lists their `regime=` values, then the rest sorted; empty
    when no run has a regime."""
    named = runs[runs.regime_name.notna()]
    by = dict(list(named.groupby("regime", sort=False)))
    metas = named.drop_duplicates("regime_name", keep="last").set_index("regime_name")
    name_of = {regime_of(Path(p)) or n: n for p, n in zip(named.path, named.regime_name)}
    root = Path(os.path.commonpath([str(p) for p in runs["path"]])) if len(runs) else Path(".")
    while root != root.parent and not (root / "multirun.yaml").is_file():
        root = root.parent  # the sweep dir, where multirun.yaml lists the regimes in order
    listed = dict.fromkeys(name_of[x] for x in listed_regimes(root) if x in name_of)
    rows = []
    for name in [*listed, *sorted(set(name_of.values()) - set(listed))]:
        offline, online = metas.at[name, "regime_baseline"], metas.at[name, "regime_target"]
        if metas.at[name, "regime_family"] != "humanline" or offline not in by or online not in by:
            continue
        vs = f"{offline}, {online}"
        rows.append(gap_rows(pd.concat([by[name], by[offline], by[online]]), SWEEP_IGNORE, margin).assign(
            set=name + ("" if vs == "offline, online" else f" (vs {vs})"), regime=name, compared_with=vs))
    return pd.concat(rows, ignore_index=True) if rows else gap_rows(runs.iloc[:0])
