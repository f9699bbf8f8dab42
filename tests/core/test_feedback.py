"""Scores -> advantages, best-vs-worst pairs, KTO labels."""

from __future__ import annotations

import math

import pytest
import torch

from humanline_cli.core.feedback import ScoredGroup, best_vs_worst, group_advantages, kto_examples


def approx_list(xs, rel=1e-6):
    return pytest.approx(xs, rel=rel, abs=1e-7)


# ---------------------------------------------------------------- group_advantages
def test_advantages_ddof0_eps001():
    # mean 0.5, population std sqrt(4 * 0.25 / 4) = 0.5 -> +-0.5 / (0.5 + 0.01)
    a = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    assert a.tolist() == approx_list([0.5 / 0.51, -0.5 / 0.51, -0.5 / 0.51, 0.5 / 0.51])
    assert a.dtype == torch.float32


def test_advantages_defaults_are_ddof0_eps001():
    s = torch.tensor([3.0, 1.0, 2.0])
    assert torch.equal(group_advantages(s), group_advantages(s, std_ddof=0, std_eps=0.01))
    # mean 2, std sqrt((1 + 1 + 0) / 3)
    sd = math.sqrt(2 / 3)
    assert group_advantages(s).tolist() == approx_list([1 / (sd + 0.01), -1 / (sd + 0.01), 0.0])


def test_advantages_ddof1_differs():
    s = torch.tensor([1.0, 0.0, 0.0, 1.0])
    # sample std sqrt(1.0 / 3)
    a1 = group_advantages(s, std_ddof=1)
    sd = math.sqrt(1 / 3)
    a = 0.5 / (sd + 0.01)
    assert a1.tolist() == approx_list([a, -a, -a, a])
    a0 = group_advantages(s, std_ddof=0)
    assert not torch.allclose(a0, a1)
    assert abs(a0[0].item()) > abs(a1[0].item())  # population std is smaller


def test_advantages_custom_eps():
    a = group_advantages(torch.tensor([2.0, 0.0]), std_eps=0.0)  # mean 1, std 1
    assert a.tolist() == approx_list([1.0, -1.0])


def test_advantages_sum_to_zero():
    a = group_advantages(torch.tensor([0.3, 0.9, -0.2, 0.55, 0.1]))
    assert abs(a.sum().item()) < 1e-6


@pytest.mark.parametrize("G", [1, 2, 8])
@pytest.mark.parametrize("ddof", [0, 1])
@pytest.mark.parametrize("value", [0.0, 0.1, 0.7, -3.25])
def test_zero_variance_group_exact_zeros(G, ddof, value):
    a = group_advantages(torch.tensor([value] * G), std_ddof=ddof)
    assert not torch.isnan(a).any()
    assert torch.equal(a, torch.zeros(G))


@pytest.mark.parametrize("G", [3, 7])
def test_zero_variance_group_exact_zeros_float64_input(G):
    # 0.1 * G does not sum exactly in float64, so mean(s) != s_i by ~1e-17; the docstring
    # promises exactly 0 for a group of identical scores.
    a = group_advantages(torch.tensor([0.1] * G, dtype=torch.float64))
    assert torch.equal(a, torch.zeros(G))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_zero_variance_group_no_nan_with_zero_eps(dtype):
    # std_eps is a config key (peers use tiny epsilons); with 0 the identical group is 0/0.
    a = group_advantages(torch.tensor([0.1, 0.1, 0.1], dtype=dtype), std_eps=0.0)
    assert not torch.isnan(a).any()
    assert torch.equal(a, torch.zeros(3))


# ---------------------------------------------------------------- best_vs_worst / kto_examples
def grp(scores, completions=None):
    completions = completions or [chr(ord("a") + i) for i in range(len(scores))]
    return ScoredGroup(prompt="p", completions=completions, scores=scores)


def test_best_vs_worst_basic():
    assert best_vs_worst(grp([0.5, 0.9, 0.1, 0.3]), 0.01) == ("b", "c", 0.9, 0.1)


def test_best_vs_worst_gap_equal_to_min_gap_is_none():
    # gaps exactly representable in binary: 0.75 - 0.5 = 0.25
    assert best_vs_worst(grp([0.75, 0.5, 0.625]), 0.25) is None
    assert best_vs_worst(grp([0.75, 0.5, 0.625]), 0.375) is None
    assert best_vs_worst(grp([0.75, 0.5, 0.625]), 0.125) == ("a", "b", 0.75, 0.5)


def test_best_vs_worst_all_equal_none():
    assert best_vs_worst(grp([0.4, 0.4, 0.4]), 0.0) is None


def test_best_vs_worst_tie_breaking():
    # best ties -> first such completion; worst ties -> last such completion
    assert best_vs_worst(grp([0.2, 0.9, 0.2, 0.9, 0.5]), 0.01) == ("b", "c", 0.9, 0.2)
    assert best_vs_worst(grp([0.9, 0.9, 0.1, 0.1]), 0.01) == ("a", "d", 0.9, 0.1)


def test_best_vs_worst_fewer_than_two():
    assert best_vs_worst(grp([1.0]), 0.0) is None
    assert best_vs_worst(grp([]), 0.0) is None


def test_best_vs_worst_passes_completions_through():
    msgs = [[{"role": "assistant", "content": "x"}], [{"role": "assistant", "content": "y"}]]
    out = best_vs_worst(grp([-1.0, 2.0], msgs), 0.01)
    assert out[0] is msgs[1] and out[1] is msgs[0] and out[2:] == (2.0, -1.0)


def test_kto_examples():
    assert kto_examples(grp([0.5, 0.9, 0.1]), 0.01) == [("b", True), ("c", False)]
    assert kto_examples(grp([0.5, 0.5]), 0.01) == []
    assert kto_examples(grp([0.75, 0.5]), 0.25) == []
    assert kto_examples(grp([0.75]), 0.0) == []
