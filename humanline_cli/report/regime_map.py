"""The regime map: gap closed by humanline-offline across several studies, one figure and one table.

Each study is a `humanline report` output dir (its gap_closed.csv); a label names the regime:

    python -m humanline_cli.report.regime_map --out map.png "pairs (rule)=runs/pairs" "groups of 8=runs/g8" ...

or one sweep over named regimes (`regime=...`, conf/regime/; `experiment=laptop_regimes`):

    python -m humanline_cli.report.regime_map --sweep runs/experiments/laptop_regimes --out map.png

where each humanline regime is compared with the two regimes its `regime_meta` declares (conf/regime/*.yaml:
`baseline`, the plain regime on the same data, offline or stale rounds; `target`, the online one), matched by
the `regime_meta.name` the runs saved, never by a file name. The offline data (`task.world.offline`) may
differ from online's, which does not read it.

Prints a markdown table (regime, objective, offline / online / humanline-offline, gap closed with its
interval, seeds, speedups) and writes a bar chart of gap closed per regime and objective (PNG).
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import textwrap
from pathlib import Path


def load(studies: list[tuple[str, Path]]) -> list[dict]:
    rows = []
    for label, path in studies:
        f = path / "gap_closed.csv" if path.is_dir() else path
        if not f.is_file():
            raise FileNotFoundError(f"{f}: no gap_closed.csv (run `humanline report {path}` first)")
        with open(f, newline="") as fh:
            rows += [{**r, "regime": label} for r in csv.DictReader(fh)]
    return rows


# Keys a regime's runs may differ in from the online runs they are compared with (online ignores them).
SWEEP_IGNORE = ("task.world.offline",)


def regime_of(run_dir: Path) -> str | None:
    """The `regime=NAME` override a sweep job ran with (.hydra/overrides.yaml), if any."""
    import yaml

    f = run_dir / ".hydra" / "overrides.yaml"
    if not f.is_file():
        return None
    for o in yaml.safe_load(f.read_text()) or []:
        key, _, value = str(o).lstrip("+").partition("=")
        if key == "regime":
            return value
    return None


def _declared(name: str) -> dict:
    """conf/regime/NAME.yaml's regime_meta: for runs saved before regimes declared it."""
    from importlib.resources import files

    import yaml

    f = files("conf").joinpath("regime", f"{name}.yaml")
    return (yaml.safe_load(f.read_text()) or {}).get("regime_meta") or {} if f.is_file() else {}


def regime_meta(run) -> dict:
    """The run's regime as it declared it (name, family, baseline, target): its saved config's regime_meta,
    else (a run saved before regimes declared it) the one its `regime=` file declares now; {} for no regime."""
    config = run.config or {}
    meta = {k.removeprefix("regime_meta."): v for k, v in config.items() if k.startswith("regime_meta.")}
    if meta.get("name"):
        return meta
    name = regime_of(Path(run.path))
    return _declared(name) if name else {}


def regime_label(run) -> str:
    """What names a run's regime in per-regime tables and plots: its declared regime where it has one, else
    its report family (and the variant that tells its config group apart)."""
    return regime_meta(run).get("name") or (f"{run.family} ({run.variant})" if run.variant else run.family)


def _sweep_order(root: Path, name_of: dict[str, str]) -> list[str]:
    """Regime names in the order the sweep lists their `regime=` files (multirun.yaml), then any others
    alphabetically. `name_of`: the `regime=` value -> the regime's declared name."""
    import yaml

    listed: list[str] = []
    f = root / "multirun.yaml"
    if f.is_file():
        params = ((yaml.safe_load(f.read_text()) or {}).get("hydra") or {}).get("sweeper", {}).get("params") or {}
        listed = [x.strip() for x in str(params.get("regime", "")).split(",") if x.strip()]
    first = list(dict.fromkeys(name_of[x] for x in listed if x in name_of))
    return first + sorted(set(name_of.values()) - set(first))


def regime_gap_rows(runs: list) -> list:
    """gap_closed.GapRow per humanline regime and objective, from complete runs of a sweep over named regimes:
    each humanline regime against the baseline and target its regime_meta names, where the sweep has both.
    The row's label is the regime (and its baselines when they are not the plain ones). Empty when no run
    has a regime."""
    from humanline_cli.report.gap_closed import gap_rows

    by: dict[str, list] = {}
    metas: dict[str, dict] = {}
    name_of: dict[str, str] = {}
    for run in runs:
        meta = regime_meta(run)
        if meta.get("name") and run.status == "complete":
            by.setdefault(meta["name"], []).append(run)
            metas[meta["name"]] = meta
            name_of[regime_of(Path(run.path)) or meta["name"]] = meta["name"]
    root = Path(os.path.commonpath([str(r.path) for r in runs])) if runs else Path(".")
    while root != root.parent and not (root / "multirun.yaml").is_file():
        root = root.parent  # the sweep dir, where multirun.yaml lists the regimes in order
    rows = []
    for name in _sweep_order(root, name_of):
        meta = metas[name]
        offline, online = meta.get("baseline"), meta.get("target")
        if meta.get("family") != "humanline" or offline not in by or online not in by:
            continue
        for g in gap_rows(by[name] + by[offline] + by[online], ignore=SWEEP_IGNORE):
            vs = f"{offline}, {online}"
            g.label = name + ("" if vs == "offline, online" else f" (vs {vs})")
            g.regime, g.compared_with = name, vs
            rows.append(g)
    return rows


def sweep_rows(root: Path) -> list[dict]:
    """Gap-closed rows (gap_closed.csv's columns plus `regime`, `compared_with`) of one regime sweep."""
    from humanline_cli.report.gap_closed import csv_row
    from humanline_cli.report.groups import collapse_duplicates
    from humanline_cli.report.runs import find_run_dirs, load_run

    runs = [load_run(d) for d in find_run_dirs(root)]
    rows = regime_gap_rows(collapse_duplicates([r for r in runs if r.status == "complete"])[0])  # a copy is not a seed
    return [{**csv_row(g), "regime": g.regime, "compared_with": g.compared_with} for g in rows]


def write_csv(rows: list[dict], path: Path) -> None:
    from humanline_cli.report.gap_closed import CSV_COLUMNS

    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["regime", "compared_with", *CSV_COLUMNS])
        w.writeheader()
        w.writerows(rows)


def _num(x: str) -> float | None:
    return float(x) if x not in ("", None) else None


def markdown(rows: list[dict]) -> list[str]:
    out = ["| regime | objective | metric | offline | online | humanline-offline | gap closed | seeds "
           "| speedup (equal steps) | at equal quality | online sampling (bound) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g, lo, hi = _num(r["gap_closed"]), _num(r["gap_closed_lo"]), _num(r["gap_closed_hi"])
        gap = "–" if g is None else f"{g:.0%}" + (f" [{lo:.0%}, {hi:.0%}]" if lo is not None else "")
        eq = _num(r.get("speedup_equal_quality", ""))
        sp = _num(r["speedup"])
        share, bound = _num(r.get("online_sampling_share", "")), _num(r.get("speedup_bound_matched", ""))
        sampling = "n/a" if share is None or bound is None else f"{share:.0%} ({bound:.2f}x)"
        vs = r.get("compared_with")
        regime = r["regime"] + (f" (vs {vs})" if vs and vs != "offline, online" else "")
        out.append(f"| {regime} | {r['objective']} | {r['metric']} | {float(r['offline']):.3f} | "
                   f"{float(r['online']):.3f} | {float(r['humanline_offline']):.3f} | {gap} | {r['n_seeds']} | "
                   f"{'n/a' if sp is None else f'{sp:.2f}x'} | {'n/a' if eq is None else f'{eq:.2f}x'} | {sampling} |")
    return out


def plot(rows: list[dict], path: Path) -> None:
    from humanline_cli.report.gap_closed import bar_chart

    colors = {"grpo": "#c44e52", "dpo": "#4c72b0", "kto": "#55a868"}
    rank = {o: i for i, o in enumerate(colors)}  # bars grouped by objective, regimes in their given order
    rows = sorted((r for r in rows if _num(r["gap_closed"]) is not None), key=lambda r: rank.get(r["objective"], 9))
    bar_chart([f"{r['objective']}\n" + "\n".join(textwrap.wrap(r["regime"], 16)) for r in rows],
              [(_num(r["gap_closed"]), _num(r["gap_closed_lo"]), _num(r["gap_closed_hi"])) for r in rows], path,
              [colors.get(r["objective"], "grey") for r in rows])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m humanline_cli.report.regime_map", description=__doc__.split("\n\n")[0])
    p.add_argument("studies", nargs="*", help="LABEL=DIR: a regime's label and its `humanline report` dir")
    p.add_argument("--sweep", help="one sweep over named regimes (regime=...), e.g. runs/experiments/laptop_regimes")
    p.add_argument("--out", default="regime_map.png", help="the PNG to write (and, with --sweep, a CSV next to it)")
    a = p.parse_args(argv)
    if a.sweep:
        root = Path(a.sweep)
        if not root.is_dir():
            print(f"regime_map: error: {root}: no such directory", file=sys.stderr)
            return 2
        rows = sweep_rows(root)
        if not rows:
            print(f"regime_map: error: {root}: no humanline-offline regime with its offline and online runs complete",
                  file=sys.stderr)
            return 2
        print("\n".join(markdown(rows)))
        plot(rows, Path(a.out))
        write_csv(rows, Path(a.out).with_suffix(".csv"))
        print(f"wrote {a.out} and {Path(a.out).with_suffix('.csv')}")
        return 0
    if not a.studies:
        print("regime_map: error: give LABEL=DIR studies or --sweep DIR", file=sys.stderr)
        return 2
    studies = []
    for s in a.studies:
        label, eq, path = s.partition("=")
        if not eq:
            print(f"regime_map: error: {s!r} is not LABEL=DIR", file=sys.stderr)
            return 2
        studies.append((label, Path(path)))
    try:
        rows = load(studies)
    except FileNotFoundError as e:
        print(f"regime_map: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(markdown(rows)))
    plot(rows, Path(a.out))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
