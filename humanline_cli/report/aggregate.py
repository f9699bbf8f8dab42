"""`humanline report <dir>`: run dirs -> report.md, report.csv, the comparison CSVs and PNG plots.

A run dir holds `.hydra/config.yaml`, `summary.json`, `failed.json` or `metrics.jsonl`. Complete runs feed the
tables; failed and incomplete runs are listed with their reason. Runs pool as seeds only when their resolved
configs match but for the seed and result-neutral keys (report/groups.py): averaging unlike runs is worse than
nothing. Keys that differ between groups become columns, or a label above a cell's numbers.
"""
from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from humanline_cli.core.objectives import PROPERTIES
from humanline_cli.errors import ArgumentParser, RunFailed, UserError, finite_float
from humanline_cli.mdtable import md_table
from humanline_cli.report import async_lag, correction_contrasts, cost, gap_closed, matched, study_csv
from humanline_cli.report.frame import MARKERS, column, find_run_dirs, frame, load_run, num, write_csv
from humanline_cli.report.groups import DEFAULT_IGNORE, GROUP_COLUMNS, collapse_duplicates, label, parse_ignore, plain, under
from humanline_cli.report.plots import FAMILIES, log_to_wandb, make_plots, order
from humanline_cli.report.regimes import regime_gap_rows, with_regimes
from humanline_cli.report.stats import win_rate_ci

CSV_COLUMNS = ("task", "objective", "family", "n_seeds", "win_rate_mean", "win_rate_std", "win_rate_lo", "win_rate_hi",
               "accuracy_mean", "accuracy_std", "reward_mean", "wall_clock_s", "sample_s", "label_s", "train_s",
               "speedup_vs_online")
# a cell's numbers: name -> the summary field, mean and sd over the group's seeds (wall-clock: the mean alone)
FIELDS = {"win_rate": "eval.win_rate", "accuracy": "eval.accuracy", "reward": "eval.reward_mean",
          "lc_win_rate": "eval.alpaca_eval.lc_win_rate",  # percent there, a fraction here like WR
          "math500_greedy": "eval.math500.greedy_accuracy", "math500_sampled": "eval.math500.sampled_accuracy",
          "wall_clock_s": "wall_clock_s.total", "sample_s": "wall_clock_s.sample", "label_s": "wall_clock_s.label",
          "train_s": "wall_clock_s.train"}
WALL = ("wall_clock_s", "sample_s", "label_s", "train_s")
CI_NOTE = ("Win rate is against the starting policy on the same eval prompts (per-prompt outcome 1 win, 1/2 tie, 0 loss). "
           "95% CI: for a single seed, the run's own normal-approximation interval on the per-prompt outcomes "
           "(mean ± 1.96·sd/√n); for two or more seeds, a Student-t interval across the seeds' win rates "
           "(mean ± t(0.975, k−1)·sd/√k, k = seeds). Both are clipped to [0, 1]. "
           "± is the sample standard deviation across seeds (omitted for one seed).")


class ReportError(UserError):
    pass


@dataclass
class Report:
    root: Path
    out_dir: Path
    frame: pd.DataFrame  # one row per run dir, complete runs with their `group` and `variant`
    cells: pd.DataFrame  # one row per config group: the CSV columns, "metric", "seeds", "row_keys", "label"
    markdown: str
    files: dict  # name -> Path of everything written
    skipped_plots: dict  # plot file name -> why it was skipped
    wandb_error: str | None = None
    columns: tuple = CSV_COLUMNS  # report.csv's header, the varying config keys after "family"
    unused_ignores: tuple = ()  # --ignore keys that matched no config key (likely typos)
    duplicates: tuple = ()  # groups.Duplicate: run dirs counted once


def _natural(v: str):
    try:
        return (0, float(v), "")
    except ValueError:
        return (1 if v else 2, 0.0, v)


def aggregate(runs: pd.DataFrame, groups: pd.DataFrame) -> pd.DataFrame:
    """One row per config group (groups.label) with its labels, sorted by task, objective, row labels, family and
    cell label: mean and sd over its seeds of each FIELDS score (wall-clock: the mean alone), the win rate's
    interval, and the speedup against the one online group of an otherwise identical config (never a guess)."""
    if groups.empty:
        return groups.reindex(columns=[*groups.columns, *CSV_COLUMNS, "metric"])
    values = pd.DataFrame({name: column(runs, key) for name, key in FIELDS.items()})
    values["lc_win_rate"] /= 100
    stats = values.groupby(runs["group"]).agg(["mean", "std"])
    stats.columns = [k if k in WALL else f"{k}_{m}" for k, m in stats.columns]
    cells = groups.join(stats.loc[:, ~stats.columns.duplicated()])  # wall-clock keeps its mean
    verifier = cells.task.map(values["accuracy"].notna().groupby(runs.task).any())
    cells.loc[~verifier, ["accuracy_mean", "accuracy_std"]] = None
    sig = cells.sig.map(str)
    online = cells[cells.family == "online"]
    # each set's plain online group: correction=none where several differ in the correction
    online = online.loc[[i for _, g in online.groupby(sig[online.index], sort=False)
                         for i, keep in zip(g.index, plain(g.cfg)) if keep]]
    on_wall = sig.map(online.groupby(sig[online.index]).wall_clock_s.agg(lambda w: w.iloc[0] if len(w) == 1 else None))
    # an online group without one baseline (two sampler settings) is its own
    on_wall = on_wall.where(on_wall.notna() | (cells.family != "online"), cells.wall_clock_s).astype(float)
    members = [runs.loc[m].sort_values("seed", key=lambda s: s.map(str)) for m in cells.members]
    cells = cells.assign(n_seeds=[len(m) for m in members], metric=verifier.map({True: "accuracy", False: "judge reward"}),
                         seeds=[m.seed.tolist() for m in members],
                         speedup_vs_online=(on_wall / cells.wall_clock_s).where((on_wall != 0) & (cells.wall_clock_s != 0)))
    cells[["win_rate_lo", "win_rate_hi"]] = [_win_interval(m) for m in members]
    obj_rank = {o: i for i, o in enumerate(order(set(cells.objective), PROPERTIES))}
    fam_rank = {f: i for i, f in enumerate(order(set(cells.family), FAMILIES))}
    key = [(t, obj_rank[o], [_natural(_text(c[k])) for k in ks], fam_rank[f], lab) for t, o, ks, f, lab, c in
           zip(cells.task, cells.objective, cells.row_keys, cells.family, cells.label, cells.to_dict("records"))]
    cells = cells.drop(columns=["cfg", "raw", "members"])  # the group's config and runs stay in `groups`
    return cells.iloc[sorted(range(len(cells)), key=key.__getitem__)].reset_index(drop=True)


def _win_interval(members: pd.DataFrame) -> tuple:
    """One seed: the run's own interval; more: the t-interval across seeds (stats.win_rate_ci)."""
    wr = column(members, "eval.win_rate").dropna().tolist()
    ci = members["eval.win_rate_ci"].iloc[0] if "eval.win_rate_ci" in members else None
    return win_rate_ci(wr, ci if isinstance(ci, (list, tuple)) else None) if wr else (None, None)


def _text(x) -> str:
    """A label cell: its text, "–" where the key does not tell the group apart."""
    return "–" if x is None or x != x else x


def _pm(c: dict, key: str) -> str:
    mean, std = c.get(f"{key}_mean"), c.get(f"{key}_std")
    return "–" if num(mean) is None else f"{mean:.3f}" + (f" ± {std:.3f}" if num(std) is not None else "")


def cell_lines(c: dict) -> list[str]:
    wr = _pm(c, "win_rate") + ("" if num(c["win_rate_lo"]) is None else f" [{c['win_rate_lo']:.3f}, {c['win_rate_hi']:.3f}]")
    wr += "" if num(c.get("lc_win_rate_mean")) is None else ", LC " + _pm(c, "lc_win_rate")
    metric = "acc " + _pm(c, "accuracy") if c["metric"] == "accuracy" else "judge reward " + _pm(c, "reward")
    m500 = [f"{mode} " + _pm(c, f"math500_{mode}") for mode in ("greedy", "sampled")
            if num(c.get(f"math500_{mode}_mean")) is not None]
    speed = "n/a" if num(c["speedup_vs_online"]) is None else f"{c['speedup_vs_online']:.2f}x"
    wall = "–" if num(c["wall_clock_s"]) is None else f"{c['wall_clock_s']:.1f} s"
    return ([c["label"]] if c["label"] else []) + [f"win {wr}", metric, *(["MATH-500 " + ", ".join(m500)] if m500
                                                                         else []), f"{wall} ({speed} vs online)",
                                                   f"n={c['n_seeds']}"]


def task_tables(cells: pd.DataFrame, sep: str):
    """Per task: (task, metric, header, rows) of its table, one row per objective and the varying keys outside the
    family-defining subtrees, one column per family; the other keys label the cell itself, its lines joined by `sep`."""
    for task, cs in cells.groupby("task", sort=True):
        keys = ["objective", *cs.row_keys.iloc[0]]
        view = cs[keys].map(_text).assign(family=cs.family, text=[sep.join(cell_lines(c)) for c in cs.to_dict("records")])
        grid = view.pivot_table(index=keys, columns="family", values="text", aggfunc=(sep + sep).join, sort=False)
        grid = grid.reindex(columns=order(set(cs.family), FAMILIES)).fillna("–")
        yield task, cs.metric.iloc[0], [*keys, *grid.columns], list(grid.reset_index().itertuples(index=False, name=None))


def grouping_note(ignore) -> str:
    extra = f"; here also --ignore {', '.join(f'`{k}`' for k in ignore)}" if ignore else ""
    return ("Runs are pooled as seeds only when their resolved `.hydra/config.yaml` is identical except for `seed`, "
            f"keys that never change results ({', '.join(f'`{k}`' for k in DEFAULT_IGNORE[1:])}), `hl.*` when "
            f"humanline is off{extra}, and only when they computed in the same dtype (summary.json's "
            "`precision.compute`, shown as `backend.compute_dtype` where it differs: `backend.precision=auto` "
            "resolves per machine). Keys that differ between groups are extra columns (or a label above a "
            "cell's numbers when they belong to the data regime / humanline subtrees). Speedup = wall-clock of the "
            "one online group whose config is identical except for `data`, `humanline`, `hl`, `sampler`, `reward` "
            "and `correction`, divided by this group's (where several such differ in `correction`, the one with "
            "correction=none); n/a when there is no such group (or more than one). Run dirs "
            "without `.hydra/config.yaml` are grouped by their summary.json labels (task, objective, data, humanline).")


def _rel(path: Path, base: Path) -> str:
    try:
        return str(path.resolve().relative_to(base.resolve())) or "."
    except ValueError:
        return str(path)


def render_markdown(root: Path, cells, runs: pd.DataFrame, plots: dict, skipped: dict, out_dir: Path, ignore=(),
                    duplicates=(), shown_root: Path | None = None) -> str:
    n = runs.status.value_counts()
    lines = [f"# humanline report: `{shown_root or root}`", "",
             (f"{len(runs)} run dirs: {n.get('complete', 0)} complete, {n.get('failed', 0)} failed, "
              f"{n.get('incomplete', 0)} incomplete (only complete runs are aggregated)."), ""]
    if duplicates:
        lines += [f"{len(duplicates)} complete run dirs are another dir's run again (same config and seed) and are "
                  "counted once:", "", *(f"- `{_rel(d.dropped.path, root)}` duplicates `{_rel(d.kept.path, root)}` "
                                         f"({'identical outputs' if d.same_outputs else 'outputs differ'})"
                                         for d in duplicates), ""]
    if cells.empty:
        lines += ["No complete runs to aggregate.", ""]
    for task, metric, head, rows in task_tables(cells, "<br>"):
        lines += [f"## Task `{task}`", "",
                  (f"Each cell: win rate vs the starting policy, mean ± sd over seeds [95% CI]; {metric} "
                   f"mean ± sd{'' if metric == 'accuracy' else ' (no verifier for this task)'}; mean wall-clock "
                   "seconds (speedup = online wall-clock / this wall-clock); number of seeds."), "",
                  *md_table(head, [(f"**{r[0]}**", *r[1:]) for r in rows]), ""]
    problems = runs[runs.status != "complete"]
    lines += ["## Failed or incomplete runs", "", *([] if len(problems) else ["none"]),
              *(f"- **{r.status}** `{_rel(r.path, root)}` ({r.task} / {r.objective} / {r.family} / seed {r.seed}): "
                f"{r.reason}" for r in problems.itertuples()),
              "", "## Confidence intervals", "", CI_NOTE, "", "## Grouping", "", grouping_note(ignore), "",
              "## Plots", "", *(f"- [{name}]({_rel(path, out_dir)})" for name, path in plots.items()),
              *(f"- `{name}` skipped: {why}" for name, why in skipped.items()), "", "Numbers: [report.csv](report.csv)", ""]
    return "\n".join(lines)


def by_commit(records: list[dict], pool: bool) -> str:
    """Runs made by different code are not seeds of one experiment: where the complete runs' summary.json name
    more than one git_commit, each run's config gets a `git_commit` key (so the cells, the comparisons and the
    seeds keep them apart) unless `pool`; returns the report's note ("" with one commit)."""
    complete = [r for r in records if r["status"] == "complete"]
    commits = sorted({str(r["summary"].get("git_commit") or "unknown") for r in complete})
    if len(commits) < 2:
        return ""
    shown = ", ".join(c[:12] for c in commits)
    if pool:
        return f"Runs of {len(commits)} commits ({shown}) pooled as seeds (--pool-commits)."
    for r in complete:
        if r["config"] is not None:
            r["config"] = {**r["config"], "git_commit": str(r["summary"].get("git_commit") or "unknown")}
    return (f"Runs of {len(commits)} commits ({shown}) are kept apart by a git_commit label, never pooled as seeds "
            f"(--pool-commits pools them).")


def build_report(root: Path, out_dir: Path | None = None, wandb_mode: str | None = None, ignore=(),
                 accuracy: float | None = None, margin: float | None = None, shown_root: Path | None = None,
                 pool_commits: bool = False) -> Report:
    """`shown_root`: what the report names as its source (default `root`); `pool_commits`: see by_commit."""
    root, ignore = Path(root), parse_ignore(ignore)
    if not root.is_dir():
        raise ReportError(f"no such directory: {root}")
    run_dirs = find_run_dirs(root)
    if not run_dirs:
        raise ReportError(f"no run dirs under {root} (looked for .hydra/config.yaml, {', '.join(MARKERS)})")
    out_dir = Path(out_dir) if out_dir is not None else root
    out_dir.mkdir(parents=True, exist_ok=True)
    records = [load_run(d) for d in run_dirs]
    commits_note = by_commit(records, pool_commits)
    runs = frame(records)
    # a copied run dir is the same run, never a second seed (n=2 with a zero-width interval)
    complete, duplicates = collapse_duplicates(runs[runs.status == "complete"])
    complete, groups = label(complete, ignore)
    complete = with_regimes(complete)
    cells = aggregate(complete, groups)
    plots, skipped = make_plots(complete, out_dir)
    md = render_markdown(root, cells, runs, plots, skipped, out_dir, ignore, duplicates, shown_root)
    if commits_note:
        md += f"\n## Code versions\n\n{commits_note}\n"
    files = {"report.md": out_dir / "report.md", "report.csv": out_dir / "report.csv", **plots}

    def table(name: str, rows: pd.DataFrame, digits=None) -> None:
        files[name] = out_dir / name
        write_csv(rows, files[name], digits)

    # a sweep over named regimes (experiment=laptop_regimes) pairs each regime with its own baselines
    gaps = regime_gap_rows(complete, margin)
    gaps = gap_closed.gap_rows(complete, ignore, margin) if gaps.empty else gaps
    table("gap_closed.csv", gap_closed.gap_frame(gaps), gap_closed.DIGITS)
    md += "\n## Gap closed by humanline-offline\n\n" + "\n".join(gap_closed.markdown(gaps))
    if gap_closed.plot(gaps, out_dir / "gap_closed.png"):
        files["gap_closed.png"] = out_dir / "gap_closed.png"
        md += "\n![gap closed](gap_closed.png)\n"
    md += "\n## Paired differences\n\n" + "\n".join(gap_closed.paired_markdown(gaps, margin))
    (out_dir / "corrections.csv").unlink(missing_ok=True)  # never an earlier report's table
    # only sweeps over correction=tis|mis|decoupled|trdpo get the section
    between = correction_contrasts.correction_rows(complete, ignore)
    if len(between):
        table("corrections.csv", between, 6)
        md += "\n## Paired differences between corrections\n\n" + "\n".join(correction_contrasts.markdown(between))
    table("cost.csv", costs := cost.cost_rows(complete), 8)
    md += "\n## Generation cost at matched training units\n\n" + "\n".join(cost.markdown(costs)) + "\n"
    mrows = matched.matched_rows(complete, accuracy)
    if not mrows.empty:
        md += "\n## Speedup at matched quality\n\n" + "\n".join(matched.markdown(mrows)) + "\n"
    (out_dir / "async.csv").unlink(missing_ok=True)  # never an earlier report's table
    lagged = async_lag.async_rows(complete, ignore)  # only sweeps with data.async_lag > 0 get the section
    if len(lagged):
        table("async.csv", lagged)
        md += "\n## Asynchronous rounds vs synchronous online\n\n" + "\n".join(async_lag.markdown(lagged))
    files["report.md"].write_text(md)
    columns = CSV_COLUMNS[:3] + tuple(sorted(c for c in groups if c not in GROUP_COLUMNS)) + CSV_COLUMNS[3:]
    write_csv(cells.reindex(columns=list(columns)), files["report.csv"], 8)
    known = {k for c in complete["config"] if c for k in c}
    rep = Report(root=root, out_dir=out_dir, frame=pd.concat([complete, runs.drop(complete.index)]).sort_index(),
                 cells=cells, markdown=md, files=files, skipped_plots=skipped, columns=columns,
                 unused_ignores=tuple(p for p in ignore if not any(under(k, (p,)) for k in known)),
                 duplicates=tuple(duplicates))
    if wandb_mode is not None:
        rep.wandb_error = log_to_wandb(rep, wandb_mode)
    return rep


def report_from_csv(csv_path: Path, out_dir: Path, **options) -> Report:
    """build_report over the run dirs a study CSV (study_csv.export) holds, rebuilt in a temporary folder; the
    report names the CSV as its source."""
    with tempfile.TemporaryDirectory(prefix="humanline-csv-") as tmp:
        root = study_csv.materialise(Path(csv_path), Path(tmp) / Path(csv_path).stem)
        return build_report(root, out_dir, shown_root=Path(csv_path), **options)


def print_report(rep: Report, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else 160)
    for task, metric, head, rows in task_tables(rep.cells, "\n"):
        t = Table(title=f"task {task}: win rate vs start [95% CI] / {metric} / wall-clock", show_lines=True)
        for i, h in enumerate(head):
            t.add_column(h, style="bold" if i == 0 else None)
        for r in rows:
            t.add_row(*r)
        console.print(t)
    if rep.cells.empty:
        console.print("no complete runs to aggregate")
    for r in rep.frame[rep.frame.status != "complete"].itertuples():
        console.print(f"[red]{r.status}[/] {r.path}: {r.reason}", highlight=False, markup=True)
    for d in rep.duplicates:
        console.print(f"duplicate run dir: {d.describe()}", highlight=False)
    for name, why in rep.skipped_plots.items():
        console.print(f"skipped {name}: {why}")
    for k in rep.unused_ignores:
        console.print(f"warning: --ignore {k} matched no key of any complete run's config", highlight=False)
    for section in ("Gap closed by humanline-offline", "Paired differences", "Paired differences between corrections",
                    "Speedup at matched quality", "Code versions"):
        text = rep.markdown.partition(f"## {section}\n")[2].split("\n## ", 1)[0].strip()  # the section's body
        if text:
            console.print(f"{section}\n{text}", highlight=False, markup=False, soft_wrap=True)
    console.print(f"wrote {', '.join(str(p) for p in rep.files.values())}", highlight=False)


def main_report(argv: list[str]) -> int:
    p = ArgumentParser(prog="humanline report", description="Aggregate run dirs into report.md/.csv and plots.")
    p.add_argument("dir", type=Path, nargs="?", default=None,
                   help="a sweep dir or runs dir (searched recursively for run dirs); not with --from-csv")
    p.add_argument("--out", type=Path, default=None, help="where to write report.md/.csv/PNGs (default: DIR)")
    p.add_argument("--ignore", action="append", default=[], metavar="KEY",
                   help="config key (dotted; a prefix such as `train` ignores the subtree) whose differences may be "
                        "pooled as seeds; repeatable or comma-separated")
    p.add_argument("--wandb", action="store_true", help="also log the table and plots to a wandb run (job_type=report)")
    p.add_argument("--accuracy", type=finite_float(0.0, 1.0), default=None,
                   help="the matched-quality target score, named in advance (default: the start plus 0.9 of online's mean "
                        "gain over it)")
    p.add_argument("--margin", type=finite_float(positive=True), default=None, metavar="M",
                   help="equivalence margin in absolute score units: each paired difference also gets its 90%% "
                        "t-interval and whether it lies inside [-M, +M] (two one-sided tests at alpha 0.05)")
    p.add_argument("--pool-commits", action="store_true",
                   help="pool runs made by different code (summary.json git_commit) as seeds of one cell; by "
                        "default they are kept apart, by a git_commit label")
    p.add_argument("--export-csv", type=Path, default=None, metavar="FILE",
                   help="also write one row per run dir (scores per evaluation, wall-clock per phase, config hash, "
                        "commit, and what --from-csv needs) to FILE: a study's record kept beside results.md")
    p.add_argument("--append", action="store_true",
                   help="with --export-csv: keep FILE's rows (runs whose dirs are gone) and add only the complete "
                        "runs it lacks")
    p.add_argument("--from-csv", type=Path, default=None, metavar="FILE",
                   help="rebuild the tables from a CSV of --export-csv instead of run dirs (needs --out)")
    args = p.parse_args(argv)
    try:
        if (args.dir is None) == (args.from_csv is None):
            raise ValueError("give a run dir or --from-csv FILE (one of them)")
        if args.append and args.export_csv is None:
            raise ValueError("--append needs --export-csv FILE (the file it adds to)")
        if args.from_csv is not None and args.out is None:
            raise ValueError("--from-csv needs --out DIR (where the rebuilt report goes)")
        if args.out is not None and args.out.exists() and not args.out.is_dir():
            raise ReportError(f"--out {args.out} is a file; name a directory for report.md, report.csv and the plots")
        options = dict(wandb_mode=os.environ.get("WANDB_MODE", "offline") if args.wandb else None,
                       ignore=args.ignore, accuracy=args.accuracy, margin=args.margin, pool_commits=args.pool_commits)
        if args.from_csv is not None:
            rep = report_from_csv(args.from_csv, args.out, **options)
        else:
            rep = build_report(args.dir, args.out, **options)
            if args.export_csv is not None:
                n = study_csv.export(args.dir, args.export_csv, append=args.append)
                print(f"{'added' if args.append else 'wrote'} {n} runs to {args.export_csv}")
    except (OSError, ValueError, UserError, RunFailed) as e:  # RunFailed: a CSV that cannot be written
        print(f"humanline: error: {e}", file=sys.stderr)
        return 2
    print_report(rep)
    return 0
