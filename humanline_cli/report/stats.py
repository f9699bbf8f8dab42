"""Small statistics shared by every report: Student-t critical values and win-rate intervals."""
from __future__ import annotations

import math
import statistics

# two-sided 95% Student-t critical values t(0.975, df), df = 1..30
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


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
