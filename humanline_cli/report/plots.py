"""PNG plots of the labelled runs frame (report/frame.py, groups.label, regimes.with_regimes) and the optional
wandb upload. Config groups of one (task, objective, family) stay apart by their `variant` (and line style)."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pandas as pd

from humanline_cli.core.objectives import PROPERTIES
from humanline_cli.report.frame import curve, humanline_spec, num, points, run_points
from humanline_cli.report.stats import mean_ci
from humanline_cli.schema import HumanlineConfig

FAMILIES = ("offline", "online", "humanline-offline", "humanline-online")
FAMILY_COLORS = dict(zip(FAMILIES, ("tab:blue", "tab:orange", "tab:green", "tab:red")))
LINESTYLES = ("-", "--", ":", "-.")


def order(values, preferred) -> list:
    values = set(values)
    return [v for v in preferred if v in values] + sorted(values - set(preferred))


def _label(family: str, variant: str) -> str:
    return f"{family} ({variant})" if variant else family


def _styles(variants) -> dict:
    return {v: LINESTYLES[i % len(LINESTYLES)] for i, v in enumerate(sorted(set(variants)))}


def eval_curve(run) -> tuple[str, list[tuple[float, float]]]:
    """(metric name, [(wall_s, value)]): the start at 0, every evaluation, the final one at the total."""
    ev = run.summary.get("eval") or {}
    name, col = (("accuracy", "accuracy") if num(ev.get("accuracy")) is not None else
                 ("judge reward", "reward") if num(ev.get("reward_mean")) is not None else ("win rate vs start", "win rate"))
    return name, sorted(curve(run_points(run.summary, run.metrics), col, "wall_s"))


def _panels(pairs, rows: int = 1, size=(5, 4)):
    """One panel per (task, objective), objectives in PROPERTIES order; titles name the task if several."""
    import matplotlib.pyplot as plt

    tasks = sorted({t for t, _ in pairs})
    keys = [(t, o) for t in tasks for o in order({o for tt, o in pairs if tt == t}, PROPERTIES)]
    fig, axes = plt.subplots(rows, len(keys), figsize=(size[0] * len(keys), size[1] * rows), squeeze=False)
    titles = {k: f"{k[0]} / {k[1]}" if len(tasks) > 1 else k[1] for k in keys}
    for row in axes:
        for ax, k in zip(row, keys):
            ax.set_title(titles[k])
            ax.grid(alpha=0.3)
    return fig, [dict(zip(keys, row)) for row in axes], titles


def _legend_once(ax):
    seen = dict(zip(*reversed(ax.get_legend_handles_labels())))
    if seen:
        ax.legend(seen.values(), seen.keys(), fontsize=8)


def _run_lines(runs: list, path: Path, xlabel: str, skip: str, marker=None, ylim=None) -> str | None:
    """One line per run [(run, ys label, [(x, y)])] in its (task, objective) panel, coloured by family; `skip`
    (why the plot is skipped) when no run has a point."""
    runs = [x for x in runs if x[2]]
    if not runs:
        return skip
    fig, (axes,), _ = _panels({(r.task, r.objective) for r, _, _ in runs})
    style = _styles(r.variant for r, _, _ in runs)
    for r, name, pts in runs:
        ax = axes[(r.task, r.objective)]
        ax.plot(*zip(*pts), marker=marker, ms=3, linestyle=style[r.variant],
                color=FAMILY_COLORS.get(r.family, "tab:gray"), alpha=0.8, label=_label(r.family, r.variant))
        ax.set(xlabel=xlabel, ylabel=name, **({"ylim": ylim} if ylim else {}))
    for ax in axes.values():
        _legend_once(ax)
    return save_figure(fig, path)


def plot_eval_vs_wallclock(frame, path: Path) -> str | None:
    return _run_lines([(r, *eval_curve(r)) for r in frame.itertuples()], path, "wall-clock (s)",
                      "no complete run has eval numbers", marker="o")


def plot_unclamped_fraction(frame, path: Path) -> str | None:
    key = "humanline/unclamped_fraction"
    return _run_lines([(r, "unclamped token fraction",
                        sorted((m["step"], m[key]) for m in r.metrics
                               if num(m.get(key)) is not None and num(m.get("step")) is not None))
                       for r in frame.itertuples() if r.humanline], path, "step",
                      "no humanline run logged humanline/unclamped_fraction", ylim=(0, 1.02))


def step_curves(frame, mode: str):
    """Evaluation points of one mode ("greedy" or "sampled") of the runs that evaluated mid-run: one score per
    run and step (the last), with the run's task, objective and regime."""
    pts = points(frame)
    pts = pts[pts.metric == f"{mode} accuracy"].drop_duplicates(["run", "step"], keep="last")
    pts = pts[pts.groupby("run")["run"].transform("size") > 2]  # the start, a mid-run eval, the end
    return pts.join(frame[["task", "objective", "regime"]], on="run")


def plot_eval_vs_step(frame, path: Path) -> str | None:
    """Accuracy against the optimizer step (matched training units), the mean over each regime's seeds at the
    steps all of them evaluated; one panel per objective and eval mode."""
    curves = {m: c for m in ("greedy", "sampled") if len(c := step_curves(frame, m))}
    if not curves:
        return "no complete run has periodic greedy or sampled accuracy (eval.every > 0 on a verifier task)"
    import matplotlib.pyplot as plt

    both = pd.concat(curves.values())
    fig, axes, titles = _panels(set(zip(both.task, both.objective)), len(curves), (6, 4.5))
    labels, cmap = sorted(set(frame["regime"])), plt.get_cmap("tab20")
    for row, (mode, pts) in zip(axes, curves.items()):
        for key, ax in row.items():
            ax.set_title(f"{titles[key]}, {mode} accuracy")
            ax.set_xlabel("optimizer step (matched training units)")
            mine = pts[(pts.task == key[0]) & (pts.objective == key[1])]
            for lab, g in mine.groupby("regime", sort=True):
                wide = g.pivot(index="step", columns="run", values="value").dropna()  # steps all evaluated
                k = labels.index(lab)
                ax.plot(wide.index.astype(int), wide.mean(axis=1), marker="o", ms=3, color=cmap(k % 20), alpha=0.85,
                        linestyle=LINESTYLES[k // 10 % len(LINESTYLES)], label=f"{lab} (n={wide.shape[1]})")
            ax.legend(fontsize=7, ncol=2)
    return save_figure(fig, path)


def plot_final_scores(frame, path: Path) -> str | None:
    """Each regime's last-step score per seed, a grey line joining one seed's runs (the pairing of the paired
    comparisons), the mean with its 95% t-interval in black, the start dotted; a panel per objective and score."""
    pts = points(frame).join(frame[["task", "objective", "regime", "family", "humanline", "seed"]], on="run")
    final = pts[pts.point == "final"]
    scores = {m: name for m, name in (("greedy accuracy", "greedy"), ("accuracy", "sampled")) if (final.metric == m).any()}
    if not scores or frame.groupby(["task", "objective", "regime"]).size().max() < 2:
        return "no regime has an accuracy over two or more seeds"
    fig, axes, titles = _panels(set(zip(final.task, final.objective)), len(scores), (1.6 + 1.1 * final.regime.nunique(), 4))
    for row, (m, name) in zip(axes, scores.items()):
        for key, ax in row.items():
            panel = pts[(pts.task == key[0]) & (pts.objective == key[1]) & (pts.metric == m)]
            mine = panel[panel.point == "final"]
            # each data regime plain, then with humanline: the pairs a reader compares stand side by side
            rank = {r.regime: (r.family.removeprefix("humanline-"), bool(r.humanline), r.regime) for r in mine.itertuples()}
            regimes = sorted(rank, key=rank.get)
            wide = mine.pivot_table(index="seed", columns="regime", values="value", aggfunc="last")[regimes]
            for seed_row in wide.to_numpy():
                ax.plot(range(len(regimes)), seed_row, color="tab:gray", alpha=0.5, marker="o", ms=3)
            for i, r in enumerate(regimes):
                ci = mean_ci(wide[r].dropna())
                if ci and ci["lo"] is not None:
                    ax.errorbar(i + 0.12, ci["mean"], yerr=[[ci["mean"] - ci["lo"]], [ci["hi"] - ci["mean"]]],
                                fmt="s", color="black", capsize=3)
            ax.axhline(panel[panel.point == "start"].value.mean(), color="tab:gray", linestyle=":", label="start")
            ax.set_xticks(range(len(regimes)), regimes, rotation=20, fontsize=8)
            ax.set(title=f"{titles[key]}, {name} accuracy", ylabel=f"{name} accuracy at the last step")
    return save_figure(fig, path)


def late_histogram(run) -> list[float] | None:
    """The counts summed over the last 25% of the run's logged histogram steps (at least one)."""
    rows = sorted((r for r in run.logratios if isinstance(r.get("counts"), list)), key=lambda r: r.get("step", 0))
    if not rows:
        return None
    late = rows[len(rows) - max(1, math.ceil(len(rows) / 4)):]
    n = len(late[0]["counts"])
    return [sum(float(r["counts"][i]) for r in late if len(r["counts"]) == n) for i in range(n)]


def plot_logratio_hist(frame, path: Path) -> str | None:
    """Token log-ratio densities per config group (its seeds summed), the clamp band of its humanline spec."""
    hists, meta, bands = {}, {}, {}
    for r in frame.itertuples():
        h = late_histogram(r)
        if h is None:
            continue
        key = (r.task, r.objective, r.family, r.variant)
        hists[key] = h if key not in hists else [a + b for a, b in zip(hists[key], h)]
        meta[key] = (r.logratios[0].get("lo", -3.0), r.logratios[0].get("hi", 3.0))
        if r.humanline:  # the band of the run's humanline spec
            spec = humanline_spec(r.config, True)
            bands.setdefault((r.task, r.objective), (spec.log_eps_P, spec.log_eps_R))
    if not hists:
        return "no run wrote logratios.jsonl"
    fig, (axes,), _ = _panels({k[:2] for k in hists})
    rank = {f: i for i, f in enumerate(FAMILIES)}
    style = _styles(k[3] for k in hists)
    for key, h in sorted(hists.items(), key=lambda kv: (kv[0][:2], rank.get(kv[0][2], 99), kv[0][2:])):
        (lo, hi), total, inner = meta[key], sum(h) or 1.0, h[1:-1]
        width = (hi - lo) / len(inner)
        axes[key[:2]].stairs([c / total / width for c in inner], [lo + i * width for i in range(len(inner) + 1)],
                             color=FAMILY_COLORS.get(key[2], "tab:gray"), linestyle=style[key[3]], linewidth=1.5,
                             label=f"{_label(key[2], key[3])} (out of range {(h[0] + h[-1]) / total:.1%})")
    default = HumanlineConfig()
    for key, ax in axes.items():
        ax.set(xlabel="token log-ratio log π/π_ref (last 25% of logged steps)", ylabel="density")
        band = bands.get(key, (default.log_eps_P, default.log_eps_R))
        for x in band:
            ax.axvline(x, color="black", linestyle="--", linewidth=1)
        ax.text(band[1], ax.get_ylim()[1] * 0.95, " clamp band", fontsize=8, va="top")
        _legend_once(ax)
    return save_figure(fig, path)


def save_figure(fig, path: Path, dpi: int = 100) -> None:
    """Write and close the figure; plot functions return this None, meaning "not skipped"."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def make_plots(frame, out_dir: Path) -> tuple[dict, dict]:
    import matplotlib

    matplotlib.use("Agg", force=True)
    plots, skipped = {}, {}
    for name, fn in (("eval_vs_wallclock.png", plot_eval_vs_wallclock), ("eval_vs_step.png", plot_eval_vs_step),
                     ("final_scores.png", plot_final_scores),
                     ("unclamped_fraction.png", plot_unclamped_fraction), ("logratio_hist.png", plot_logratio_hist)):
        path = out_dir / name
        try:
            why = fn(frame, path)
        except Exception as e:  # a bad plot must not lose the table (reported as skipped)
            why = f"plot failed: {type(e).__name__}: {e}"
        if why is None:
            plots[name] = path
        else:
            path.unlink(missing_ok=True)  # never a stale PNG from an earlier report
            skipped[name] = why
    return plots, skipped


def log_to_wandb(rep, mode: str) -> str | None:
    """Log the table and PNGs to a new wandb run; a failure is a warning (returned), never a failed report."""
    try:
        import wandb

        run = wandb.init(project="humanline", job_type="report", mode=mode, dir=str(rep.out_dir),
                         name=f"report-{rep.root.resolve().name}", reinit="finish_previous")
        try:
            table = rep.cells.reindex(columns=list(rep.columns)).astype(object)
            rows = table.where(table.notna(), None).to_numpy().tolist()
            run.log({"report/table": wandb.Table(columns=list(rep.columns), data=rows),
                     **{f"report/{name[:-4]}": wandb.Image(str(p)) for name, p in rep.files.items()
                        if name.endswith(".png")}})
        finally:
            run.finish()
        return None
    except Exception as e:
        msg = f"{type(e).__name__}: {e}"
        print(f"humanline: warning: wandb logging of the report failed: {msg}", file=sys.stderr)
        return msg
