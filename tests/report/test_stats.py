"""The report's statistics, pure functions of arrays: Fieller's interval for a ratio of paired means and the
Kaplan-Meier median of censored times to a target, the equivalence test, against numbers worked by hand."""
from __future__ import annotations

import math

import pytest

from humanline_cli.report.stats import equivalence, fieller, km_median, paired_t


def test_fieller_four_seeds_from_the_quadratic():
    # in hundredths: x = 10, 15, 14, 5 (mean a = 11, deviations -1, 4, 3, -6), y = 20, 22, 18, 20 (mean b = 20,
    # deviations 0, 2, -2, 0); variances of the means, sample (co)variance / 4:
    # v11 = (1 + 16 + 9 + 36) / 3 / 4 = 62/12, v22 = (4 + 4) / 3 / 4 = 8/12, v12 = (8 - 6) / 3 / 4 = 2/12
    x, y = [0.10, 0.15, 0.14, 0.05], [0.20, 0.22, 0.18, 0.20]
    t2 = 3.182446 ** 2  # t(0.975, 3)^2 = 10.127963
    qa = 20**2 - t2 * 8 / 12      # 400 - 6.751975 = 393.248025
    qb = 11 * 20 - t2 * 2 / 12    # 220 - 1.687994 = 218.312006
    qc = 11**2 - t2 * 62 / 12     # 121 - 52.327808 = 68.672192
    root = math.sqrt(qb**2 - qa * qc)  # sqrt(47660.13 - 27005.26) = 143.7180
    f = fieller(x, y)
    assert f["bounded"] and f["n"] == 4 and f["ratio"] == pytest.approx(11 / 20)
    assert (f["lo"], f["hi"]) == pytest.approx(((qb - root) / qa, (qb + root) / qa), abs=1e-6)
    assert (f["lo"], f["hi"]) == pytest.approx((0.189686, 0.920616), abs=1e-6)
    # the ends are the R at which the paired t-interval of x - R y just touches 0
    lo_side = paired_t([a - f["lo"] * b for a, b in zip(x, y)], [0.0] * 4)
    hi_side = paired_t([a - f["hi"] * b for a, b in zip(x, y)], [0.0] * 4)
    assert lo_side["lo"] == pytest.approx(0.0, abs=1e-12) and hi_side["hi"] == pytest.approx(0.0, abs=1e-12)


def test_fieller_is_unbounded_when_the_denominator_interval_reaches_zero():
    # y = 0.004, 0.008: b = 0.006, v22 = 0.004^2 / 2 / 2 = 4e-6, t(0.975, 1)^2 = 161.45:
    # b^2 - t^2 v22 = 3.6e-5 - 6.458e-4 < 0, the denominator's t-interval holds 0
    f = fieller([0.002, 0.004], [0.004, 0.008])
    assert not f["bounded"] and f["lo"] is None and f["hi"] is None and f["ratio"] == pytest.approx(0.5)
    # one pair: the ratio, no interval
    assert fieller([0.1], [0.2]) == {"ratio": pytest.approx(0.5), "lo": None, "hi": None, "bounded": False, "n": 1}
    with pytest.raises(ValueError):
        fieller([0.1, 0.2], [0.2])


def test_km_median_with_censored_seeds():
    # nothing censored: the ordinary median for odd n, the lower middle for even n
    assert km_median([3.0, 1.0, 2.0], [True] * 3) == 2.0
    assert km_median([4.0, 1.0, 3.0, 2.0], [True] * 4) == 2.0
    # seeds ending (censored) at 1 and 5, one reaching it at 2: at 2 two seeds are at risk and one reaches it,
    # so the share still short of the target is 1 x (1 - 1/2) = 1/2: the median is 2 (a mean over the seeds
    # that reached it would say 2 as well, but from one seed of three)
    assert km_median([5.0, 1.0, 2.0], [False, False, True]) == 2.0
    # reached at 2 and 4, censored at 3 and 6: the share short drops to 3/4 at 2, to 3/4 x 1/2 = 3/8 at 4
    assert km_median([2.0, 3.0, 4.0, 6.0], [True, False, True, False]) == 4.0
    # censored at 8 and 9, reached at 2: the share short stays at 2/3 > 1/2, no median
    assert km_median([2.0, 8.0, 9.0], [True, False, False]) is None
    assert km_median([1.0], [False]) is None and km_median([], []) is None


# per-seed differences [0.01, -0.02, 0.03, 0.00, 0.02]: mean 0.04 / 5 = 0.008; deviations 0.002, -0.028, 0.022,
# -0.008, 0.012, squares summing to 1480e-6, so sd^2 = 1480e-6 / 4 = 370e-6 and se = sqrt(370e-6 / 5) =
# sqrt(74e-6) = 0.0086023253; t(0.95, 4) = 2.131847, half-width 2.131847 * 0.0086023253 = 0.0183388413;
# the 90% interval [0.008 - 0.0183388, 0.008 + 0.0183388] = [-0.0103388, +0.0263388]
DIFFS = [0.01, -0.02, 0.03, 0.00, 0.02]
LO, HI = -0.0103388413, 0.0263388413


def test_the_90_percent_interval_and_verdicts_by_hand():
    wide = equivalence(DIFFS, 0.05)
    assert (wide["lo"], wide["hi"]) == pytest.approx((LO, HI), abs=5e-9)  # t to 6 decimals: +-4.3e-9
    assert wide["verdict"] == "equivalent within +-0.05"  # -0.05 <= -0.0103 and +0.0263 <= 0.05
    assert equivalence(DIFFS, 0.02)["verdict"] == "not shown equivalent"  # +0.0263 > 0.02
    assert equivalence([0.01], 0.05) == {"lo": None, "hi": None, "verdict": "n/a"}
