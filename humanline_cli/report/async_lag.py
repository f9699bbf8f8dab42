"""`humanline report` on asynchronous online rounds (data.async_lag=L > 0, the families `async-L` and
`humanline-async-L`): each lag paired with synchronous (lag-0) online of the same humanline setting and an
otherwise identical config, so the table answers what the overlap costs in quality and buys in wall-clock, with
and without humanline: the lag-L score against lag 0's 95% interval, the paired per-seed difference, and the
wall-clock speedup lag 0 / lag L. Runs of different lags are different families (report/frame.data_family),
never averaged together."""
from __future__ import annotations

import re

import pandas as pd

from humanline_cli.report.frame import METRICS, ci_text, md_table, metric_of
from humanline_cli.report.groups import comparison_sets
from humanline_cli.report.stats import mean_ci

_ASYNC = re.compile(r"(humanline-)?((?:stale-\d+-)?)async-(\d+)$")
CSV_COLUMNS = ("task", "objective", "set", "humanline", "lag", "metric", "lag0_mean", "lag0_lo", "lag0_hi",
               "lag_mean", "lag_lo", "lag_hi", "within_lag0_interval", "delta_mean", "delta_lo", "delta_hi",
               "n_seeds", "lag0_wall_s", "lag_wall_s", "speedup")


def _hl(g) -> tuple:
    return tuple(sorted((k, str(v)) for k, v in (g.cfg or {}).items() if k.startswith("hl.")))


def async_rows(runs: pd.DataFrame, ignore=()) -> pd.DataFrame:
    """From complete runs: one row (CSV_COLUMNS) per lag-L group that has exactly one lag-0 partner, the group of
    family `online` (`humanline-online` for humanline, `stale-K` for `stale-K-async-L`) with the same config
    outside the data and humanline keys and the same hl.* settings. Empty without such a pair."""
    rows = []
    for task, objective, _, members in comparison_sets(runs, ignore):
        for g in members:
            m = _ASYNC.match(g.family)
            if m is None:
                continue
            sync_family = (m.group(1) or "") + (m.group(2).removesuffix("-") or "online")
            partners = [p for p in members if p.family == sync_family and _hl(p) == _hl(g)]
            if len(partners) == 1:
                rows += _row(task, objective, m.group(2).removesuffix("-"), bool(m.group(1)), int(m.group(3)),
                             runs.loc[partners[0].members], runs.loc[g.members])
    return pd.DataFrame(rows, columns=CSV_COLUMNS, dtype=object)


def _row(task, objective, label, humanline: bool, lag: int, sync: pd.DataFrame, lagged: pd.DataFrame) -> list:
    both = pd.concat([sync, lagged])
    names = set(both["summary"].map(metric_of))
    metric = METRICS[sorted(names)[0] if len(names) == 1 else "win rate"]
    a, b = (pd.to_numeric(x.set_index("seed")[metric], errors="coerce").dropna() for x in (sync, lagged))
    a, b = a[~a.index.duplicated(keep="last")], b[~b.index.duplicated(keep="last")]
    if a.empty or b.empty:
        return []
    common = sorted(set(a.index) & set(b.index), key=str)
    lag0, lagl = mean_ci(a), mean_ci(b)
    delta = mean_ci([b[s] - a[s] for s in common]) or {"mean": None, "lo": None, "hi": None, "n": 0}
    wall0, wall = (float(pd.to_numeric(x.get("wall_clock_s.total"), errors="coerce").fillna(0.0).mean())
                   for x in (sync, lagged))
    within = None if lag0["lo"] is None else bool(lag0["lo"] <= lagl["mean"] <= lag0["hi"])
    return [(task, objective, label, humanline, lag, next(k for k, v in METRICS.items() if v == metric),
             lag0["mean"], lag0["lo"], lag0["hi"], lagl["mean"], lagl["lo"], lagl["hi"], within, delta["mean"],
             delta["lo"], delta["hi"], delta["n"], wall0, wall, wall0 / wall if wall0 and wall else None)]


def markdown(rows: pd.DataFrame) -> list[str]:
    def ci(r, a, b, fmt=".3f"):
        return ci_text({"mean": getattr(r, a), "lo": getattr(r, b + "_lo"), "hi": getattr(r, b + "_hi")}, fmt)

    return ["Each lag L > 0 against synchronous online (lag 0) with the same humanline setting: score mean [95% "
            "t-interval across seeds], whether lag L's mean lies in lag 0's interval, the paired per-seed "
            "difference lag L - lag 0, and speedup = lag-0 wall-clock / lag-L wall-clock at equal steps.", "",
            *md_table(["task", "objective", "set", "humanline", "lag", "metric", "lag 0", "lag L",
                       "in lag 0's interval", "lag L - lag 0", "seeds", "speedup"],
                      [(r.task, r.objective, r.set or "–", "on" if r.humanline else "off", r.lag, r.metric,
                        ci(r, "lag0_mean", "lag0"), ci(r, "lag_mean", "lag"),
                        {None: "n/a", True: "yes", False: "no"}[r.within_lag0_interval],
                        ci(r, "delta_mean", "delta", "+.3f"), r.n_seeds,
                        f"{r.speedup:.2f}x" if r.speedup else "n/a") for r in rows.itertuples()]), ""]
