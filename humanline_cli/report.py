"""`humanline report <dir>`: aggregate run dirs into a paper-style table (report.md, report.csv, PNG plots).

A run dir is any directory holding `.hydra/config.yaml`, `summary.json`, `failed.json` or `metrics.jsonl`.
Complete runs (summary.json with status "complete") feed the aggregates; failed runs (failed.json) and
incomplete runs (neither file) are listed with their reason and never aggregated.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .errors import UserError

OBJECTIVES = ("dpo", "kto", "grpo")
FAMILIES = ("offline", "online", "humanline-offline", "humanline-online")
MARKERS = ("summary.json", "failed.json", "metrics.jsonl")
CSV_COLUMNS = ("task", "objective", "family", "n_seeds", "win_rate_mean", "win_rate_std", "win_rate_lo", "win_rate_hi",
               "accuracy_mean", "accuracy_std", "reward_mean", "wall_clock_s", "sample_s", "label_s", "train_s",
               "speedup_vs_online")
CI_NOTE = ("Win rate is against the starting policy on the same eval prompts (per-prompt outcome 1 win, 1/2 tie, 0 loss). "
           "95% CI: for a single seed, the run's own normal-approximation interval on the per-prompt outcomes "
           "(mean ± 1.96·sd/√n); for two or more seeds, a Student-t interval across the seeds' win rates "
           "(mean ± t(0.975, k−1)·sd/√k, k = seeds). Both are clipped to [0, 1]. "
           "± is the sample standard deviation across seeds (omitted for one seed).")
# two-sided 95% Student-t critical values t(0.975, df), df = 1..30
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


class ReportError(UserError):
    pass


@dataclass
class Run:
    path: Path
    status: str  # complete | failed | incomplete
    task: str = "?"
    objective: str = "?"
    data: str = "?"
    humanline: bool = False
    seed: object = None
    reason: str = ""
    summary: dict = field(default_factory=dict)
    metrics: list = field(default_factory=list)
    logratios: list = field(default_factory=list)

    @property
    def family(self) -> str:
        return ("humanline-" if self.humanline else "") + str(self.data)


@dataclass
class Report:
    root: Path
    out_dir: Path
    runs: list  # every Run found
    cells: list  # one dict per (task, objective, family), CSV columns + "metric"
    markdown: str
    files: dict  # name -> Path of everything written
    skipped_plots: dict  # plot file name -> why it was skipped
    wandb_error: str | None = None

    @property
    def complete(self):
        return [r for r in self.runs if r.status == "complete"]

    @property
    def problems(self):
        return [r for r in self.runs if r.status != "complete"]


def t975(df: int) -> float:
    if df < 1:
        raise ValueError("df must be >= 1")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964  # Cornish-Fisher expansion; < 1e-4 error for df > 30
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def win_rate_ci(win_rates: list[float], single_ci=None) -> tuple[float, float]:
    """95% CI for a cell: the run's own CI for one seed, else a t-interval across seeds (clipped to [0, 1])."""
    if len(win_rates) == 1:
        lo, hi = single_ci if single_ci else (math.nan, math.nan)
        return float(lo), float(hi)
    k, m = len(win_rates), statistics.fmean(win_rates)
    half = t975(k - 1) * statistics.stdev(win_rates) / math.sqrt(k)
    return max(0.0, m - half), min(1.0, m + half)


# ---------------------------------------------------------------- reading run dirs
def find_run_dirs(root: Path) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        d = Path(dirpath)
        if (d / ".hydra" / "config.yaml").is_file() or any(m in filenames for m in MARKERS):
            found.append(d)
            dirnames[:] = []  # a run's own subdirs (model/, wandb/) are not runs
        else:
            dirnames[:] = sorted(n for n in dirnames if n not in ("wandb", "__pycache__") and not n.startswith(".git"))
    return sorted(found)


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                obj = json.loads(line)
            except ValueError:
                continue  # a half-written last line from a crashed run
            if isinstance(obj, dict):
                rows.append(obj)
    return rows


def _read_json(path: Path):
    try:
        return json.loads(path.read_text()), None
    except (OSError, ValueError) as e:
        return None, f"unreadable {path.name}: {type(e).__name__}: {e}"


def _label_from_config(run: Run) -> None:
    path = run.path / ".hydra" / "config.yaml"
    if not path.is_file():
        return
    try:
        import yaml

        cfg = yaml.safe_load(path.read_text()) or {}
    except Exception:  # an unreadable config only costs the labels
        return
    run.objective = str(_dig(cfg, "objective", "name") or run.objective)
    run.data = str(_dig(cfg, "data", "regime") or run.data)
    run.task = str(_dig(cfg, "task", "name") or run.task)
    run.seed = _dig(cfg, "seed") if _dig(cfg, "seed") is not None else run.seed
    run.humanline = _dig(cfg, "humanline") is True  # only present when the user passed +humanline=true


def _dig(d, *keys):
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def load_run(path: Path) -> Run:
    run = Run(path=path, status="incomplete")
    _label_from_config(run)
    run.metrics = _read_jsonl(path / "metrics.jsonl")
    run.logratios = _read_jsonl(path / "logratios.jsonl")
    if (path / "summary.json").is_file():
        s, err = _read_json(path / "summary.json")
        if isinstance(s, dict) and s.get("status") == "complete":
            run.status, run.summary = "complete", s
            run.objective, run.data, run.task = str(s.get("objective")), str(s.get("data")), str(s.get("task"))
            run.humanline, run.seed = bool(s.get("humanline")), s.get("seed")
            return run
        run.status = "failed"
        run.reason = err or f"summary.json has status {s.get('status') if isinstance(s, dict) else s!r}"
    if (path / "failed.json").is_file():
        f, err = _read_json(path / "failed.json")
        run.status = "failed"
        run.reason = err or str((f or {}).get("error") or "failed.json without an error message")
    elif run.status == "incomplete":
        steps = [r["step"] for r in run.metrics if isinstance(r.get("step"), (int, float))]
        last = f"; last logged step {int(max(steps))}" if steps else "; no steps logged"
        run.reason = "incomplete: no summary.json or failed.json (crashed, killed or still running)" + last
    return run


# ---------------------------------------------------------------- aggregation
def _order(values, preferred) -> list:
    values = set(values)
    return [v for v in preferred if v in values] + sorted(values - set(preferred))


def _mean(xs):
    xs = [float(x) for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def _std(xs):
    xs = [float(x) for x in xs if x is not None]
    return statistics.stdev(xs) if len(xs) >= 2 else None


def aggregate(runs: list[Run]) -> list[dict]:
    groups: dict[tuple, list[Run]] = {}
    for r in runs:
        groups.setdefault((r.task, r.objective, r.family), []).append(r)
    cells = []
    for task in sorted({k[0] for k in groups}):
        has_verifier = any(r.summary.get("eval", {}).get("accuracy") is not None for r in runs if r.task == task)
        for obj in _order({k[1] for k in groups if k[0] == task}, OBJECTIVES):
            online = groups.get((task, obj, "online"))
            online_wall = _mean(r.summary.get("wall_clock_s", {}).get("total") for r in online) if online else None
            for fam in _order({k[2] for k in groups if k[:2] == (task, obj)}, FAMILIES):
                g = sorted(groups[(task, obj, fam)], key=lambda r: str(r.seed))
                ev = [r.summary.get("eval", {}) for r in g]
                wall = [r.summary.get("wall_clock_s", {}) for r in g]
                wr = [float(e["win_rate"]) for e in ev if e.get("win_rate") is not None]
                lo, hi = win_rate_ci(wr, ev[0].get("win_rate_ci")) if wr else (None, None)
                wall_mean = _mean(w.get("total") for w in wall)
                cells.append({
                    "task": task, "objective": obj, "family": fam, "n_seeds": len(g),
                    "win_rate_mean": _mean(wr), "win_rate_std": _std(wr), "win_rate_lo": lo, "win_rate_hi": hi,
                    "accuracy_mean": _mean(e.get("accuracy") for e in ev) if has_verifier else None,
                    "accuracy_std": _std(e.get("accuracy") for e in ev) if has_verifier else None,
                    "reward_mean": _mean(e.get("reward_mean") for e in ev),
                    "reward_std": _std(e.get("reward_mean") for e in ev),
                    "wall_clock_s": wall_mean, "sample_s": _mean(w.get("sample") for w in wall),
                    "label_s": _mean(w.get("label") for w in wall), "train_s": _mean(w.get("train") for w in wall),
                    "speedup_vs_online": online_wall / wall_mean if online_wall and wall_mean else None,
                    "metric": "accuracy" if has_verifier else "judge reward",
                    "seeds": [r.seed for r in g],
                })
    return cells


# ---------------------------------------------------------------- formatting
def _pm(mean, std, digits=3) -> str:
    if mean is None:
        return "–"
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if std is not None else "")


def cell_lines(c: dict) -> list[str]:
    wr = _pm(c["win_rate_mean"], c["win_rate_std"])
    if c["win_rate_lo"] is not None and not math.isnan(c["win_rate_lo"]):
        wr += f" [{c['win_rate_lo']:.3f}, {c['win_rate_hi']:.3f}]"
    if c["metric"] == "accuracy":
        metric = "acc " + _pm(c["accuracy_mean"], c["accuracy_std"])
    else:
        metric = "judge reward " + _pm(c["reward_mean"], c["reward_std"])
    speed = f"{c['speedup_vs_online']:.2f}x" if c["speedup_vs_online"] is not None else "n/a"
    wall = f"{c['wall_clock_s']:.1f} s" if c["wall_clock_s"] is not None else "–"
    return [f"win {wr}", metric, f"{wall} ({speed} vs online)", f"n={c['n_seeds']}"]


def task_grid(cells: list[dict], task: str) -> tuple[list[str], list[str], dict]:
    cs = [c for c in cells if c["task"] == task]
    objs = _order({c["objective"] for c in cs}, OBJECTIVES)
    fams = _order({c["family"] for c in cs}, FAMILIES)
    return objs, fams, {(c["objective"], c["family"]): c for c in cs}


def render_markdown(rep_root: Path, cells, runs, plots: dict, skipped: dict, out_dir: Path) -> str:
    complete = [r for r in runs if r.status == "complete"]
    lines = [f"# humanline report: `{rep_root}`", "",
             (f"{len(runs)} run dirs: {len(complete)} complete, "
              f"{sum(r.status == 'failed' for r in runs)} failed, {sum(r.status == 'incomplete' for r in runs)} "
              "incomplete (only complete runs are aggregated)."), ""]
    if not cells:
        lines += ["No complete runs to aggregate.", ""]
    for task in sorted({c["task"] for c in cells}):
        objs, fams, grid = task_grid(cells, task)
        metric = next(c["metric"] for c in cells if c["task"] == task)
        lines += [f"## Task `{task}`", "",
                  (f"Each cell: win rate vs the starting policy, mean ± sd over seeds [95% CI]; {metric} "
                   f"mean ± sd{'' if metric == 'accuracy' else ' (no verifier for this task)'}; mean wall-clock "
                   "seconds (speedup = online wall-clock / this wall-clock); number of seeds."), "",
                  "| objective | " + " | ".join(fams) + " |", "|---|" + "---|" * len(fams)]
        for o in objs:
            row = ["<br>".join(cell_lines(grid[(o, f)])) if (o, f) in grid else "–" for f in fams]
            lines.append(f"| **{o}** | " + " | ".join(row) + " |")
        lines.append("")
    lines += ["## Failed or incomplete runs", ""]
    problems = [r for r in runs if r.status != "complete"]
    if not problems:
        lines.append("none")
    for r in problems:
        label = f"{r.task} / {r.objective} / {r.family} / seed {r.seed}"
        lines.append(f"- **{r.status}** `{_rel(r.path, rep_root)}` ({label}): {r.reason}")
    lines += ["", "## Confidence intervals", "", CI_NOTE, "", "## Plots", ""]
    for name, path in plots.items():
        lines.append(f"- [{name}]({_rel(path, out_dir)})")
    for name, why in skipped.items():
        lines.append(f"- `{name}` skipped: {why}")
    lines += ["", "Numbers: [report.csv](report.csv)", ""]
    return "\n".join(lines)


def _rel(path: Path, base: Path) -> str:
    try:
        return str(path.resolve().relative_to(base.resolve())) or "."
    except ValueError:
        return str(path)


def write_csv(path: Path, cells: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for c in cells:
            w.writerow(["" if c[k] is None or (isinstance(c[k], float) and math.isnan(c[k]))
                        else (f"{c[k]:.8g}" if isinstance(c[k], float) else c[k]) for k in CSV_COLUMNS])


# ---------------------------------------------------------------- entry points
def build_report(root: Path, out_dir: Path | None = None, wandb_mode: str | None = None) -> Report:
    from .report_plots import log_to_wandb, make_plots

    root = Path(root)
    if not root.is_dir():
        raise ReportError(f"no such directory: {root}")
    run_dirs = find_run_dirs(root)
    if not run_dirs:
        raise ReportError(f"no run dirs under {root} (looked for .hydra/config.yaml, {', '.join(MARKERS)})")
    out_dir = Path(out_dir) if out_dir is not None else root
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = [load_run(d) for d in run_dirs]
    complete = [r for r in runs if r.status == "complete"]
    cells = aggregate(complete)
    plots, skipped = make_plots(complete, out_dir)
    md = render_markdown(root, cells, runs, plots, skipped, out_dir)
    files = {"report.md": out_dir / "report.md", "report.csv": out_dir / "report.csv", **plots}
    files["report.md"].write_text(md)
    write_csv(files["report.csv"], cells)
    rep = Report(root=root, out_dir=out_dir, runs=runs, cells=cells, markdown=md, files=files, skipped_plots=skipped)
    if wandb_mode is not None:
        rep.wandb_error = log_to_wandb(rep, wandb_mode)
    return rep


def print_report(rep: Report, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else 160)
    for task in sorted({c["task"] for c in rep.cells}):
        objs, fams, grid = task_grid(rep.cells, task)
        t = Table(title=f"task {task}: win rate vs start [95% CI] / "
                        f"{next(c['metric'] for c in rep.cells if c['task'] == task)} / wall-clock", show_lines=True)
        t.add_column("objective", style="bold")
        for f in fams:
            t.add_column(f)
        for o in objs:
            t.add_row(o, *["\n".join(cell_lines(grid[(o, f)])) if (o, f) in grid else "–" for f in fams])
        console.print(t)
    if not rep.cells:
        console.print("no complete runs to aggregate")
    for r in rep.problems:
        console.print(f"[red]{r.status}[/] {r.path}: {r.reason}", highlight=False, markup=True)
    for name, why in rep.skipped_plots.items():
        console.print(f"skipped {name}: {why}")
    console.print(f"wrote {', '.join(str(p) for p in rep.files.values())}", highlight=False)


def main_report(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="humanline report", description="Aggregate run dirs into report.md/.csv and plots.")
    p.add_argument("dir", type=Path, help="a sweep dir or runs dir (searched recursively for run dirs)")
    p.add_argument("--out", type=Path, default=None, help="where to write report.md/.csv/PNGs (default: DIR)")
    p.add_argument("--wandb", action="store_true", help="also log the table and plots to a wandb run (job_type=report)")
    args = p.parse_args(argv)
    try:
        rep = build_report(args.dir, args.out, os.environ.get("WANDB_MODE", "offline") if args.wandb else None)
    except ReportError as e:
        print(f"humanline: error: {e}", file=sys.stderr)
        return 2
    print_report(rep)
    return 0
