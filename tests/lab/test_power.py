"""The power calculation a registration fills from its pilot's SD: the paired TOST at margin 0.05 (alpha 0.05,
the report's `equivalence`) when the true difference is 0."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sst

from humanline_cli.lab.power import tost_power, tost_seeds


def test_tost_power_matches_a_simulation_of_the_reports_rule():
    # 200,000 studies of 14 paired differences ~ N(0, 0.06): the share whose 90% t-interval lies in [-0.05, 0.05]
    n, sd, margin = 14, 0.06, 0.05
    d = np.random.default_rng(0).normal(0.0, sd, size=(200_000, n))
    half = sst.t.ppf(0.95, n - 1) * d.std(axis=1, ddof=1) / math.sqrt(n)
    simulated = float(np.mean(np.abs(d.mean(axis=1)) + half <= margin))
    # the simulation's own standard error is sqrt(0.8 x 0.2 / 200,000) = 0.0009
    assert tost_power(n, sd, margin) == pytest.approx(simulated, abs=0.004)


def test_seeds_for_80_percent_power_at_the_issues_sd():
    # the smollm2_study's SD of paired greedy differences, 0.06: at its 5 seeds the power is 16%
    assert tost_power(5, 0.06, 0.05) == pytest.approx(0.161, abs=0.001)
    # exact power crosses 0.80 between 13 (0.764) and 14 (0.808) seeds
    assert tost_power(13, 0.06, 0.05) < 0.8 <= tost_power(14, 0.06, 0.05)
    assert tost_seeds(0.06, 0.05) == 14
    # the usual t approximation, n >= (sd / margin)^2 (t(0.95, n-1) + t(0.90, n-1))^2, asks one more:
    # n = 14: 1.2 x (1.7709 + 1.3502) = 3.7453 > sqrt(14) = 3.7417; n = 15: 1.2 x (1.7613 + 1.3450) = 3.7276 <= 3.8730
    approx = next(n for n in range(2, 100)
                  if math.sqrt(n) >= 1.2 * (sst.t.ppf(0.95, n - 1) + sst.t.ppf(0.90, n - 1)))
    assert approx == 15
    # a small SD still takes the floor of 10 seeds; the sampled metric's 0.085 needs far more
    assert tost_seeds(0.02, 0.05) == 10 and tost_seeds(0.085, 0.05) == 27


def test_tost_p_agrees_with_the_90_percent_interval_and_is_worked_by_hand():
    from humanline_cli.lab.power import tost_p
    from humanline_cli.report.stats import equivalence

    # diffs 0.01, 0.03, -0.01, 0.02: mean 0.0125, sd 0.01708, se 0.008539, df 3;
    # t = (0.05 - 0.0125) / 0.008539 = 4.3915 (upper) and (0.05 + 0.0125) / 0.008539 = 7.3191 (lower)
    d = [0.01, 0.03, -0.01, 0.02]
    se = float(np.std(d, ddof=1)) / 2
    assert se == pytest.approx(0.0085391, abs=1e-7)
    assert tost_p(d, 0.05) == pytest.approx(sst.t.sf((0.05 - 0.0125) / se, 3))  # the larger of the two
    assert tost_p(d, 0.05) == pytest.approx(0.010938, abs=2e-6)  # P(t(3) >= 4.3915)
    for diffs, margin in ((d, 0.05), (d, 0.03), ([0.04, 0.06, 0.05], 0.05), ([0.1, -0.1, 0.05, 0.0], 0.2)):
        p = tost_p(diffs, margin)
        assert (p < 0.05) == equivalence(diffs, margin)["verdict"].startswith("equivalent")
    assert tost_p([0.01], 0.05) is None


def test_holm_steps_down_and_stops_at_the_first_kept():
    from humanline_cli.lab.power import holm

    # three tests at 0.05: the smallest against 0.05 / 3 = 0.0167, the next 0.025, the last 0.05
    assert holm({"a": 0.010, "b": 0.020, "c": 0.049}) == {"a": True, "b": True, "c": True}
    assert holm({"a": 0.010, "b": 0.060, "c": 0.001}) == {"a": True, "b": False, "c": True}
    # 0.001 <= 0.0167, then 0.03 > 0.025 stops it: 0.04 stands although it is below 0.05
    assert holm({"a": 0.030, "b": 0.040, "c": 0.001}) == {"a": False, "b": False, "c": True}
    assert holm({"a": 0.020, "b": 0.001, "c": 0.002}) == {"a": True, "b": True, "c": True}  # 0.001, 0.002 <= 0.025
    assert holm({"a": 0.017, "b": 0.018, "c": 0.019}) == {"a": False, "b": False, "c": False}  # 0.017 > 0.0167
