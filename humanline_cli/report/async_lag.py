"""Asynchronous online rounds (data.async_lag=L > 0, families `async-L`, `humanline-async-L`), each lag paired
with synchronous (lag-0) online of the same humanline setting and otherwise identical config: the lag-L score
against lag 0's 95% interval, the paired per-seed difference, and the wall-clock speedup lag 0 / lag L."""
from __future__ import annotations

import re

import pandas as pd

from humanline_cli.mdtable import md_frame
from humanline_cli.report.frame import METRICS, ci_text, column, common_metric
from humanline_cli.report.groups import comparison_sets, hl_settings
from humanline_cli.report.stats import mean_ci, paired_t

_ASYNC = re.compile(r"(humanline-)?((?:stale-\d+-)?)async-(\d+)$")
CSV_COLUMNS = ("task", "objective", "set", "humanline", "lag", "metric", "lag0_mean", "lag0_lo", "lag0_hi",
               "lag_mean", "lag_lo", "lag_hi", "within_lag0_interval", "delta_mean", "delta_lo", "delta_hi",
               "n_seeds", "lag0_wall_s", "lag_wall_s", "speedup")


def async_rows(runs: pd.DataFrame, ignore=()) -> pd.DataFrame:
    """One row per lag-L group with exactly one lag-0 partner: `online` (`humanline-online`, `stale-K` for
    `stale-K-async-L`) in its comparison set with the same hl.* settings."""
    rows = []
    for task, objective, _, members in comparison_sets(runs, ignore):
        for g in members.itertuples():
            m = _ASYNC.match(g.family)
            sync_family = m and (m.group(1) or "") + (m.group(2).removesuffix("-") or "online")
            partners = [p for p in members.itertuples()
                        if m and p.family == sync_family and hl_settings(p) == hl_settings(g)]
            if len(partners) != 1:
                continue
            sync, lagged = runs.loc[partners[0].members], runs.loc[g.members]
            metric = common_metric(pd.concat([sync, lagged])["summary"])
            a, b = (pd.to_numeric(x.set_index("seed")[METRICS[metric]], errors="coerce").dropna() for x in (sync, lagged))
            a, b = (x[~x.index.duplicated(keep="last")] for x in (a, b))
            if a.empty or b.empty:
                continue
            common = sorted(set(a.index) & set(b.index), key=str)
            lag0, lagl, delta = mean_ci(a), mean_ci(b), paired_t(b[common], a[common])
            wall0, wall = (float(column(x, "wall_clock_s.total").fillna(0.0).mean()) for x in (sync, lagged))
            rows.append((task, objective, m.group(2).removesuffix("-"), bool(m.group(1)), int(m.group(3)), metric,
                         lag0["mean"], lag0["lo"], lag0["hi"], lagl["mean"], lagl["lo"], lagl["hi"],
                         None if lag0["lo"] is None else bool(lag0["lo"] <= lagl["mean"] <= lag0["hi"]),
                         delta["mean"], delta["lo"], delta["hi"], delta["n"], wall0, wall,
                         wall0 / wall if wall0 and wall else None))
    return pd.DataFrame(rows, columns=CSV_COLUMNS, dtype=object)


def markdown(rows: pd.DataFrame) -> list[str]:
    def ci(r, a):
        return ci_text({"mean": r[f"{a}_mean"], "lo": r[f"{a}_lo"], "hi": r[f"{a}_hi"]}, "+.3f" if a == "delta" else ".3f")

    view = pd.DataFrame({"task": rows.task, "objective": rows.objective, "set": rows.set.replace("", "–"),
                         "humanline": rows.humanline.map({True: "on", False: "off"}), "lag": rows.lag,
                         "metric": rows.metric, "lag 0": rows.apply(ci, axis=1, a="lag0"),
                         "lag L": rows.apply(ci, axis=1, a="lag"),
                         "in lag 0's interval": rows.within_lag0_interval.map({True: "yes", False: "no"}).fillna("n/a"),
                         "lag L - lag 0": rows.apply(ci, axis=1, a="delta"), "seeds": rows.n_seeds,
                         "speedup": rows.speedup.map(lambda x: f"{x:.2f}x" if x else "n/a")})
    return ["Each lag L > 0 against synchronous online (lag 0) with the same humanline setting: score mean [95% "
            "t-interval across seeds], whether lag L's mean lies in lag 0's interval, the paired per-seed "
            "difference lag L - lag 0, and speedup = lag-0 wall-clock / lag-L wall-clock at equal steps.", "",
            *md_frame(view), ""]
