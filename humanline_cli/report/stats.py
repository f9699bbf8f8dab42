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


def paired_t(a: list[float], b: list[float]) -> dict:
    """a - b for runs already paired by seed (a[i] and b[i] share seed i): the per-seed differences, their mean
    and a 95% Student-t interval (mean +- t(0.975, n-1) * sd / sqrt(n); no interval for one pair)."""
    if len(a) != len(b):
        raise ValueError(f"paired_t needs equal-length arrays, got {len(a)} and {len(b)}")
    diffs = [float(x) - float(y) for x, y in zip(a, b)]
    if not diffs:
        return {"n": 0, "diffs": [], "mean": None, "lo": None, "hi": None}
    m = statistics.fmean(diffs)
    if len(diffs) < 2:
        return {"n": 1, "diffs": diffs, "mean": m, "lo": None, "hi": None}
    half = t975(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return {"n": len(diffs), "diffs": diffs, "mean": m, "lo": m - half, "hi": m + half}


def bootstrap_paired(a, b, n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """a - b with a prompt x seed bootstrap: a and b are (seeds x prompts) arrays of per-prompt scores, already
    paired (row i: seed i in both arms; column j: the same eval prompt everywhere). Each replicate resamples
    seeds and prompts independently with replacement, the same draw for both arms, and takes the mean
    difference over the drawn cells; the interval is the replicates' percentile interval. Both sources of
    noise (which seeds, which prompts) are in it, unlike the t-interval over seed means."""
    import numpy as np

    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    if d.ndim != 2 or d.size == 0:
        raise ValueError(f"bootstrap_paired needs two equal (seeds x prompts) arrays, got shape {d.shape}")
    k, m = d.shape
    rng = np.random.default_rng(seed)
    # resampling with replacement = multinomial counts per seed and per prompt; the replicate's mean is
    # sum_ij cs_i * cp_j * d_ij / (k * m)
    cs = rng.multinomial(k, [1.0 / k] * k, size=n_boot)
    cp = rng.multinomial(m, [1.0 / m] * m, size=n_boot)
    reps = np.einsum("bi,ij,bj->b", cs, d, cp) / (k * m)
    tail = (1.0 - level) / 2
    lo, hi = np.quantile(reps, [tail, 1.0 - tail])
    return {"mean": float(d.mean()), "lo": float(lo), "hi": float(hi), "n_seeds": k, "n_prompts": m,
            "n_boot": n_boot}


def excludes_zero(lo: float | None, hi: float | None) -> bool:
    """Whether an interval lies wholly on one side of 0 (no interval: unknown, so False)."""
    return lo is not None and hi is not None and (lo > 0 or hi < 0)
