"""The regime map: gap closed by humanline-offline across several studies, one figure and one table.

Studies are `humanline report` dirs (LABEL=DIR), or one sweep over named regimes (`--sweep DIR`, conf/regime/)
where each humanline regime is compared with the `baseline` and `target` its regime_meta declares, matched by the
name the runs saved. The offline data (`task.world.offline`) may differ from online's, which does not read it.

    python -m humanline_cli.report.regime_map --sweep runs/experiments/laptop_regimes --out map.png
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pandas as pd

from humanline_cli.report.frame import load, md_table, write_csv
from humanline_cli.report.gap_closed import DIGITS, GAP_HEAD, gap_cells, gap_frame, gap_rows, plot
from humanline_cli.report.groups import collapse_duplicates, label


def load_studies(studies: list[tuple[str, Path]]) -> pd.DataFrame:
    frames = []
    for name, path in studies:
        f = path / "gap_closed.csv" if path.is_dir() else path
        if not f.is_file():
            raise FileNotFoundError(f"{f}: no gap_closed.csv (run `humanline report {path}` first)")
        frames.append(pd.read_csv(f, dtype=str, keep_default_na=False).assign(regime=name))
    return pd.concat(frames, ignore_index=True)


# Keys a regime's runs may differ in from the online runs they are compared with (online ignores them).
SWEEP_IGNORE = ("task.world.offline",)


def regime_of(run_dir: Path) -> str | None:
    """The `regime=NAME` override a sweep job ran with (.hydra/overrides.yaml), if any."""
    import yaml

    f = run_dir / ".hydra" / "overrides.yaml"
    overrides = (yaml.safe_load(f.read_text()) or []) if f.is_file() else []
    return next((v for k, _, v in (str(o).lstrip("+").partition("=") for o in overrides) if k == "regime"), None)


def regime_meta(config: dict | None, path: Path) -> dict:
    """A run's regime_meta (name, family, baseline, target) as saved, else as its `regime=` file
    (conf/regime/NAME.yaml) declares it now, for runs saved before regimes declared it; {} for no regime."""
    from importlib.resources import files

    import yaml

    meta = {k.removeprefix("regime_meta."): v for k, v in (config or {}).items() if k.startswith("regime_meta.")}
    if meta.get("name"):
        return meta
    name = regime_of(Path(path))
    f = files("conf").joinpath("regime", f"{name}.yaml")
    return (yaml.safe_load(f.read_text()) or {}).get("regime_meta") or {} if name and f.is_file() else {}


def with_regimes(runs: pd.DataFrame) -> pd.DataFrame:
    """Labelled runs with `regime_meta` and `regime`: the declared regime, else the family (and variant)."""
    meta = [regime_meta(c, p) for c, p in zip(runs["config"], runs["path"])]
    regime = [m.get("name") or (f"{f} ({v})" if v else f) for m, f, v in zip(meta, runs["family"], runs["variant"])]
    return runs.assign(regime_meta=meta, regime=regime)


def regime_gap_rows(runs: pd.DataFrame) -> pd.DataFrame:
    """gap_closed.gap_rows per humanline regime of a sweep over named regimes, against the baseline and target
    its regime_meta names, in the order multirun.yaml lists their `regime=` values, then the rest sorted; empty
    when no run has a regime."""
    import yaml

    named = runs[[bool(m.get("name")) for m in runs["regime_meta"]]] if len(runs) else runs
    by = {name: rs for name, rs in named.groupby("regime", sort=False)}
    metas = {m["name"]: m for m in named["regime_meta"]}
    name_of = {regime_of(Path(p)) or m["name"]: m["name"] for p, m in zip(named["path"], named["regime_meta"])}
    root = Path(os.path.commonpath([str(p) for p in runs["path"]])) if len(runs) else Path(".")
    while root != root.parent and not (root / "multirun.yaml").is_file():
        root = root.parent  # the sweep dir, where multirun.yaml lists the regimes in order
    sweep = yaml.safe_load((root / "multirun.yaml").read_text()) if (root / "multirun.yaml").is_file() else None
    params = ((sweep or {}).get("hydra") or {}).get("sweeper", {}).get("params") or {}
    listed = dict.fromkeys(name_of[x.strip()] for x in str(params.get("regime", "")).split(",") if x.strip() in name_of)
    rows = []
    for name in [*listed, *sorted(set(name_of.values()) - set(listed))]:
        meta = metas[name]
        offline, online = meta.get("baseline"), meta.get("target")
        if meta.get("family") != "humanline" or offline not in by or online not in by:
            continue
        vs = f"{offline}, {online}"
        rows.append(gap_rows(pd.concat([by[name], by[offline], by[online]]), ignore=SWEEP_IGNORE).assign(
            set=name + ("" if vs == "offline, online" else f" (vs {vs})"), regime=name, compared_with=vs))
    return pd.concat(rows, ignore_index=True) if rows else gap_rows(runs.iloc[:0])


def sweep_rows(root: Path) -> pd.DataFrame:
    """Gap-closed rows (`regime`, `compared_with`, then gap_closed.csv's columns) of one regime sweep."""
    runs = load(root)
    complete = collapse_duplicates(runs[runs.status == "complete"])[0] if len(runs) else runs  # a copy is no seed
    rows = regime_gap_rows(with_regimes(label(complete)[0])) if len(complete) else gap_rows(complete)
    return pd.concat([rows[["regime", "compared_with"]], gap_frame(rows)], axis=1)


def markdown(rows) -> list[str]:
    rows = rows.to_dict("records") if isinstance(rows, pd.DataFrame) else rows
    return md_table(["regime", "objective", *GAP_HEAD, "speedup (equal steps)", "at equal quality",
                     "online sampling (bound)"],
                    [(r["regime"] + (f" (vs {v})" if (v := r.get("compared_with")) and v != "offline, online" else ""),
                      r["objective"], *gap_cells(r)) for r in rows])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m humanline_cli.report.regime_map", description=__doc__.split("\n\n")[0])
    p.add_argument("studies", nargs="*", help="LABEL=DIR: a regime's label and its `humanline report` dir")
    p.add_argument("--sweep", help="one sweep over named regimes (regime=...), e.g. runs/experiments/laptop_regimes")
    p.add_argument("--out", default="regime_map.png", help="the PNG to write (and, with --sweep, a CSV next to it)")
    a = p.parse_args(argv)
    out = Path(a.out)
    try:
        if a.sweep:
            if not Path(a.sweep).is_dir():
                raise ValueError(f"{Path(a.sweep)}: no such directory")
            rows = sweep_rows(Path(a.sweep))
            if rows.empty:
                raise ValueError(f"{Path(a.sweep)}: no humanline-offline regime with its offline and online runs complete")
        elif not a.studies:
            raise ValueError("give LABEL=DIR studies or --sweep DIR")
        else:
            bad = [s for s in a.studies if "=" not in s]
            if bad:
                raise ValueError(f"{bad[0]!r} is not LABEL=DIR")
            rows = load_studies([(lab, Path(d)) for lab, _, d in (s.partition("=") for s in a.studies)])
    except (ValueError, FileNotFoundError) as e:
        print(f"regime_map: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(markdown(rows)))
    plot(rows, out, regimes=True)
    if a.sweep:  # a sweep's rows are new: written beside the figure
        write_csv(rows, out.with_suffix(".csv"), DIGITS)
    print(f"wrote {out}" + (f" and {out.with_suffix('.csv')}" if a.sweep else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
