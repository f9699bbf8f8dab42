"""Paired differences between stale-data corrections (correction=none|humanline|tis|mis|decoupled|trdpo): within a
comparison set (groups.comparison_sets), the groups of one data regime (online, stale-K, async-L, offline; humanline's
own family, humanline-stale-K, counts as stale-K) that differ only in their correction are arms of one comparison.
Per data regime and score (greedy and sampled accuracy, else the win rate): humanline minus each other correction,
paired by seed, with the 95% t-interval over seeds (without a humanline arm, each correction minus none).

A set whose only corrections are none and humanline gets no rows: that is humanline on and off, what the gap-closed
section already compares, so reports of such studies are unchanged.
"""
from __future__ import annotations

import re

import pandas as pd

from humanline_cli.mdtable import md_table
from humanline_cli.report.frame import FINAL, column
from humanline_cli.report.groups import canon, comparison_sets, differing_keys, under
from humanline_cli.report.stats import paired_by_seed

# the scores compared, by the name gap_closed's paired section gives them, and their summary.json fields
MODES = {"greedy": FINAL["greedy accuracy"], "sampled": FINAL["accuracy"]}
FALLBACK = {"win rate": FINAL["win rate"]}  # a task without a verifier
ORDER = ("none", "humanline", "tis", "mis", "decoupled", "trdpo")
CORRECTION_KEYS = ("correction", "hl")  # what tells two arms of one correction apart
COLUMNS = ("task", "objective", "set", "data", "metric", "a", "b", "a_mean", "b_mean", "mean", "lo", "hi", "n_seeds")


def correction_of(group) -> str:
    """A group's correction: its correction.kind, else humanline where its family is humanline's, else none."""
    kind = (group.cfg or {}).get("correction.kind")
    return str(kind) if kind is not None else "humanline" if group.family.startswith("humanline-") else "none"


def _regime_rank(data: str) -> tuple:
    """online, then stale-K and async-L by K and L, then the rest by name."""
    nums = [int(x) for x in re.findall(r"\d+", data)]
    return (0 if data == "online" else 1 if nums else 2, nums, data)


def arms(groups: pd.DataFrame) -> dict[str, object]:
    """arm name -> group: the correction, with the correction.* and hl.* keys that tell apart two groups of the
    same correction (humanline at two sync intervals), in ORDER."""
    by_kind: dict[str, list] = {}
    for g in groups.itertuples():
        by_kind.setdefault(correction_of(g), []).append(g)
    out = {}
    for kind in sorted(by_kind, key=lambda k: (ORDER.index(k) if k in ORDER else len(ORDER), k)):
        gs = by_kind[kind]
        sigs = [tuple(sorted((k, canon(v)) for k, v in (g.cfg or {}).items() if under(k, CORRECTION_KEYS)))
                for g in gs]
        differ = sorted(differing_keys(sigs)) if len(gs) > 1 else []
        for g in gs:
            shown = ", ".join(f"{k}={(g.cfg or {}).get(k)}" for k in differ)
            out[kind + (f" ({shown})" if shown else "")] = g
    return out


def contrasts(names: list[str]) -> list[tuple[str, str]]:
    """Humanline minus each other arm; without a humanline arm, each arm minus none."""
    kind = {n: n.split(" (")[0] for n in names}
    humanline = [n for n in names if kind[n] == "humanline"]
    if humanline:
        return [(a, b) for a in humanline for b in names if kind[b] != "humanline"]
    return [(a, b) for b in names if kind[b] == "none" for a in names if kind[a] != "none"]


def correction_rows(runs: pd.DataFrame, ignore=()) -> pd.DataFrame:
    """One row per comparison set, data regime, score and contrast (COLUMNS): a - b paired by seed, the mean, its
    95% t-interval (none for one seed) and each arm's mean over the paired seeds; empty where no set compares a
    correction other than none and humanline."""
    rows = []
    for task, objective, set_label, members in comparison_sets(runs, ignore):
        base = members.family.str.removeprefix("humanline-")
        for data in sorted(set(base), key=_regime_rank):
            named = arms(members[base == data])
            if not {n.split(" (")[0] for n in named} - {"none", "humanline"}:
                continue
            scores = {n: _by_seed(runs.loc[g.members]) for n, g in named.items()}
            modes = [m for m in (*MODES, *FALLBACK) if any(s[m].notna().any() for s in scores.values())]
            for metric in [m for m in modes if m in MODES] or modes[:1]:
                for a, b in contrasts(list(named)):
                    t = paired_by_seed(scores[a][metric], scores[b][metric])
                    if t is not None:
                        rows.append({"task": task, "objective": objective, "set": set_label, "data": data,
                                     "metric": metric, "a": a, "b": b, "a_mean": t["a_mean"], "b_mean": t["b_mean"],
                                     "mean": t["mean"], "lo": t["lo"], "hi": t["hi"], "n_seeds": t["n"]})
    return pd.DataFrame(rows, columns=list(COLUMNS), dtype=object)


def _by_seed(runs: pd.DataFrame) -> pd.DataFrame:
    """A group's scores per seed (a seed's last run where ignored keys gave it several)."""
    runs = runs[~runs.seed.map(str).duplicated(keep="last")]
    return pd.DataFrame({m: column(runs, key).to_numpy() for m, key in {**MODES, **FALLBACK}.items()},
                        index=runs.seed.tolist())


def _interval(lo, hi) -> str:
    return "–" if lo is None else f"[{lo:+.3f}, {hi:+.3f}]"


def markdown(rows: pd.DataFrame) -> list[str]:
    note = ("Per data regime (K optimizer steps per generation: online is K=1, stale-K), the groups that differ only "
            "in their correction: a - b per seed (runs paired by seed), humanline minus each other correction "
            "(without humanline, each minus none); mean over the paired seeds, [95% t-interval across seeds] "
            "(`–`: one seed). greedy = temperature 0, sampled = eval.temperature; a and b: each arm's mean over "
            "the same seeds. The gap-closed section above compares each data regime's plain group "
            "(correction=none) with online's and humanline's.")
    return [note, "", *md_table(
        ["task", "objective", "set", "data", "metric", "a - b", "a", "b", "mean", "95% t-interval", "seeds"],
        [(r["task"], r["objective"], r["set"] or "–", r["data"], r["metric"], f"{r['a']} - {r['b']}",
          f"{r['a_mean']:.3f}", f"{r['b_mean']:.3f}", f"{r['mean']:+.3f}", _interval(r["lo"], r["hi"]),
          int(r["n_seeds"])) for r in rows.to_dict("records")]), ""]
