"""`humanline report` on asynchronous online rounds (data.async_lag=L > 0, the families `async-L` and
`humanline-async-L`): each lag paired with synchronous (lag-0) online of the same humanline setting and an
otherwise identical config, so the table answers what the overlap costs in quality and buys in wall-clock, with
and without humanline: the lag-L score against lag 0's 95% interval, the paired per-seed difference, and the
wall-clock speedup lag 0 / lag L. Runs of different lags are different families (report/runs.data_family),
never averaged together."""
from __future__ import annotations

import re
import statistics
from dataclasses import dataclass

from humanline_cli.report.gap_closed import metric_of, metric_value
from humanline_cli.report.groups import derived_from, group_runs, signature
from humanline_cli.report.stats import mean_ci

_ASYNC = re.compile(r"(humanline-)?((?:stale-\d+-)?)async-(\d+)$")
CSV_COLUMNS = ("task", "objective", "set", "humanline", "lag", "metric", "lag0_mean", "lag0_lo", "lag0_hi",
               "lag_mean", "lag_lo", "lag_hi", "within_lag0_interval", "delta_mean", "delta_lo", "delta_hi",
               "n_seeds", "lag0_wall_s", "lag_wall_s", "speedup")


@dataclass(frozen=True)
class AsyncRow:
    task: str
    objective: str
    label: str          # what tells this comparison set apart from the objective's others (may be empty)
    humanline: bool
    lag: int
    metric: str
    lag0: dict          # mean_ci of the lag-0 group's seeds
    lagged: dict        # mean_ci of the lag-L group's seeds
    delta: dict | None  # mean_ci of the per-seed difference lag L - lag 0 (seeds in both); None: no common seed
    lag0_wall_s: float
    lag_wall_s: float

    @property
    def within(self) -> bool | None:
        """The lag-L mean inside lag 0's 95% interval (None: lag 0 has one seed, no interval)."""
        lo, hi = self.lag0["lo"], self.lag0["hi"]
        return None if lo is None else lo <= self.lagged["mean"] <= hi

    @property
    def speedup(self) -> float | None:
        return self.lag0_wall_s / self.lag_wall_s if self.lag0_wall_s and self.lag_wall_s else None


def _hl(g) -> tuple:
    return tuple(sorted((k, str(v)) for k, v in (g.cfg or {}).items() if k.startswith("hl.")))


def async_rows(runs: list, ignore=()) -> list[AsyncRow]:
    """From complete runs (report.Run objects): one row per lag-L group that has exactly one lag-0 partner,
    the group of family `online` (`humanline-online` for humanline, `stale-K` for `stale-K-async-L`) with the
    same config outside the data and humanline keys and the same hl.* settings. None without such a pair."""
    rows = []
    all_groups = group_runs(runs, ignore)
    for task in sorted({g.task for g in all_groups}):
        tg = [g for g in all_groups if g.task == task]
        derived = derived_from(tg)
        sets: dict[tuple, list] = {}
        for g in tg:
            sets.setdefault((g.objective, signature(g, derived)[2]), []).append(g)
        for (objective, _), groups in sorted(sets.items(), key=lambda kv: str(kv[0])):
            for g in groups:
                m = _ASYNC.match(g.family)
                if m is None:
                    continue
                sync_family = (m.group(1) or "") + (m.group(2).removesuffix("-") or "online")
                partners = [p for p in groups if p.family == sync_family and _hl(p) == _hl(g)]
                row = _row(task, objective, partners[0], g, bool(m.group(1)), int(m.group(3)),
                           m.group(2).removesuffix("-")) if len(partners) == 1 else None
                if row is not None:
                    rows.append(row)
    return rows


def _row(task: str, objective: str, sync, lagged, humanline: bool, lag: int, label: str) -> AsyncRow | None:
    names = {metric_of(r.summary)[0] for r in sync.runs + lagged.runs}
    metric = sorted(names)[0] if len(names) == 1 else "win rate"
    a = {r.seed: v for r in sync.runs if (v := metric_value(r.summary, metric)) is not None}
    b = {r.seed: v for r in lagged.runs if (v := metric_value(r.summary, metric)) is not None}
    if not a or not b:
        return None
    common = sorted(set(a) & set(b), key=str)

    def wall(g) -> float:
        return statistics.fmean(float(r.summary.get("wall_clock_s", {}).get("total") or 0.0) for r in g.runs)

    return AsyncRow(task, objective, label, humanline, lag, metric, mean_ci(list(a.values())), mean_ci(list(b.values())),
                    mean_ci([b[s] - a[s] for s in common]), wall(sync), wall(lagged))


def markdown(rows: list[AsyncRow]) -> list[str]:
    lines = ["Each lag L > 0 against synchronous online (lag 0) with the same humanline setting: score mean [95% "
             "t-interval across seeds], whether lag L's mean lies in lag 0's interval, the paired per-seed "
             "difference lag L - lag 0, and speedup = lag-0 wall-clock / lag-L wall-clock at equal steps.", "",
             "| task | objective | set | humanline | lag | metric | lag 0 | lag L | in lag 0's interval | "
             "lag L - lag 0 | seeds | speedup |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        within = "n/a" if r.within is None else ("yes" if r.within else "no")
        speed = f"{r.speedup:.2f}x" if r.speedup else "n/a"
        lines.append(f"| {r.task} | {r.objective} | {r.label or '–'} | {'on' if r.humanline else 'off'} | {r.lag} | "
                     f"{r.metric} | {_fmt(r.lag0)} | {_fmt(r.lagged)} | {within} | {_fmt(r.delta, signed=True)} | "
                     f"{0 if r.delta is None else r.delta['n']} | {speed} |")
    return lines + [""]


def _fmt(ci: dict | None, signed: bool = False) -> str:
    if ci is None:
        return "–"
    f = "{:+.3f}" if signed else "{:.3f}"
    return f.format(ci["mean"]) + ("" if ci["lo"] is None else f" [{f.format(ci['lo'])}, {f.format(ci['hi'])}]")


def write_csv(rows: list[AsyncRow], path) -> None:
    import csv

    def num(x) -> str:
        return "" if x is None else repr(float(x))

    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for r in rows:
            d = r.delta or {"mean": None, "lo": None, "hi": None, "n": 0}
            w.writerow([r.task, r.objective, r.label, r.humanline, r.lag, r.metric,
                        num(r.lag0["mean"]), num(r.lag0["lo"]), num(r.lag0["hi"]),
                        num(r.lagged["mean"]), num(r.lagged["lo"]), num(r.lagged["hi"]),
                        "" if r.within is None else r.within, num(d["mean"]), num(d["lo"]), num(d["hi"]), d["n"],
                        num(r.lag0_wall_s), num(r.lag_wall_s), num(r.speedup)])
