"""The paper's question, per comparison set: how much of the offline -> online gap does
humanline-offline close, at what wall-clock?

gap closed = mean(humanline-offline - offline) / mean(online - offline) over the seeds all three have
(paired by seed), a ratio of means, on the chosen metric, with Fieller's 95% interval from the seed-level
covariance of the two differences; only where the gap's own t-interval across seeds lies above 0 (else
"unbounded": the ratio's interval has no finite bounds, and no ratio is printed). One seed: no interval; the
gap is decided by a prompt-level bootstrap. A comparison set is a group of complete runs whose configs agree on
everything except the family-defining keys (data regime, humanline, hl, sampler, reward): report/groups.py
decides it, over the runs frame (report/frame.py); the arms are paired by seed with a pivot. The metric is the
greedy task accuracy when runs recorded it (eval.greedy.accuracy), else the sampled accuracy, else the sampled
win rate against the starting policy.

Speed is reported two ways. `speedup`: online wall-clock / humanline-offline wall-clock over the same
number of steps. `equal_quality`: the paper's framing, from learning curves (eval.every > 0): the target is
humanline-offline's mean final score; per seed, the work time (train + sample + label + sync + push, i.e.
without evaluation and setup) to first reach it, with linear interpolation between evaluation points (the
starting policy's score at time 0), censored at the run's end where it never does; the speedup is online's
Kaplan-Meier median time over humanline-offline's, beside how many seeds of each reached the target.
`online_sampling_share`: the part of online's work time spent producing data (sample + label +
push), mean over seeds. 1 / (1 - share) bounds what any offline method can save against online
training on the same sequences per step (offline skips exactly that part).
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pandas as pd

from humanline_cli.report.frame import METRICS, WORK, ci_text, curve, md_table, metric_of, points
from humanline_cli.report.groups import comparison_sets, differing_keys
from humanline_cli.report.stats import excludes_zero, fieller, km_median, mean_ci, paired_t, prompt_bootstrap


def gap_closed(offline: dict, online: dict, humanline: dict, gap_interval: tuple | None = None) -> dict:
    """Each argument maps seed -> metric value; seeds present in all three are paired and handed to
    `gap_closed_paired` (see there). `gap_interval`: see gap_closed_paired."""
    seeds = sorted(set(offline) & set(online) & set(humanline), key=str)
    return gap_closed_paired([offline[s] for s in seeds], [online[s] for s in seeds], [humanline[s] for s in seeds],
                             gap_interval)


def gap_closed_paired(offline: list, online: list, humanline: list, gap_interval: tuple | None = None) -> dict:
    """Gap closed for runs already paired by seed (index i is the same seed in all three lists): the ratio of
    means mean(humanline - offline) / mean(online - offline) with Fieller's 95% interval (stats.fieller, the
    seed-level covariance of the two differences).

    The gap (online - offline) comes first: its paired mean with a 95% t-interval across seeds (stats.paired_t).
    Only a gap whose interval lies wholly above 0 has a ratio to report (`verdict` "gap"), and exactly then is
    Fieller's interval finite; otherwise the verdict is "unbounded" (the gap's interval reaches 0, so the
    ratio's interval has no finite bounds) or "online below" (the whole interval under 0), and mean/lo/hi are
    None. One seed has no seed-level interval: `gap_interval` (lo, hi), the caller's prompt-level bootstrap of
    the gap, decides whether there is one, and the ratio is given without an interval."""
    gap = paired_t(online, offline)
    lo, hi = gap_interval if gap["n"] == 1 and gap_interval is not None else (gap["lo"], gap["hi"])
    verdict = "gap" if excludes_zero(lo, hi) and lo > 0 else ("online below" if excludes_zero(lo, hi) else "unbounded")
    base = {"gap": {**gap, "lo": lo, "hi": hi}, "verdict": verdict, "n": gap["n"]}
    if verdict != "gap":
        return {**base, "mean": None, "lo": None, "hi": None}
    f = fieller([h - o for h, o in zip(humanline, offline)], [n - o for n, o in zip(online, offline)])
    return {**base, "mean": f["ratio"], "lo": f["lo"], "hi": f["hi"]}


def gap_text(g: dict) -> str:
    """The gap-closed cell: the ratio [Fieller interval] where there is a gap, else why there is no ratio."""
    if g.get("verdict", "gap") != "gap":
        return g["verdict"]
    if g["mean"] is None:
        return "–"
    return f"{g['mean']:.0%}" + (f" [{g['lo']:.0%}, {g['hi']:.0%}]" if g["lo"] is not None else "")


def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    """Work seconds at which the curve first reaches `target` (linear between points), None if never."""
    for i, (t, v) in enumerate(curve):
        if v >= target:
            if i == 0:
                return t
            t0, v0 = curve[i - 1]
            return t0 + (t - t0) * (target - v0) / (v - v0)
    return None


def times_to_target(curves: list, target: float) -> tuple[list[float], list[bool]]:
    """Per curve [(time, score)]: its time to first reach `target` and True, or, where it never does, the time
    of its last point (the run ended short of the target: right-censored there) and False."""
    times, reached = [], []
    for c in curves:
        t = time_to(c, target)
        times.append(c[-1][0] if t is None else t)
        reached.append(t is not None)
    return times, reached


def equal_quality(online: dict, humanline: dict) -> dict:
    """Each maps seed -> learning curve. The target is humanline-offline's final score, mean over its seeds (a
    rule fixed before the curves are read, the same whatever the number of seeds). Per regime: each seed's work
    time to first reach the target, censored at its run's end where it never does, and the Kaplan-Meier median
    of those times (stats.km_median; None when fewer than half reached it). `speedup`: online's median over
    humanline-offline's. `never`: online seeds that did not reach it."""
    target = statistics.fmean(c[-1][1] for c in humanline.values())
    out: dict = {"target": target}
    for name, curves in (("online", online), ("humanline-offline", humanline)):
        times, hit = times_to_target(list(curves.values()), target)
        out[name] = {"median": km_median(times, hit), "reached": sum(hit), "n": len(hit)}
    on, hl = out["online"]["median"], out["humanline-offline"]["median"]
    out["speedup"] = on / hl if on is not None and hl else None
    out["never"] = out["online"]["n"] - out["online"]["reached"]
    return out


def equal_quality_text(eq: dict | None) -> str:
    """The at-equal-quality cell: the ratio of medians and how many seeds of each regime reached the target."""
    if not eq:
        return "n/a"
    ratio = "–" if eq["speedup"] is None else f"{eq['speedup']:.2f}x"
    on, hl = eq["online"], eq["humanline-offline"]
    return f"{ratio} (reached: online {on['reached']} of {on['n']}, humanline {hl['reached']} of {hl['n']})"


# A comparison's row: its set, the arms' mean scores, the gap closed (gap_closed_paired's dict, `closed`), wall-clock
# and speedups, equal quality (equal_quality's dict, None without learning curves), the arms' scores per mode
# (mean_ci), online's sampling share and the speedup it bounds, the paired differences, and for a regime sweep the
# humanline regime and the regimes it was compared with.
ROW = ("task", "objective", "set", "metric", "offline", "online", "humanline_offline", "closed", "online_wall_s",
       "humanline_offline_wall_s", "speedup", "equal", "scores", "online_sampling_share", "speedup_bound_matched",
       "paired", "regime", "compared_with")


def gap_rows(runs: pd.DataFrame, ignore=()) -> pd.DataFrame:
    """From complete runs (report/frame.py), one row per comparison: a set holding an online group, a
    baseline (offline, or stale-K on-policy rounds) and humanline runs on that baseline's data (one row per
    humanline hl.* setting; see _comparisons)."""
    pts = points(runs)
    rows = []
    for task, objective, set_label, members in comparison_sets(runs, ignore):
        fams: dict[str, list] = {}
        for g in members:
            fams.setdefault(g.family, []).append(g)
        for base, hl_group, hl_label in _comparisons(fams):
            arms = {"offline": fams[base][0], "online": fams["online"][0], "humanline-offline": hl_group}
            arms = pd.concat([runs.loc[g.members].assign(arm=arm) for arm, g in arms.items()])
            # one run per arm and seed (the last, as a seed's runs differing only in ignored keys are one)
            arms = arms[~arms.duplicated(["arm", "seed"], keep="last")]
            label = ", ".join(x for x in (set_label, "" if base == "offline" else base, hl_label) if x)
            row = _gap_row(task, objective, label, arms, pts)
            if row is not None:
                rows.append(row)
    return pd.DataFrame(rows, columns=ROW, dtype=object)


def _comparisons(fams: dict) -> list[tuple]:
    """(baseline family, humanline group, label) per comparison in one set: the baseline is plain offline,
    stale on-policy rounds (`stale-K`, data.generate_every=K) or asynchronous rounds (`async-L`, data.async_lag=L,
    compared with synchronous lag-0 online), each compared with online and with every humanline
    group of the same data (`humanline-<baseline>`); several such groups (hl.* settings) are told apart by the hl
    keys that differ between them. A baseline or online that is ambiguous (two groups of the family differ in
    a family-defining key) gives nothing."""
    out = []
    if len(fams.get("online", [])) != 1:
        return out
    for base in sorted(f for f in fams if f == "offline" or f.startswith(("stale-", "async-"))):
        hls = fams.get(f"humanline-{base}", [])
        if len(fams[base]) != 1 or not hls:
            continue
        differ = differing_keys([tuple(sorted((k, str(v)) for k, v in (g.cfg or {}).items() if k.startswith("hl.")))
                                  for g in hls]) if len(hls) > 1 else set()
        for g in hls:
            out.append((base, g, ", ".join(f"{k}={(g.cfg or {}).get(k)}" for k in sorted(differ))))
    return out


def _gap_row(task: str, objective: str, label: str, arms: pd.DataFrame, pts: pd.DataFrame) -> dict | None:
    """One comparison: `arms` holds the runs of the offline (the baseline), online and humanline-offline arms
    (column `arm`); `pts` their evaluation points (frame.points)."""
    names = set(arms["summary"].map(metric_of))
    metric = sorted(names)[0] if len(names) == 1 else "win rate"
    scores = arms.reindex(columns=["arm", "seed", *METRICS.values()]).rename(
        columns={v: k for k, v in METRICS.items()})
    wide = scores.pivot(index="seed", columns="arm", values=metric).astype(float)
    if not all(wide.get(a, pd.Series(dtype=float)).notna().any() for a in ARMS):
        return None
    paired_seeds = wide.dropna().sort_index(key=lambda s: s.map(str))  # seeds every arm scored, paired
    by_arm = arms.groupby("arm")
    wall = by_arm["wall_clock_s.total"].mean() if "wall_clock_s.total" in arms else {}
    means = {a: {m: mean_ci(scores[scores.arm == a][m].dropna().astype(float)) for m in METRICS} for a in ARMS}
    curves = {a: {r.seed: curve(pts[pts.run == i], metric) for i, r in arms[arms.arm == a].iterrows()}
              for a in ("online", "humanline-offline")}
    mid = all(len(c) > 2 for a in curves for c in curves[a].values())  # at least one mid-run eval
    share = [s for r in arms[arms.arm == "online"].itertuples() if (s := _sampling_share(r.summary)) is not None]
    paired = {}
    for mode in ("greedy accuracy", "accuracy"):
        both = scores.pivot(index="seed", columns="arm", values=mode).astype(float).reindex(paired_seeds.index)
        if len(both) and both.notna().all().all():
            runs_by_arm = {a: [arms[(arms.arm == a) & (arms.seed == s)].iloc[0] for s in both.index] for a in ARMS}
            paired[mode] = paired_differences({a: both[a].tolist() for a in ARMS}, prompt_scores(runs_by_arm, mode))
    gap_interval = None
    if len(paired_seeds) == 1 and metric in paired:  # one seed: no t-interval, so the prompt bootstrap decides it
        boot = next(p["boot"] for p in paired[metric] if p["contrast"] == ("online", "offline"))
        gap_interval = (boot["lo"], boot["hi"]) if boot else None
    off, on, hl = (paired_seeds[a].tolist() for a in ARMS)
    on_wall, hl_wall = _float(wall.get("online")), _float(wall.get("humanline-offline"))
    share = statistics.fmean(share) if share else None
    return {"task": task, "objective": objective, "set": label, "metric": metric,
            **{a.replace("-", "_"): float(wide[a].mean()) for a in ARMS},
            "closed": gap_closed_paired(off, on, hl, gap_interval), "online_wall_s": on_wall,
            "humanline_offline_wall_s": hl_wall, "speedup": on_wall / hl_wall if on_wall and hl_wall else None,
            "equal": equal_quality(curves["online"], curves["humanline-offline"]) if mid else None, "scores": means,
            # the bound: the largest speedup skipping online's data production can give at matched sequences
            "online_sampling_share": share,
            "speedup_bound_matched": None if share is None or share >= 1 else 1 / (1 - share),
            "paired": [{**p, "metric": m} for m, rows in paired.items() for p in rows]}


def _float(x) -> float | None:
    return None if x is None or pd.isna(x) else float(x)


ARMS = ("offline", "online", "humanline-offline")
# The contrasts a comparison reports, (a, b) for a - b: the humanline effect, what is left to online, the gap.
CONTRASTS = (("humanline-offline", "offline"), ("online", "humanline-offline"), ("online", "offline"))
SAMPLES = {"greedy accuracy": "eval_samples_greedy.jsonl", "accuracy": "eval_samples.jsonl"}


def paired_differences(arms: dict, per_prompt: dict | None = None, contrasts=CONTRASTS) -> list[dict]:
    """Paired differences for arms already paired by seed: `arms` maps an arm to its per-seed scores (index i
    is the same seed in every arm); `per_prompt` (optional) maps an arm to its (seeds x prompts) per-prompt
    scores, in the same seed order and one prompt order. One row per contrast (a, b): a - b with a 95%
    t-interval across seeds (`t`, the interval a comparison is read by) and a prompt-level bootstrap interval
    (`boot`, stats.prompt_bootstrap; None without per-prompt scores)."""
    rows = []
    for a, b in contrasts:
        boot = prompt_bootstrap(per_prompt[a], per_prompt[b]) if per_prompt else None
        rows.append({"contrast": (a, b), "t": paired_t(arms[a], arms[b]), "boot": boot})
    return rows


def prompt_scores(runs_by_arm: dict, metric: str) -> dict | None:
    """{arm: (seeds x prompts) per-prompt scores} from each run's eval samples file (SAMPLES[metric]), the
    prompts every run scored, in one order; None when any run lacks the file (older runs wrote no greedy
    samples) or the runs share no prompt."""
    name = SAMPLES.get(metric)
    if name is None:
        return None
    table = {}
    for arm, runs in runs_by_arm.items():
        table[arm] = []
        for run in runs:
            f = Path(run["path"]) / name
            if not f.is_file():
                return None
            rows = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
            table[arm].append({r["prompt"]: float(r["policy_score"]) for r in rows if r.get("policy_score") is not None})
    common = set.intersection(*(set(d) for runs in table.values() for d in runs))
    if not common:
        return None
    order = sorted(common)
    return {arm: [[d[p] for p in order] for d in runs] for arm, runs in table.items()}


def _sampling_share(summary: dict) -> float | None:
    times = summary.get("wall_clock_s") or {}
    work = sum(float(times.get(k, 0.0) or 0.0) for k in WORK)
    if work <= 0:
        return None
    return sum(float(times.get(k, 0.0) or 0.0) for k in ("sample", "label", "push")) / work


CSV_COLUMNS = ("task", "objective", "set", "metric", "offline", "online", "humanline_offline", "gap_closed",
               "gap_closed_lo", "gap_closed_hi", "n_seeds", "gap", "gap_lo", "gap_hi", "gap_verdict", "online_wall_s",
               "humanline_offline_wall_s", "speedup",
               "speedup_equal_quality", "online_never_reached", "online_sampling_share", "speedup_bound_matched")


# gap_closed.csv's precision: speeds and shares to 4 significant digits, the other numbers to 6, wall-clock in full
DIGITS = {c: 4 if c.startswith(("speedup", "online_sampling")) else 6 for c in CSV_COLUMNS if not c.endswith("wall_s")}


def gap_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """gap_closed.csv: one row per comparison (None where there is no value, written empty)."""
    closed, equal = rows["closed"], rows["equal"]
    return rows.assign(gap_closed=closed.map(lambda g: g["mean"]), gap_closed_lo=closed.map(lambda g: g["lo"]),
                       gap_closed_hi=closed.map(lambda g: g["hi"]), n_seeds=closed.map(lambda g: g["n"]),
                       gap=closed.map(lambda g: g["gap"]["mean"]), gap_lo=closed.map(lambda g: g["gap"]["lo"]),
                       gap_hi=closed.map(lambda g: g["gap"]["hi"]), gap_verdict=closed.map(lambda g: g["verdict"]),
                       speedup_equal_quality=equal.map(lambda e: e and e["speedup"]),
                       online_never_reached=equal.map(lambda e: e and e["never"]))[list(CSV_COLUMNS)].astype(object)


def markdown(rows: pd.DataFrame) -> list[str]:
    if rows.empty:
        return ["No comparison set has offline, online and humanline-offline runs: no gap to report.", ""]
    lines = ["gap closed = mean(humanline-offline - offline) / mean(online - offline) over seeds paired by seed (a "
             "ratio of means) [95% Fieller interval from the seed-level covariance], given only where the gap online - "
             "offline has a 95% t-interval across seeds wholly above 0, else `unbounded` (the gap's interval reaches "
             "0, so the ratio's has no finite bounds) or `online below`; one seed: no interval, the gap decided by a "
             "prompt-level bootstrap (prompt-level only). "
             "speedup = online wall-clock / humanline-offline wall-clock at equal "
             "steps; at equal quality = online's work time to reach humanline-offline's mean final score / "
             "humanline-offline's, each the Kaplan-Meier median over seeds (a seed that never reaches it is censored "
             "at its run's end; `–`: fewer than half reached it), with how many seeds of each reached it (learning "
             "curves; n/a without mid-run evals, eval.every); online sampling = "
             "share of online's work time spent sampling, labelling and pushing weights, and the speedup it bounds: "
             "1 / (1 - share) is the most any offline run can save against online on the same sequences per step.",
             "", *md_table(["task", "objective", "set", "metric", "offline", "online", "humanline-offline", "gap closed",
                            "seeds", "speedup", "at equal quality", "online sampling (bound)"],
                           [(r.task, r.objective, r.set or "–", r.metric, f"{r.offline:.3f}", f"{r.online:.3f}",
                             f"{r.humanline_offline:.3f}", gap_text(r.closed), r.closed["n"],
                             f"{r.speedup:.2f}x" if r.speedup else "n/a", equal_quality_text(r.equal),
                             "n/a" if r.speedup_bound_matched is None else
                             f"{r.online_sampling_share:.0%} ({r.speedup_bound_matched:.2f}x)")
                            for r in rows.itertuples()]), ""]
    modes = (("greedy accuracy", "greedy"), ("accuracy", "sampled"), ("win rate", "sampled win rate"))
    scores = [(r, name, [(r.scores or {}).get(a, {}).get(mode) for a in ARMS]) for r in rows.itertuples()
              for mode, name in modes if mode != "win rate" or r.metric == "win rate"]
    return lines + ["Scores per family, mean [95% t-interval across seeds]: greedy accuracy (temperature 0) and sampled "
                    "accuracy (eval.temperature), or the sampled win rate against the starting policy where the task "
                    "has no accuracy.", "",
                    *md_table(["task", "objective", "set", "mode", *ARMS],
                              [(r.task, r.objective, r.set or "–", name, *map(ci_text, cells))
                               for r, name, cells in scores if any(c is not None for c in cells)]), ""]


def paired_markdown(rows: pd.DataFrame) -> list[str]:
    """The paired differences of every comparison, greedy and sampled: a - b, mean over seeds with a 95%
    t-interval across seeds (the reported interval) and a prompt-level bootstrap interval beside it."""
    body = [r for r in rows.itertuples() if r.paired]
    if not body:
        return ["No comparison has paired runs.", ""]
    lines = ["a - b per seed (runs paired by seed), mean [95% t-interval across seeds: the reported interval] and "
             "[95% prompt-level bootstrap: the eval prompts resampled, 2000 replicates, the seeds held fixed, so it "
             "leaves out seed-to-seed variation and is narrower than the truth when seeds differ]; `–`: no interval "
             "(one seed, or no per-prompt samples). greedy = temperature 0, sampled = eval.temperature.", ""]
    names = {"greedy accuracy": "greedy", "accuracy": "sampled"}

    def interval(x) -> str:
        return f"[{x['lo']:+.3f}, {x['hi']:+.3f}]" if x and x["lo"] is not None else "–"

    return lines + md_table(["task", "objective", "set", "metric", "a - b", "mean", "t-interval",
                             "bootstrap (prompt-level only)", "seeds"],
                            [(r.task, r.objective, r.set or "–", names.get(p["metric"], p["metric"]),
                              " - ".join(p["contrast"]), f"{p['t']['mean']:+.3f}", interval(p["t"]), interval(p["boot"]),
                              p["t"]["n"]) for r in body for p in r.paired]) + [""]


def plot(rows: pd.DataFrame, path) -> bool:
    """Bar chart of gap closed with its interval, one bar per comparison set (PNG)."""
    rows = [r for r in rows.itertuples() if r.closed["mean"] is not None]
    if not rows:
        return False
    bar_chart([f"{r.task}/{r.objective}" + (f"\n{r.set}" if r.set else "") for r in rows],
              [(r.closed["mean"], r.closed["lo"], r.closed["hi"]) for r in rows], path)
    return True


def bar_chart(labels: list[str], values: list[tuple], path, colors: list[str] | None = None) -> None:
    """Gap closed per bar, (mean, lo, hi) each (lo/hi None: no interval), 0 and 1 marked (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    means = [m for m, _, _ in values]
    # max(0, ...): a zero-width interval can sit a rounding error off its own mean
    err = [[max(0.0, m - (lo if lo is not None else m)) for m, lo, _ in values],
           [max(0.0, (hi if hi is not None else m) - m) for m, _, hi in values]]
    if len(values) <= 10:  # vertical bars
        fig, ax = plt.subplots(figsize=(max(4, 1.3 * len(values) + 2), 4.0))
        ax.bar(range(len(values)), means, yerr=err, capsize=4, color=colors or "#4c72b0")
        ax.axhline(0, color="black", lw=0.8)
        ax.axhline(1, color="grey", lw=0.8, ls="--")
        ax.set_xticks(list(range(len(values))))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel("gap closed by humanline-offline")
    else:  # many regimes: one row each, top to bottom in the given order
        fig, ax = plt.subplots(figsize=(8.0, 0.32 * len(values) + 1.4))
        ax.barh(range(len(values)), means, xerr=err, capsize=3, color=colors or "#4c72b0")
        ax.axvline(0, color="black", lw=0.8)
        ax.axvline(1, color="grey", lw=0.8, ls="--")
        ax.set_yticks(list(range(len(values))))
        ax.set_yticklabels([label.replace("\n", " ") for label in labels], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("gap closed by humanline-offline")
    ax.set_title("mean(humanline-offline - offline) / mean(online - offline), 95% Fieller interval")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
