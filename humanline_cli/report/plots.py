"""PNG plots for `humanline report` (matplotlib, Agg) and the optional wandb upload of the report.

Consumes the labelled runs frame (report/frame.py, groups.label, regime_map.with_regimes: task, objective, family,
variant, regime, summary, metrics, logratios, config) and its evaluation points (frame.run_points), and never
imports aggregate.py (imports point one way: aggregate -> plots). Runs of different config groups at the same
(task, objective, family) are told apart by their `variant` label (and line style), never summed together."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pandas as pd

from humanline_cli.report.frame import num, points, run_points
from humanline_cli.schema import HumanlineConfig

OBJECTIVES = ("dpo", "kto", "grpo")
FAMILIES = ("offline", "online", "humanline-offline", "humanline-online")
FAMILY_COLORS = {"offline": "tab:blue", "online": "tab:orange", "humanline-offline": "tab:green",
                 "humanline-online": "tab:red"}
LINESTYLES = ("-", "--", ":", "-.")


def order(values, preferred) -> list:
    """`preferred` first (those present), then the rest sorted."""
    values = set(values)
    return [v for v in preferred if v in values] + sorted(values - set(preferred))


def _color(family: str) -> str:
    return FAMILY_COLORS.get(family, "tab:gray")


def _label(run) -> str:
    return f"{run.family} ({run.variant})" if run.variant else run.family


def _styles(runs) -> dict:
    """variant -> line style, so groups of one family stay apart when their colour is the same."""
    variants = sorted({r.variant for r in runs})
    return {v: LINESTYLES[i % len(LINESTYLES)] for i, v in enumerate(variants)}


def eval_curve(run) -> tuple[str, list[tuple[float, float]]]:
    """(metric name, [(wall_s, value)]): start at x=0, eval rows of metrics.jsonl, final at the wall-clock total."""
    ev = run.summary.get("eval") or {}
    name, col = (("accuracy", "accuracy") if num(ev.get("accuracy")) is not None else
                 ("judge reward", "reward") if num(ev.get("reward_mean")) is not None else ("win rate vs start", "win rate"))
    pts = run_points(run.summary, run.metrics)[["wall_s", col]].dropna()
    return name, sorted(zip(pts["wall_s"].astype(float), pts[col].astype(float)))


def _panels(keys: list, title_fmt):
    import matplotlib.pyplot as plt

    n = len(keys)
    fig, axes = plt.subplots(1, n, figsize=(5 * n, 4), squeeze=False)
    axes = axes[0]
    for ax, k in zip(axes, keys):
        ax.set_title(title_fmt(k))
        ax.grid(alpha=0.3)
    return fig, dict(zip(keys, axes))


def _legend_once(ax):
    handles, labels = ax.get_legend_handles_labels()
    seen = {}
    for h, lab in zip(handles, labels):
        seen.setdefault(lab, h)
    if seen:
        ax.legend(seen.values(), seen.keys(), fontsize=8)


def _keys(pairs):
    """Panels, one per (task, objective), objectives in dpo/kto/grpo order; titles name the task if several."""
    pairs = set(pairs)
    tasks = sorted({t for t, _ in pairs})
    multi = len(tasks) > 1
    keys = []
    for t in tasks:
        keys += [(t, o) for o in order({o for tt, o in pairs if tt == t}, OBJECTIVES)]
    return keys, (lambda k: f"{k[0]} / {k[1]}" if multi else k[1])


def plot_eval_vs_wallclock(frame, path: Path) -> str | None:
    curves = [(r, *eval_curve(r)) for r in frame.itertuples()]
    curves = [c for c in curves if len(c[2]) >= 1]
    if not curves:
        return "no complete run has eval numbers"
    keys, title = _keys((c[0].task, c[0].objective) for c in curves)
    fig, axes = _panels(keys, title)
    style = _styles(c[0] for c in curves)
    for run, metric, pts in curves:
        ax = axes[(run.task, run.objective)]
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="o", linestyle=style[run.variant], ms=3, color=_color(run.family), alpha=0.8,
                label=_label(run))
        ax.set_xlabel("wall-clock (s)")
        ax.set_ylabel(metric)
    for ax in axes.values():
        _legend_once(ax)
    return _save(fig, path)


def step_curves(frame, mode: str):
    """Evaluation points (frame.points) of one mode ("greedy" or "sampled") of the runs that evaluated mid-run:
    one accuracy per run and step (the last), with the run's task, objective and regime."""
    pts = points(frame).dropna(subset=[f"{mode} accuracy"]).drop_duplicates(["run", "step"], keep="last")
    pts = pts[pts.groupby("run")["run"].transform("size") > 2]  # the start, a mid-run eval, the end
    return pts.join(frame[["task", "objective", "regime"]], on="run")


def plot_eval_vs_step(frame, path: Path) -> str | None:
    """Learning curves at matched training units: accuracy against the optimizer step, the mean over each
    regime's seeds at the steps all its seeds evaluated; one panel per objective and eval mode (greedy, sampled)."""
    curves = {m: c for m in ("greedy", "sampled") if len(c := step_curves(frame, m))}
    if not curves:
        return "no complete run has periodic greedy or sampled accuracy (eval.every > 0 on a verifier task)"
    import matplotlib.pyplot as plt

    keys, title = _keys(zip(*(pd.concat(curves.values())[c] for c in ("task", "objective"))))
    fig, axes = plt.subplots(len(curves), len(keys), figsize=(6 * len(keys), 4.5 * len(curves)), squeeze=False)
    labels = sorted(set(frame["regime"]))
    cmap = plt.get_cmap("tab20")
    for i, (mode, pts) in enumerate(curves.items()):
        for j, key in enumerate(keys):
            ax = axes[i][j]
            ax.set_title(f"{title(key)}, {mode} accuracy")
            ax.grid(alpha=0.3)
            ax.set_xlabel("optimizer step (matched training units)")
            mine = pts[(pts.task == key[0]) & (pts.objective == key[1])]
            for lab, g in mine.groupby("regime", sort=True):
                wide = g.pivot(index="step", columns="run", values=f"{mode} accuracy").dropna()  # steps all evaluated
                k = labels.index(lab)
                ax.plot(wide.index.astype(int), wide.mean(axis=1), marker="o", ms=3, color=cmap(k % 20), alpha=0.85,
                        linestyle=LINESTYLES[k // 10 % len(LINESTYLES)], label=f"{lab} (n={wide.shape[1]})")
            ax.legend(fontsize=7, ncol=2)
    return _save(fig, path)


def plot_unclamped_fraction(frame, path: Path) -> str | None:
    hl = [r for r in frame.itertuples() if r.humanline and any(num(m.get("humanline/unclamped_fraction")) is not None
                                                 for m in r.metrics)]
    if not hl:
        return "no humanline run logged humanline/unclamped_fraction"
    keys, title = _keys((r.task, r.objective) for r in hl)
    fig, axes = _panels(keys, title)
    style = _styles(hl)
    for r in hl:
        pts = sorted((m["step"], m["humanline/unclamped_fraction"]) for m in r.metrics
                     if num(m.get("humanline/unclamped_fraction")) is not None and num(m.get("step")) is not None)
        ax = axes[(r.task, r.objective)]
        ax.plot(*zip(*pts), linestyle=style[r.variant], color=_color(r.family), alpha=0.8, label=_label(r))
        ax.set_xlabel("step")
        ax.set_ylabel("unclamped token fraction")
        ax.set_ylim(0, 1.02)
    for ax in axes.values():
        _legend_once(ax)
    return _save(fig, path)


def late_histogram(run) -> list[float] | None:
    """Sum of the counts over the last 25% of the run's logged histogram steps (at least one step)."""
    rows = sorted((r for r in run.logratios if isinstance(r.get("counts"), list)), key=lambda r: r.get("step", 0))
    if not rows:
        return None
    late = rows[len(rows) - max(1, math.ceil(len(rows) / 4)):]
    n = len(late[0]["counts"])
    return [sum(float(r["counts"][i]) for r in late if len(r["counts"]) == n) for i in range(n)]


def plot_logratio_hist(frame, path: Path) -> str | None:
    hists, meta, bands = {}, {}, {}
    for r in frame.itertuples():
        h = late_histogram(r)
        if h is None:
            continue
        key = (r.task, r.objective, r.family, r.variant)  # seeds of one config group only
        prev = hists.get(key)
        hists[key] = h if prev is None else [a + b for a, b in zip(prev, h)]
        meta[key] = (r.logratios[0].get("lo", -3.0), r.logratios[0].get("hi", 3.0))
        if r.humanline:  # the band the run's clamp used (its resolved hl.*, else the schema's default)
            cfg = r.config or {}
            bands.setdefault((r.task, r.objective), (cfg.get("hl.log_eps_P", HumanlineConfig.log_eps_P),
                                                     cfg.get("hl.log_eps_R", HumanlineConfig.log_eps_R)))
    if not hists:
        return "no run wrote logratios.jsonl"
    keys, title = _keys((k[0], k[1]) for k in hists)
    fig, axes = _panels(keys, title)
    rank = {f: i for i, f in enumerate(FAMILIES)}
    style = {v: LINESTYLES[i % len(LINESTYLES)] for i, v in enumerate(sorted({k[3] for k in hists}))}
    for (task, obj, fam, variant), h in sorted(hists.items(),
                                               key=lambda kv: (kv[0][:2], rank.get(kv[0][2], 99), kv[0][2:])):
        ax = axes[(task, obj)]
        lo, hi = meta[(task, obj, fam, variant)]
        total = sum(h) or 1.0
        inner = h[1:-1]
        width = (hi - lo) / len(inner)
        edges = [lo + i * width for i in range(len(inner) + 1)]
        name = f"{fam} ({variant})" if variant else fam
        ax.stairs([c / total / width for c in inner], edges, color=_color(fam), linestyle=style[variant],
                  linewidth=1.5, label=f"{name} (out of range {(h[0] + h[-1]) / total:.1%})")
        ax.set_xlabel("token log-ratio log π/π_ref (last 25% of logged steps)")
        ax.set_ylabel("density")
    for key, ax in axes.items():
        band = bands.get(key, (HumanlineConfig.log_eps_P, HumanlineConfig.log_eps_R))
        for x in band:
            ax.axvline(x, color="black", linestyle="--", linewidth=1)
        ax.text(band[1], ax.get_ylim()[1] * 0.95, " clamp band", fontsize=8, va="top")
        _legend_once(ax)
    return _save(fig, path)


def _save(fig, path: Path) -> None:
    """Write and close the figure; plot functions return this None, meaning "not skipped"."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def make_plots(frame, out_dir: Path) -> tuple[dict, dict]:
    """Write the PNGs of the labelled runs frame; returns ({name: path}, {name: why skipped})."""
    import matplotlib


    matplotlib.use("Agg", force=True)
    plots, skipped = {}, {}
    for name, fn in (("eval_vs_wallclock.png", plot_eval_vs_wallclock),
                     ("eval_vs_step.png", plot_eval_vs_step),
                     ("unclamped_fraction.png", plot_unclamped_fraction),
                     ("logratio_hist.png", plot_logratio_hist)):
        path = out_dir / name
        try:
            why = fn(frame, path)
        except Exception as e:  # a bad plot must not lose the table (reported as skipped)
            why = f"plot failed: {type(e).__name__}: {e}"
        if why is None:
            plots[name] = path
        else:
            path.unlink(missing_ok=True)  # never leave a stale PNG from an earlier report
            skipped[name] = why
    return plots, skipped


def log_to_wandb(rep, mode: str) -> str | None:
    """Log the table and PNGs to a new wandb run; returns an error string (and warns) instead of raising."""
    try:
        import wandb

        run = wandb.init(project="humanline", job_type="report", mode=mode, dir=str(rep.out_dir),
                         name=f"report-{rep.root.resolve().name}", reinit="finish_previous")
        try:
            # rep.columns: the CSV header, whose varying config keys live in each cell's "config" dict
            rows = [[c["config"][k] if k in c["config"] else c.get(k) for k in rep.columns] for c in rep.cells]
            table = wandb.Table(columns=list(rep.columns), data=rows)
            payload = {"report/table": table}
            for name, path in rep.files.items():
                if name.endswith(".png"):
                    payload[f"report/{name[:-4]}"] = wandb.Image(str(path))
            run.log(payload)
        finally:
            run.finish()
        return None
    except Exception as e:  # any wandb failure is a warning, never a failed report
        msg = f"{type(e).__name__}: {e}"
        print(f"humanline: warning: wandb logging of the report failed: {msg}", file=sys.stderr)
        return msg
