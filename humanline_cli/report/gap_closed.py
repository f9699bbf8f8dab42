"""The paper's question per comparison set (groups.comparison_sets: groups whose configs agree outside the
family-defining keys): how much of the offline -> online gap does humanline-offline close, at what wall-clock?
GAP_NOTE, printed above the table, says how each number is computed.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from humanline_cli.mdtable import md_table
from humanline_cli.report.frame import METRICS, WORK, ci_text, column, common_metric, curve, points, read_jsonl, seconds
from humanline_cli.report.groups import comparison_sets, differing_keys, hl_settings, plain
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
    start, final = (float(np.mean([c[i][-1] for c in online if c])) for i in (0, -1))
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


def gap_rows(runs: pd.DataFrame, ignore=(), margin: float | None = None) -> pd.DataFrame:
    """One row per comparison of complete runs (an online group, a baseline and a humanline group on its data):
    gap_closed.csv's columns, the at-equal-quality cell, each arm's mean and t-interval per metric (score_*) and
    each paired contrast's (paired_columns); with `margin`, the equivalence columns of gap_frame."""
    pts, rows = points(runs), []
    for task, objective, set_label, members in comparison_sets(runs, ignore):
        fams = {f: _plain(f, g) for f, g in members.groupby("family", sort=False)}
        for base, hl_group, hl_label in _comparisons(fams):
            groups = {"offline": fams[base].iloc[0], "online": fams["online"].iloc[0], "humanline-offline": hl_group}
            arms = pd.concat([runs.loc[g.members].assign(arm=arm) for arm, g in groups.items()])
            arms = arms[~arms.duplicated(["arm", "seed"], keep="last")]  # a seed's runs in ignored keys are one
            label = ", ".join(x for x in (set_label, "" if base == "offline" else base, hl_label) if x)
            rows.append(_gap_row(task, objective, label, arms, pts[pts.run.isin(arms.index)], margin))
    rows = [r for r in rows if r]
    return pd.DataFrame(rows, dtype=object) if rows else pd.DataFrame(columns=ROW, dtype=object)


def _comparisons(fams: dict) -> list[tuple]:
    """(baseline, humanline group, label): the baseline offline, `stale-K` or `async-L`, each against the one online
    group and every `humanline-<baseline>` group, told apart by the hl.* keys that differ. Ambiguity gives none."""
    if len(fams.get("online", ())) != 1:
        return []
    out = []
    for base in sorted(f for f in fams if f == "offline" or f.startswith(("stale-", "async-"))):
        hls = fams.get(f"humanline-{base}", pd.DataFrame(columns=["cfg", "members"]))
        if len(fams[base]) != 1:
            continue
        differ = differing_keys([hl_settings(g) for g in hls.itertuples()]) if len(hls) > 1 else set()
        out += [(base, g, ", ".join(f"{k}={(g.cfg or {}).get(k)}" for k in sorted(differ))) for g in hls.itertuples()]
    return out


def _plain(family: str, groups: pd.DataFrame) -> pd.DataFrame:
    """A data regime's groups that differ in the stale-data correction are compared here by their plain one
    (groups.plain: correction=none; report/correction_contrasts.py compares the corrections); humanline's families
    stay as they are."""
    return groups if family.startswith("humanline-") else groups[plain(groups.cfg)]


def _col(*parts: str) -> str:
    return "_".join(parts).replace("-", "_").replace(" ", "_")


def _gap_row(task: str, objective: str, label: str, arms: pd.DataFrame, pts: pd.DataFrame, margin) -> dict | None:
    metric = common_metric(arms["summary"])
    final = pts[pts.point == "final"].join(arms[["arm", "seed"]], on="run")
    wide = final.pivot(index="seed", columns=["metric", "arm"], values="value").astype(float)
    if metric not in wide or not wide[metric].reindex(columns=list(ARMS)).notna().any().all():
        return None
    paired_seeds = wide[metric][list(ARMS)].dropna().sort_index(key=lambda s: s.map(str))
    curves = {a: {seed: curve(pts[pts.run == i], metric) for i, seed in zip(g.index, g.seed)}
              for a, g in arms[arms.arm != "offline"].groupby("arm", sort=False)}
    mid = all(len(c) > 2 for a in curves for c in curves[a].values())  # at least one mid-run evaluation
    paths, paired = arms.set_index(["arm", "seed"])["path"], {}
    for mode in SAMPLES:
        both = wide.get(mode, pd.DataFrame()).reindex(index=paired_seeds.index, columns=list(ARMS))
        if len(both) and both.notna().all().all():
            per_prompt = prompt_scores({a: [paths[(a, s)] for s in both.index] for a in ARMS}, mode)
            paired |= paired_columns(mode, both, per_prompt, margin)
    boot = [paired.get(_col(MODES.get(metric, ""), "online_minus_offline", k)) for k in ("boot_lo", "boot_hi")]
    gap_interval = tuple(boot) if len(paired_seeds) == 1 and boot[0] is not None else None  # one seed: bootstrap
    wall = column(arms, "wall_clock_s.total").groupby(arms.arm).mean().dropna()
    on_wall, hl_wall = (float(wall[a]) if a in wall else None for a in ARMS[1:])
    shares = arms[arms.arm == "online"]["summary"].map(sampling_share).dropna()
    share = float(shares.mean()) if len(shares) else None
    closed = gap_closed_paired(*(paired_seeds[a].tolist() for a in ARMS), gap_interval)
    equal = equal_quality(curves["online"], curves["humanline-offline"]) if mid else None
    scores = {key: mean_ci(g.value) for key, g in final.groupby(["metric", "arm"])}
    return {"task": task, "objective": objective, "set": label, "metric": metric,
            **{_col(a): float(wide[metric][a].mean()) for a in ARMS},
            "gap_closed": closed["mean"], "gap_closed_lo": closed["lo"], "gap_closed_hi": closed["hi"],
            "n_seeds": closed["n"], **{f"gap{s}": closed["gap"][k] for k, s in (("mean", ""), ("lo", "_lo"), ("hi", "_hi"))},
            "gap_verdict": closed["verdict"], "online_wall_s": on_wall, "humanline_offline_wall_s": hl_wall,
            "speedup": on_wall / hl_wall if on_wall and hl_wall else None,
            "speedup_equal_quality": equal and equal["speedup"], "online_never_reached": equal and equal["never"],
            "equal_text": "n/a" if not equal else ("–" if equal["speedup"] is None else f"{equal['speedup']:.2f}x")
            + " (reached: " + ", ".join(f"{n} {equal[a]['reached']} of {equal[a]['n']}" for a, n in
                                        (("online", "online"), ("humanline-offline", "humanline"))) + ")",
            "online_sampling_share": share,
            "speedup_bound_matched": None if share is None or share >= 1 else 1 / (1 - share),
            **{_col("score", m, a, k): (scores.get((m, a)) or {}).get(k) for m in METRICS for a in ARMS
               for k in ("mean", "lo", "hi")}, **paired, **({} if margin is None else {"equivalence_margin": margin})}


def sampling_share(summary: dict) -> float | None:
    """The part of the work seconds spent producing data (sample + label + push)."""
    times = summary.get("wall_clock_s") or {}
    work = seconds(times, WORK)
    return seconds(times, ("sample", "label", "push")) / work if work > 0 else None


def paired_columns(mode: str, both: pd.DataFrame, per_prompt: dict | None = None, margin: float | None = None) -> dict:
    """Per contrast (a, b) of `both` (seeds x arms, paired by row) a - b: its mean, 95% t-interval and seeds
    (`<mode>_<a>_minus_<b>_mean` ...), a prompt-level bootstrap over `per_prompt`'s (seeds x prompts) scores
    (`_boot_lo`, `_boot_hi`; None without them) and, with `margin`, the 90% interval and verdict of equivalence."""
    out = {}
    for a, b in CONTRASTS:
        name, t = _col(MODES[mode], a, "minus", b), paired_t(both[a].tolist(), both[b].tolist())
        boot = prompt_bootstrap(per_prompt[a], per_prompt[b]) if per_prompt else {}
        out |= {f"{name}_{k}": t[k] for k in ("mean", "lo", "hi", "n")}
        out |= {f"{name}_boot_lo": boot.get("lo"), f"{name}_boot_hi": boot.get("hi")}
        if margin is not None:
            e = equivalence(t["diffs"], margin)
            out |= {f"{name}_lo90": e["lo"], f"{name}_hi90": e["hi"], f"{name}_equivalence": e["verdict"]}
    return out


def prompt_scores(paths: dict, metric: str) -> dict | None:
    """{arm: (seeds x prompts)} from each run dir's (`paths[arm]`) eval samples, over the prompts every run scored;
    None when a run lacks the file or no prompt is shared."""
    files = {arm: [Path(d) / SAMPLES[metric] for d in dirs] for arm, dirs in paths.items()}
    if not all(f.is_file() for fs in files.values() for f in fs):
        return None
    table = {arm: [{r["prompt"]: float(r["policy_score"]) for r in read_jsonl(f) if r.get("policy_score") is not None}
                   for f in fs] for arm, fs in files.items()}
    common = sorted(set.intersection(*(set(d) for runs in table.values() for d in runs)))
    return {arm: [[d[p] for p in common] for d in runs] for arm, runs in table.items()} if common else None


MODES = {"greedy accuracy": "greedy", "accuracy": "sampled"}
CSV_COLUMNS = ("task", "objective", "set", "metric", "offline", "online", "humanline_offline", "gap_closed",
               "gap_closed_lo", "gap_closed_hi", "n_seeds", "gap", "gap_lo", "gap_hi", "gap_verdict", "online_wall_s",
               "humanline_offline_wall_s", "speedup", "speedup_equal_quality", "online_never_reached",
               "online_sampling_share", "speedup_bound_matched")
# gap_closed.csv's columns with --margin: per mode and contrast the 90% interval and the equivalence verdict
MARGIN_COLUMNS = ("equivalence_margin", *(_col(m, a, "minus", b, k) for m in MODES.values() for a, b in CONTRASTS
                                          for k in ("lo90", "hi90", "equivalence")))
ROW = (*CSV_COLUMNS, "equal_text", "regime", "compared_with")  # an empty frame's columns
# speeds and shares to 4 significant digits, the other numbers to 6, wall-clock in full
DIGITS = {c: 4 if c.startswith(("speedup", "online_sampling")) else 6 for c in (*CSV_COLUMNS, *MARGIN_COLUMNS)
          if not c.endswith("wall_s")}


def gap_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """gap_closed.csv: one row per comparison, its columns and, where gap_rows had a margin, MARGIN_COLUMNS (the
    verdict `n/a` where a mode had no paired scores)."""
    if "equivalence_margin" not in rows:
        return rows[list(CSV_COLUMNS)].astype(object)
    out = rows.reindex(columns=[*CSV_COLUMNS, *MARGIN_COLUMNS]).astype(object)
    verdicts = [c for c in MARGIN_COLUMNS if c.endswith("equivalence")]
    return out.assign(**out[verdicts].fillna("n/a"))


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
    recs = rows.to_dict("records")
    lines = [GAP_NOTE, "", *md_table(["task", "objective", "set", *GAP_HEAD, "speedup", "at equal quality",
                                      "online sampling (bound)"],
                                     [(r["task"], r["objective"], r["set"] or "–", *gap_cells(r)) for r in recs]), ""]
    modes = (("greedy accuracy", "greedy"), ("accuracy", "sampled"), ("win rate", "sampled win rate"))
    scores = [(r, name, [{k: _num(r.get(_col("score", m, a, k))) for k in ("mean", "lo", "hi")} for a in ARMS])
              for r in recs for m, name in modes if m != "win rate" or r["metric"] == "win rate"]
    return lines + ["Scores per family, mean [95% t-interval across seeds]: greedy accuracy (temperature 0) and sampled "
                    "accuracy (eval.temperature), or the sampled win rate against the starting policy where the task "
                    "has no accuracy.", "",
                    *md_table(["task", "objective", "set", "mode", *ARMS],
                              [(r["task"], r["objective"], r["set"] or "–", name, *map(ci_text, cells))
                               for r, name, cells in scores if any(c["mean"] is not None for c in cells)]), ""]


def _interval(lo, hi) -> str:
    return "–" if _num(lo) is None else f"[{lo:+.3f}, {hi:+.3f}]"


def paired_markdown(rows: pd.DataFrame, margin: float | None = None) -> list[str]:
    """The paired_columns of every comparison and mode that had paired scores, a row per contrast."""
    body = [(r, m, a, b, _col(m, a, "minus", b)) for r in rows.to_dict("records") for m in MODES.values()
            for a, b in CONTRASTS if _num(r.get(_col(m, a, "minus", b, "n"))) is not None]
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
    return lines + md_table(["task", "objective", "set", "metric", "a - b", "mean", "t-interval",
                             "bootstrap (prompt-level only)", "seeds",
                             *([] if margin is None else ["90% t-interval", f"equivalence (+-{margin:g})"])],
                            [(r["task"], r["objective"], r["set"] or "–", m, f"{a} - {b}", f"{r[c + '_mean']:+.3f}",
                              _interval(r[c + "_lo"], r[c + "_hi"]), _interval(r[c + "_boot_lo"], r[c + "_boot_hi"]),
                              int(r[c + "_n"]), *(() if margin is None else (
                                  _interval(r[c + "_lo90"], r[c + "_hi90"]), r[c + "_equivalence"])))
                             for r, m, a, b, c in body]) + [""]


def plot(table: pd.DataFrame, path) -> bool:
    """Gap closed with its interval per comparison (rows of gap_closed.csv's columns); False when no row has a
    ratio."""
    rows = [r for r in table.to_dict("records") if _num(r["gap_closed"]) is not None]
    if rows:
        bar_chart([f"{r['task']}/{r['objective']}" + (f"\n{r['set']}" if r["set"] else "") for r in rows],
                  [bar(r) for r in rows], path)
    return bool(rows)


def bar(r: dict) -> tuple:
    """(gap closed, lo, hi) of a row of gap_closed.csv's columns, None where absent."""
    return tuple(_num(r[f"gap_closed{s}"]) for s in ("", "_lo", "_hi"))


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
