"""A pre-registered study's sample size and decision rule, beside the report's `equivalence`: the exact power of
the paired TOST at a margin, the fewest seeds that reach a power, the TOST p-value, Holm's step-down over a family
of such tests (docs/results.md's registered SmolLM2 studies name them)."""
from __future__ import annotations

import math

import numpy as np
from scipy import stats


def tost_power(n: int, sd: float, margin: float, alpha: float = 0.05) -> float:
    """Probability that the paired TOST of `report.stats.equivalence` (the 90% t-interval of n paired differences inside
    [-margin, +margin]) declares equivalence when the true mean difference is 0 and the differences are normal
    with SD `sd`. Exact: the sample mean ~ N(0, sd^2 / n) and (n - 1) s^2 / sd^2 ~ chi2(n - 1) are independent,
    so the power is the integral over s of P(|mean| <= margin - t s / sqrt(n))."""
    from scipy import integrate

    df, t, se = n - 1, float(stats.t.ppf(1 - alpha, n - 1)), sd / math.sqrt(n)

    def given_s(s: float) -> float:  # P(|mean| <= room) times the density of the sample SD at s
        room = margin - t * s / math.sqrt(n)
        return (2 * stats.norm.cdf(room / se) - 1) * stats.chi2.pdf(df * s * s / sd**2, df) * 2 * df * s / sd**2

    return float(integrate.quad(given_s, 0.0, margin * math.sqrt(n) / t, limit=200)[0])


def tost_seeds(sd: float, margin: float, power: float = 0.8, alpha: float = 0.05, minimum: int = 10) -> int:
    """The fewest seeds, at least `minimum`, at which tost_power reaches `power`."""
    n = max(minimum, 2)
    while tost_power(n, sd, margin, alpha) < power:
        n += 1
    return n


def tost_p(diffs, margin: float) -> float | None:
    """The p-value of two one-sided t-tests that the paired differences' mean lies inside (-margin, +margin): the
    larger of P(T >= (mean + margin) / se) and P(T >= (margin - mean) / se) under t(n - 1), each against its own
    boundary; below 0.05 exactly when equivalence's 90% interval lies inside. None below two seeds."""
    x = np.asarray(list(diffs), dtype=np.float64)
    if x.size < 2:
        return None
    se, df = float(x.std(ddof=1)) / math.sqrt(x.size), x.size - 1
    if se == 0:
        return 0.0 if abs(float(x.mean())) < margin else 1.0
    lower, upper = (float(stats.t.sf((margin + s * float(x.mean())) / se, df)) for s in (1, -1))
    return max(lower, upper)


def holm(pvalues: dict, alpha: float = 0.05) -> dict:
    """Holm's step-down over a family of tests: name -> rejected. Sorted by p, the k-th smallest (k from 1) is
    rejected while p <= alpha / (m - k + 1); the first that is not stops it (it and every larger p stand)."""
    out, m = {name: False for name in pvalues}, len(pvalues)
    for k, (name, p) in enumerate(sorted(pvalues.items(), key=lambda kv: kv[1]), start=1):
        if p is None or p > alpha / (m - k + 1):
            break
        out[name] = True
    return out
