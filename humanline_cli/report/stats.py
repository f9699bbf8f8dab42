"""Statistics of the report on scipy.stats: t-intervals over seeds, a prompt-level bootstrap, Fieller's interval
for a ratio of paired means, the Kaplan-Meier median of censored times to a target."""
from __future__ import annotations

import math

import numpy as np
from scipy import stats


def mean_ci(values, level: float = 0.95) -> dict | None:
    """Mean and t-interval (95% unless `level`) across seeds (no interval for one value); None for none."""
    x = np.asarray(list(values), dtype=np.float64)
    if x.size == 0:
        return None
    m = float(x.mean())
    t = float(stats.t.ppf((1 + level) / 2, x.size - 1)) if x.size > 1 else None
    half = t * float(x.std(ddof=1)) / math.sqrt(x.size) if x.size > 1 else None
    return {"mean": m, "lo": None if half is None else m - half, "hi": None if half is None else m + half,
            "n": int(x.size)}


def win_rate_ci(win_rates: list[float], single_ci=None) -> tuple[float, float]:
    """One seed: the run's own interval; more: the t-interval across seeds, clipped to [0, 1]."""
    if len(win_rates) == 1:
        lo, hi = single_ci if single_ci else (math.nan, math.nan)
        return float(lo), float(hi)
    ci = mean_ci(win_rates)
    return max(0.0, ci["lo"]), min(1.0, ci["hi"])


def paired_t(a: list[float], b: list[float]) -> dict:
    """a - b for runs paired by seed: the differences, their mean and 95% t-interval."""
    if len(a) != len(b):
        raise ValueError(f"paired_t needs equal-length arrays, got {len(a)} and {len(b)}")
    diffs = [float(x) - float(y) for x, y in zip(a, b)]
    ci = mean_ci(diffs) or {"n": 0, "mean": None, "lo": None, "hi": None}
    return {**ci, "diffs": diffs}


def paired_by_seed(a, b) -> dict | None:
    """a - b over the seeds where both score series (indexed by seed) have a value: paired_t's result, the
    seeds in order, each side's mean over them and the paired t-test's two-sided p (None below two pairs or
    where every difference is equal); None where they share no seed."""
    x, y = (dict(zip(s.index, s)) for s in (a.dropna(), b.dropna()))
    seeds = sorted(set(x) & set(y), key=str)
    if not seeds:
        return None
    t = paired_t([x[s] for s in seeds], [y[s] for s in seeds])
    d = np.asarray(t["diffs"])
    p = float(stats.ttest_1samp(d, 0.0).pvalue) if d.size > 1 and d.std() > 0 else None
    return {**t, "p": p, "seeds": seeds, "a_mean": float(np.mean([x[s] for s in seeds])),
            "b_mean": float(np.mean([y[s] for s in seeds]))}


def equivalence(diffs, margin: float) -> dict:
    """Two one-sided t-tests at alpha 0.05 on paired differences: equivalent within +-margin when their mean's 90%
    t-interval lies inside [-margin, +margin]; "n/a" below two seeds."""
    ci = mean_ci(diffs, level=0.90)
    if ci is None or ci["lo"] is None:
        return {"lo": None, "hi": None, "verdict": "n/a"}
    inside = -margin <= ci["lo"] and ci["hi"] <= margin
    return {"lo": ci["lo"], "hi": ci["hi"],
            "verdict": f"equivalent within +-{margin:g}" if inside else "not shown equivalent"}


def prompt_bootstrap(a, b, n_boot: int = 2000) -> dict:
    """a - b over (seeds x prompts) arrays paired by row and column: the per-prompt differences averaged over
    seeds, the prompts resampled (percentile interval). The seeds stay fixed, so it is prompt-level only."""
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    if d.ndim != 2 or d.size == 0:
        raise ValueError(f"prompt_bootstrap needs two equal (seeds x prompts) arrays, got shape {d.shape}")
    per_prompt = d.mean(axis=0)
    lo = hi = mean = float(per_prompt.mean())
    if np.ptp(per_prompt) > 0:  # scipy warns on degenerate data
        ci = stats.bootstrap((per_prompt,), np.mean, n_resamples=n_boot, confidence_level=0.95,
                             method="percentile", rng=np.random.default_rng(0)).confidence_interval
        lo, hi = float(ci.low), float(ci.high)
    return {"mean": mean, "lo": lo, "hi": hi, "n_seeds": d.shape[0], "n_prompts": d.shape[1], "n_boot": n_boot}


def fieller(x, y) -> dict:
    """mean(x) / mean(y) for paired x, y with Fieller's interval: the R with (a - R b)^2 <= t^2 (v11 - 2 R v12 +
    R^2 v22), the roots of (b^2 - t^2 v22) R^2 - 2 (a b - t^2 v12) R + (a^2 - t^2 v11). Finite only when
    b^2 > t^2 v22 (the t-interval of mean(y) excludes 0); otherwise `bounded` is False and lo, hi are None."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1 or x.size == 0:
        raise ValueError(f"fieller needs two equal non-empty 1-d arrays, got shapes {x.shape} and {y.shape}")
    n, a, b = x.size, float(x.mean()), float(y.mean())
    out = {"ratio": a / b if b != 0 else None, "lo": None, "hi": None, "bounded": False, "n": n}
    if n < 2:
        return out
    (v11, v12), (_, v22) = np.cov(x, y, ddof=1) / n
    t2 = float(stats.t.ppf(0.975, n - 1)) ** 2  # 95%
    qa, qb, qc = b * b - t2 * v22, a * b - t2 * v12, a * a - t2 * v11
    if qa <= 0:
        return out
    root = math.sqrt(max(qb * qb - qa * qc, 0.0))  # >= 0 when qa > 0; max() for rounding
    return {**out, "lo": float((qb - root) / qa), "hi": float((qb + root) / qa), "bounded": True}


def km_median(times, reached) -> float | None:
    """Kaplan-Meier median time to a target, a seed that never reaches it censored at its end (scipy.stats.ecdf);
    None when the share still short never falls to 1/2."""
    t, hit = np.asarray(times, dtype=np.float64), np.asarray(reached, dtype=bool)
    if t.size == 0 or not hit.any():
        return None
    sf = stats.ecdf(stats.CensoredData(uncensored=t[hit], right=t[~hit])).sf
    below = np.nonzero(sf.probabilities <= 0.5 + 1e-12)[0]
    return float(sf.quantiles[below[0]]) if below.size else None
