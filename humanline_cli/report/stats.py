"""Small statistics shared by every report, pure functions of arrays (values in, numbers out), on scipy.stats:
Student-t intervals over seeds, win-rate intervals, a prompt-level bootstrap, Fieller's interval for a ratio of
paired means, and the Kaplan-Meier median of times to a target where some seeds never reach it."""
from __future__ import annotations

import math

import numpy as np
from scipy import stats


def t975(df: int) -> float:
    """The two-sided 95% Student-t critical value t(0.975, df)."""
    if df < 1:
        raise ValueError("df must be >= 1")
    return float(stats.t.ppf(0.975, df))


def mean_ci(values) -> dict | None:
    """Mean and 95% Student-t interval across seeds (mean +- t(0.975, n-1) * sd / sqrt(n); no interval for one
    value); None for none."""
    x = np.asarray(list(values), dtype=np.float64)
    if x.size == 0:
        return None
    m = float(x.mean())
    if x.size < 2:
        return {"mean": m, "lo": None, "hi": None, "n": 1}
    half = t975(x.size - 1) * float(x.std(ddof=1)) / math.sqrt(x.size)
    return {"mean": m, "lo": m - half, "hi": m + half, "n": int(x.size)}


def win_rate_ci(win_rates: list[float], single_ci=None) -> tuple[float, float]:
    """95% CI for a cell: the run's own CI for one seed, else a t-interval across seeds (clipped to [0, 1])."""
    if len(win_rates) == 1:
        lo, hi = single_ci if single_ci else (math.nan, math.nan)
        return float(lo), float(hi)
    ci = mean_ci(win_rates)
    return max(0.0, ci["lo"]), min(1.0, ci["hi"])


def paired_t(a: list[float], b: list[float]) -> dict:
    """a - b for runs already paired by seed (a[i] and b[i] share seed i): the per-seed differences, their mean
    and a 95% Student-t interval (mean +- t(0.975, n-1) * sd / sqrt(n); no interval for one pair)."""
    if len(a) != len(b):
        raise ValueError(f"paired_t needs equal-length arrays, got {len(a)} and {len(b)}")
    diffs = [float(x) - float(y) for x, y in zip(a, b)]
    ci = mean_ci(diffs)
    if ci is None:
        return {"n": 0, "diffs": [], "mean": None, "lo": None, "hi": None}
    return {"n": ci["n"], "diffs": diffs, "mean": ci["mean"], "lo": ci["lo"], "hi": ci["hi"]}


def prompt_bootstrap(a, b, n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """a - b with a prompt-level bootstrap: a and b are (seeds x prompts) arrays of per-prompt scores, already
    paired (row i: seed i in both arms; column j: the same eval prompt everywhere). The per-prompt differences
    are averaged over the seeds, then the prompts are resampled with replacement (scipy.stats.bootstrap,
    percentile interval). The seeds are held fixed: the interval measures which prompts were drawn, not
    which seeds, so it is printed as "prompt-level only" and never stands in for the seed-level t-interval
    where there are two seeds or more."""
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    if d.ndim != 2 or d.size == 0:
        raise ValueError(f"prompt_bootstrap needs two equal (seeds x prompts) arrays, got shape {d.shape}")
    per_prompt = d.mean(axis=0)
    mean = float(per_prompt.mean())
    if np.ptp(per_prompt) == 0:  # every replicate is the same number; scipy warns on degenerate data
        lo = hi = mean
    else:
        res = stats.bootstrap((per_prompt,), np.mean, n_resamples=n_boot, confidence_level=level,
                              method="percentile", rng=np.random.default_rng(seed))
        lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    return {"mean": mean, "lo": lo, "hi": hi, "n_seeds": d.shape[0], "n_prompts": d.shape[1], "n_boot": n_boot}


def fieller(x, y, level: float = 0.95) -> dict:
    """Ratio of paired means mean(x) / mean(y) with Fieller's interval; x[i] and y[i] come from seed i.

    With a = mean(x), b = mean(y), v11, v22, v12 the (co)variances of those means (sample covariance / n) and
    t = t((1 + level) / 2, n - 1), the interval is the set of R with (a - R b)^2 <= t^2 (v11 - 2 R v12 + R^2 v22),
    i.e. the R for which the paired t-test of x - R y does not reject 0. Its ends are the roots of
        (b^2 - t^2 v22) R^2 - 2 (a b - t^2 v12) R + (a^2 - t^2 v11) = 0.
    It is a finite interval only when b^2 > t^2 v22, i.e. when the t-interval of mean(y) excludes 0; otherwise
    `bounded` is False and lo, hi are None (the ratio has no finite bounds, so no ratio is worth printing).
    One pair: the ratio with no interval."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1 or x.size == 0:
        raise ValueError(f"fieller needs two equal non-empty 1-d arrays, got shapes {x.shape} and {y.shape}")
    n, a, b = x.size, float(x.mean()), float(y.mean())
    ratio = a / b if b != 0 else None
    if n < 2:
        return {"ratio": ratio, "lo": None, "hi": None, "bounded": False, "n": 1}
    cov = np.cov(x, y, ddof=1) / n
    v11, v22, v12 = float(cov[0, 0]), float(cov[1, 1]), float(cov[0, 1])
    t2 = float(stats.t.ppf((1 + level) / 2, n - 1)) ** 2
    qa, qb, qc = b * b - t2 * v22, a * b - t2 * v12, a * a - t2 * v11
    if qa <= 0:
        return {"ratio": ratio, "lo": None, "hi": None, "bounded": False, "n": n}
    root = math.sqrt(max(qb * qb - qa * qc, 0.0))  # >= 0 whenever qa > 0 (Cauchy-Schwarz); max() for rounding
    return {"ratio": ratio, "lo": (qb - root) / qa, "hi": (qb + root) / qa, "bounded": True, "n": n}


def km_median(times, reached) -> float | None:
    """Kaplan-Meier median time to a target: times[i] is seed i's time to reach it where reached[i], else the
    time its run ended without reaching it (right-censored). The median is the smallest time at which the
    estimated share of seeds still short of the target falls to 1/2 or below (scipy.stats.ecdf on censored
    data); None when it never does (more than half the seeds not reached, as far as they ran). With every seed
    reached and n odd it is the ordinary median; with n even, the lower of the middle two."""
    t = np.asarray(times, dtype=np.float64)
    hit = np.asarray(reached, dtype=bool)
    if t.size == 0 or not hit.any():
        return None
    sf = stats.ecdf(stats.CensoredData(uncensored=t[hit], right=t[~hit])).sf
    below = np.nonzero(sf.probabilities <= 0.5 + 1e-12)[0]
    return float(sf.quantiles[below[0]]) if below.size else None


def excludes_zero(lo: float | None, hi: float | None) -> bool:
    """Whether an interval lies wholly on one side of 0 (no interval: unknown, so False)."""
    return lo is not None and hi is not None and (lo > 0 or hi < 0)
