"""The paper's question per comparison set (groups.comparison_sets: groups whose configs agree outside the
family-defining keys): how much of the offline -> online gap does humanline-offline close, at what wall-clock?
GAP_NOTE, printed above the table, says how each number is computed.
"""
from __future__ import annotations

import json
import statistics
import textwrap
from pathlib import Path

import pandas as pd

from humanline_cli.report.frame import METRICS, WORK, ci_text, column, common_metric, curve, md_table, points, seconds
from humanline_cli.report.groups import comparison_sets, differing_keys, hl_settings
from humanline_cli.report.plots import save_figure
from humanline_cli.report.stats import equivalence, fieller, km_median, mean_ci, paired_t, prompt_bootstrap

ARMS = ("offline", "online", "humanline-offline")
# a - b: the humanline effect, what is left to online, the gap
CONTRASTS = (("humanline-offline", "offline"), ("online", "humanline-offline"), ("online", "offline"))
SAMPLES = {"greedy accuracy": "eval_samples_greedy.jsonl", "accuracy": "eval_samples.jsonl"}


def gap_closed_paired(offline: list, online: list, humanline: list, gap_interval: tuple | None = None) -> dict:
    """Scores per seed, paired by index: the ratio of means with Fieller's interval where the gap's t-interval
    lies above 0 (`verdict` "gap"); else "unbounded" (it reaches 0) or "online below", with no ratio. One seed:
    `gap_interval`, a prompt bootstrap of the gap, decides, and the ratio has no interval."""
    gap = paired_t(online, offline)
    lo, hi = gap_interval if gap["n"] == 1 and gap_interval is not None else (gap["lo"], gap["hi"])
    verdict = "gap" if lo is not None and lo > 0 else "online below" if hi is not None and hi < 0 else "unbounded"
    out = {"gap": {**gap, "lo": lo, "hi": hi}, "verdict": verdict, "n": gap["n"], "mean": None, "lo": None, "hi": None}
    if verdict == "gap":
        f = fieller([h - o for h, o in zip(humanline, offline)], [n - o for n, o in zip(online, offline)])
        out.update(mean=f["ratio"], lo=f["lo"], hi=f["hi"])
    return out


def gap_text(g: dict) -> str:
    if g.get("verdict", "gap") != "gap":
        return g["verdict"]
    if g["mean"] is None:
        return "–"
    return f"{g['mean']:.0%}" + (f" [{g['lo']:.0%}, {g['hi']:.0%}]" if g["lo"] is not None else "")


def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    """The time at which the curve first reaches `target`, linear between points; None if never."""
    for i, (t, v) in enumerate(curve):
        if v >= target:
            t0, v0 = curve[i - 1] if i else (t, v)
            return t if not i else t0 + (t - t0) * (target - v0) / (v - v0)
    return None


def km_to(curves: list, target: float) -> dict:
    """How many curves reach `target` and the Kaplan-Meier median time to it, a curve short of it censored at
    its last point."""
    times = [time_to(c, target) for c in curves]
    hit = [t is not None for t in times]
    return {"median": km_median([c[-1][0] if t is None else t for c, t in zip(curves, times)], hit),
            "reached": sum(hit), "n": len(hit)}


# the share of online's mean gain over the start that a matched-quality target asks for
TARGET_GAIN = 0.9


def gain_target(online: list) -> tuple[float, float, float]:
    """(start, final, target) from online's learning curves (empty ones left out): the means of their first and
    last scores, and start + TARGET_GAIN x (final - start). It reads online's means only, so no compared regime
    sets its own bar (a target at a regime's own mean final leaves about half its seeds short of it)."""
    start, final = (statistics.fmean(c[i][-1] for c in online if c) for i in (0, -1))
    return start, final, start + TARGET_GAIN * (final - start)


def equal_quality(online: dict, humanline: dict) -> dict:
    """Each maps seed -> learning curve. The target is gain_target's, from online's curves; per regime the
    Kaplan-Meier median work time to it; `speedup` online's over humanline's; `never`: online seeds short of it."""
    out: dict = {"target": gain_target(list(online.values()))[2]}
    for name, curves in (("online", online), ("humanline-offline", humanline)):
        out[name] = km_to(list(curves.values()), out["target"])
    on, hl = out["online"]["median"], out["humanline-offline"]["median"]
    return {**out, "speedup": on / hl if on is not None and hl else None,
            "never": out["online"]["n"] - out["online"]["reached"]}


def gap_rows(runs: pd.DataFrame, ignore=()) -> pd.DataFrame:
    """One row per comparison of complete runs: an online group, a baseline and a humanline group on its data."""
    pts, rows = points(runs), []
    for task, objective, set_label, members in comparison_sets(runs, ignore):
        fams: dict[str, list] = {}
        for g in members:
            fams.setdefault(g.family, []).append(g)
        for base, hl_group, hl_label in _comparisons(fams):
            groups = {"offline": fams[base][0], "online": fams["online"][0], "humanline-offline": hl_group}
            arms = pd.concat([runs.loc[g.members].assign(arm=arm) for arm, g in groups.items()])
            arms = arms[~arms.duplicated(["arm", "seed"], keep="last")]  # a seed's runs in ignored keys are one
            label = ", ".join(x for x in (set_label, "" if base == "offline" else base, hl_label) if x)
            rows.append(_gap_row(task, objective, label, arms, pts))
    return pd.DataFrame([r for r in rows if r], columns=ROW, dtype=object)


def _comparisons(fams: dict) -> list[tuple]:
    """(baseline, humanline group, label): the baseline offline, `stale-K` or `async-L`, each against the one online
    group and every `humanline-<baseline>` group, told apart by the hl.* keys that differ. Ambiguity gives none."""
    if len(fams.get("online", [])) != 1:
        return []
    out = []
    for base in sorted(f for f in fams if f == "offline" or f.startswith(("stale-", "async-"))):
        hls = fams.get(f"humanline-{base}", [])
        if len(fams[base]) != 1:
            continue
        differ = differing_keys([hl_settings(g) for g in hls]) if len(hls) > 1 else set()
        out += [(base, g, ", ".join(f"{k}={(g.cfg or {}).get(k)}" for k in sorted(differ))) for g in hls]
    return out


def _gap_row(task: str, objective: str, label: str, arms: pd.DataFrame, pts: pd.DataFrame) -> dict | None:
    metric = common_metric(arms["summary"])
    scores = arms.reindex(columns=["arm", "seed", *METRICS.values()]).rename(columns={v: k for k, v in METRICS.items()})
    wide = scores.pivot(index="seed", columns="arm", values=metric).reindex(columns=list(ARMS)).astype(float)
    if not wide.notna().any().all():
        return None
    paired_seeds = wide.dropna().sort_index(key=lambda s: s.map(str))
    curves = {a: {r.seed: curve(pts[pts.run == i], metric) for i, r in arms[arms.arm == a].iterrows()}
              for a in ARMS[1:]}
    mid = all(len(c) > 2 for a in curves for c in curves[a].values())  # at least one mid-run evaluation
    paired = {}
    for mode in SAMPLES:
        both = scores.pivot(index="seed", columns="arm", values=mode).astype(float).reindex(paired_seeds.index)
        if len(both) and both.notna().all().all():
            runs_by_arm = {a: [arms[(arms.arm == a) & (arms.seed == s)].iloc[0] for s in both.index] for a in ARMS}
            paired[mode] = paired_differences({a: both[a].tolist() for a in ARMS}, prompt_scores(runs_by_arm, mode))
    gap_interval = None
    if len(paired_seeds) == 1 and metric in paired:  # one seed: the prompt bootstrap decides the gap
        boot = next(p["boot"] for p in paired[metric] if p["contrast"] == ("online", "offline"))
        gap_interval = (boot["lo"], boot["hi"]) if boot else None
    wall = column(arms, "wall_clock_s.total").groupby(arms.arm).mean().dropna()
    on_wall, hl_wall = (float(wall[a]) if a in wall else None for a in ARMS[1:])
    shares = arms[arms.arm == "online"]["summary"].map(sampling_share).dropna()
    share = statistics.fmean(shares) if len(shares) else None
    closed = gap_closed_paired(*(paired_seeds[a].tolist() for a in ARMS), gap_interval)
    equal = equal_quality(curves["online"], curves["humanline-offline"]) if mid else None
    return {"task": task, "objective": objective, "set": label, "metric": metric,
            **{a.replace("-", "_"): float(wide[a].mean()) for a in ARMS},
            "gap_closed": closed["mean"], "gap_closed_lo": closed["lo"], "gap_closed_hi": closed["hi"],
            "n_seeds": closed["n"], **{f"gap{s}": closed["gap"][k] for k, s in (("mean", ""), ("lo", "_lo"), ("hi", "_hi"))},
            "gap_verdict": closed["verdict"], "online_wall_s": on_wall, "humanline_offline_wall_s": hl_wall,
            "speedup": on_wall / hl_wall if on_wall and hl_wall else None,
            "speedup_equal_quality": equal and equal["speedup"], "online_never_reached": equal and equal["never"],
            "equal_text": "n/a" if not equal else ("–" if equal["speedup"] is None else f"{equal['speedup']:.2f}x")
            + " (reached: " + ", ".join(f"{n} {equal[a]['reached']} of {equal[a]['n']}" for a, n in
                                        (("online", "online"), ("humanline-offline", "humanline"))) + ")",
            "scores": {a: {m: mean_ci(scores[scores.arm == a][m].dropna().astype(float)) for m in METRICS}
                       for a in ARMS},
            "online_sampling_share": share,
            "speedup_bound_matched": None if share is None or share >= 1 else 1 / (1 - share),
            "paired": [{**p, "metric": m} for m, rows in paired.items() for p in rows]}


def sampling_share(summary: dict) -> float | None:
    """The part of the work seconds spent producing data (sample + label + push)."""
    times = summary.get("wall_clock_s") or {}
    work = seconds(times, WORK)
    return seconds(times, ("sample", "label", "push")) / work if work > 0 else None


def paired_differences(arms: dict, per_prompt: dict | None = None) -> list[dict]:
    """Per contrast (a, b): a - b with a t-interval across seeds (`t`, paired by index) and a prompt-level
    bootstrap over `per_prompt`'s (seeds x prompts) scores (`boot`; None without them)."""
    return [{"contrast": (a, b), "t": paired_t(arms[a], arms[b]),
             "boot": prompt_bootstrap(per_prompt[a], per_prompt[b]) if per_prompt else None} for a, b in CONTRASTS]


def prompt_scores(runs_by_arm: dict, metric: str) -> dict | None:
    """{arm: (seeds x prompts)} from each run's eval samples, over the prompts every run scored; None when a run
    lacks the file or no prompt is shared."""
    table = {}
    for arm, runs in runs_by_arm.items():
        table[arm] = []
        for run in runs:
            f = Path(run["path"]) / SAMPLES[metric]
            if not f.is_file():
                return None
            rows = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
            table[arm].append({r["prompt"]: float(r["policy_score"]) for r in rows if r.get("policy_score") is not None})
    common = sorted(set.intersection(*(set(d) for runs in table.values() for d in runs)))
    return {arm: [[d[p] for p in common] for d in runs] for arm, runs in table.items()} if common else None


CSV_COLUMNS = ("task", "objective", "set", "metric", "offline", "online", "humanline_offline", "gap_closed",
               "gap_closed_lo", "gap_closed_hi", "n_seeds", "gap", "gap_lo", "gap_hi", "gap_verdict", "online_wall_s",
               "humanline_offline_wall_s", "speedup", "speedup_equal_quality", "online_never_reached",
               "online_sampling_share", "speedup_bound_matched")
# a comparison's row: gap_closed.csv's columns, the at-equal-quality cell, each arm's mean_ci per metric
# (`scores`), paired_differences' rows (`paired`), and a regime sweep's `regime` and `compared_with`
ROW = (*CSV_COLUMNS, "equal_text", "scores", "paired", "regime", "compared_with")
# speeds and shares to 4 significant digits, the other numbers to 6, wall-clock in full
DIGITS = {c: 4 if c.startswith(("speedup", "online_sampling")) else 6 for c in CSV_COLUMNS if not c.endswith("wall_s")}


MODES = {"greedy accuracy": "greedy", "accuracy": "sampled"}


def gap_frame(rows: pd.DataFrame, margin: float | None = None) -> pd.DataFrame:
    """gap_closed.csv: one row per comparison; with `margin`, per metric and contrast a - b the 90% paired
    t-interval and the equivalence verdict at +-margin (stats.equivalence), "n/a" without such paired scores."""
    frame = rows[list(CSV_COLUMNS)].astype(object)
    if margin is None:
        return frame
    out = []
    for paired in rows["paired"]:
        got = {(p["metric"], p["contrast"]): equivalence(p["t"]["diffs"], margin) for p in paired or []}
        row: dict = {"equivalence_margin": margin}
        for (metric, mode), (a, b) in ((m, c) for m in MODES.items() for c in CONTRASTS):
            e = got.get((metric, (a, b)), {"lo": None, "hi": None, "verdict": "n/a"})
            name = f"{mode}_{a}_minus_{b}".replace("-", "_")
            row |= {f"{name}_lo90": e["lo"], f"{name}_hi90": e["hi"], f"{name}_equivalence": e["verdict"]}
        out.append(row)
    return pd.concat([frame, pd.DataFrame(out, index=rows.index, dtype=object)], axis=1)


GAP_NOTE = ("gap closed = mean(humanline-offline - offline) / mean(online - offline) over seeds paired by seed (a "
            "ratio of means) [95% Fieller interval from the seed-level covariance], given only where the gap online - "
            "offline has a 95% t-interval across seeds wholly above 0, else `unbounded` (the gap's interval reaches "
            "0, so the ratio's has no finite bounds) or `online below`; one seed: no interval, the gap decided by a "
            "prompt-level bootstrap (prompt-level only). "
            "speedup = online wall-clock / humanline-offline wall-clock at equal "
            "steps; at equal quality = online's work time to a target / humanline-offline's, the target start + 0.9 x "
            "(online's mean final score - start) as in the matched-quality section (online's means only, so "
            "no regime sets its own bar), each the Kaplan-Meier median over seeds (a seed that never reaches it "
            "is censored at its run's end; `–`: fewer than half reached it), with how many seeds of each reached "
            "it (learning curves; n/a without mid-run evals, eval.every); online sampling = "
            "share of online's work time spent sampling, labelling and pushing weights, and the speedup it bounds: "
            "1 / (1 - share) is the most any offline run can save against online on the same sequences per step.")


def _num(x) -> float | None:
    """A number from a row of gap_closed.csv (text, empty or NaN) or of gap_frame."""
    try:
        return None if x is None or float(x) != float(x) else float(x)
    except ValueError:
        return None


def gap_cells(r: dict) -> list:
    """metric ... online sampling (bound): the table cells of one row of gap_closed.csv's columns (a row of
    gap_frame, or one read back as text); `equal_text`, where present, is the at-equal-quality cell."""
    def speed(key):
        return "n/a" if not _num(r.get(key)) else f"{_num(r[key]):.2f}x"

    gap = {"verdict": r.get("gap_verdict") or "gap", **{k: _num(r[f"gap_closed{s}"]) for k, s in
                                                         (("mean", ""), ("lo", "_lo"), ("hi", "_hi"))}}
    share, bound = _num(r.get("online_sampling_share")), _num(r.get("speedup_bound_matched"))
    return [r["metric"], *(f"{_num(r[k]):.3f}" for k in ("offline", "online", "humanline_offline")), gap_text(gap),
            r["n_seeds"], speed("speedup"), r.get("equal_text") or speed("speedup_equal_quality"),
            "n/a" if share is None or bound is None else f"{share:.0%} ({bound:.2f}x)"]


GAP_HEAD = ["metric", "offline", "online", "humanline-offline", "gap closed", "seeds"]


def markdown(rows: pd.DataFrame) -> list[str]:
    if rows.empty:
        return ["No comparison set has offline, online and humanline-offline runs: no gap to report.", ""]
    lines = [GAP_NOTE, "", *md_table(["task", "objective", "set", *GAP_HEAD, "speedup", "at equal quality",
                                      "online sampling (bound)"],
                                     [(r["task"], r["objective"], r["set"] or "–", *gap_cells(r))
                                      for r in rows.to_dict("records")]), ""]
    modes = (("greedy accuracy", "greedy"), ("accuracy", "sampled"), ("win rate", "sampled win rate"))
    scores = [(r, name, [(r.scores or {}).get(a, {}).get(mode) for a in ARMS]) for r in rows.itertuples()
              for mode, name in modes if mode != "win rate" or r.metric == "win rate"]
    return lines + ["Scores per family, mean [95% t-interval across seeds]: greedy accuracy (temperature 0) and sampled "
                    "accuracy (eval.temperature), or the sampled win rate against the starting policy where the task "
                    "has no accuracy.", "",
                    *md_table(["task", "objective", "set", "mode", *ARMS],
                              [(r.task, r.objective, r.set or "–", name, *map(ci_text, cells))
                               for r, name, cells in scores if any(c is not None for c in cells)]), ""]


def paired_markdown(rows: pd.DataFrame, margin: float | None = None) -> list[str]:
    body = [r for r in rows.itertuples() if r.paired]
    if not body:
        return ["No comparison has paired runs.", ""]
    tost = [] if margin is None else [
        f"Equivalence within +-{margin:g} (two one-sided t-tests at alpha 0.05): the 90% t-interval across seeds, "
        f"`equivalent within +-{margin:g}` when it lies inside [-{margin:g}, +{margin:g}], else `not shown "
        "equivalent`; `n/a` below two seeds.", ""]
    lines = tost + ["a - b per seed (runs paired by seed), mean [95% t-interval across seeds: the reported interval] and "
             "[95% prompt-level bootstrap: the eval prompts resampled, 2000 replicates, the seeds held fixed, so it "
             "leaves out seed-to-seed variation and is narrower than the truth when seeds differ]; `–`: no interval "
             "(one seed, or no per-prompt samples). greedy = temperature 0, sampled = eval.temperature.", ""]

    def interval(x) -> str:
        return f"[{x['lo']:+.3f}, {x['hi']:+.3f}]" if x and x["lo"] is not None else "–"

    def equiv(p) -> tuple:
        e = equivalence(p["t"]["diffs"], margin)
        return interval(e), e["verdict"]

    return lines + md_table(["task", "objective", "set", "metric", "a - b", "mean", "t-interval",
                             "bootstrap (prompt-level only)", "seeds",
                             *([] if margin is None else ["90% t-interval", f"equivalence (+-{margin:g})"])],
                            [(r.task, r.objective, r.set or "–", MODES.get(p["metric"], p["metric"]),
                              " - ".join(p["contrast"]), f"{p['t']['mean']:+.3f}", interval(p["t"]), interval(p["boot"]),
                              p["t"]["n"], *(() if margin is None else equiv(p))) for r in body for p in r.paired]) + [""]


def plot(table: pd.DataFrame, path, regimes: bool = False) -> bool:
    """Gap closed with its interval per comparison (rows of gap_closed.csv's columns); `regimes`: one bar per
    regime, grouped and coloured by objective in PROPERTIES order. False when no row has a ratio."""
    from humanline_cli.core.objectives import PROPERTIES

    rows = [r for r in table.to_dict("records") if _num(r["gap_closed"]) is not None]
    if regimes:
        rank = {o: i for i, o in enumerate(PROPERTIES)}
        rows.sort(key=lambda r: rank.get(r["objective"], len(rank)))
    elif not rows:
        return False
    labels = [f"{r['objective']}\n" + "\n".join(textwrap.wrap(r["regime"], 16)) if regimes else
              f"{r['task']}/{r['objective']}" + (f"\n{r['set']}" if r["set"] else "") for r in rows]
    colors = [f"C{list(PROPERTIES).index(r['objective'])}" if r["objective"] in PROPERTIES else "grey"
              for r in rows] if regimes else None
    bar_chart(labels, [tuple(_num(r[f"gap_closed{s}"]) for s in ("", "_lo", "_hi")) for r in rows], path, colors)
    return True


def bar_chart(labels: list[str], values: list[tuple], path, colors: list[str] | None = None) -> None:
    """Gap closed per bar, (mean, lo, hi) each (lo/hi None: no interval), 0 and 1 marked; more than ten bars
    lie one per row, top to bottom in the given order (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    v = pd.DataFrame(values, columns=["m", "lo", "hi"], dtype=float)
    # clip(0): a zero-width interval can sit a rounding error off its own mean
    err = [(v.m - v.lo.fillna(v.m)).clip(lower=0), (v.hi.fillna(v.m) - v.m).clip(lower=0)]
    wide, n, name = len(v) <= 10, range(len(v)), "gap closed by humanline-offline"
    fig, ax = plt.subplots(figsize=(max(4, 1.3 * len(v) + 2), 4.0) if wide else (8.0, 0.32 * len(v) + 1.4))
    if wide:
        ax.bar(n, v.m, yerr=err, capsize=4, color=colors or "#4c72b0")
        ax.set(xticks=list(n), ylabel=name)
        ax.set_xticklabels(labels, fontsize=7)
    else:
        ax.barh(n, v.m, xerr=err, capsize=3, color=colors or "#4c72b0")
        ax.set(yticks=list(n), xlabel=name)
        ax.set_yticklabels([label.replace("\n", " ") for label in labels], fontsize=7)
        ax.invert_yaxis()
    for x, style in ((0, {"color": "black"}), (1, {"color": "grey", "ls": "--"})):
        (ax.axhline if wide else ax.axvline)(x, lw=0.8, **style)
    ax.set_title("mean(humanline-offline - offline) / mean(online - offline), 95% Fieller interval")
    save_figure(fig, path, dpi=120)
