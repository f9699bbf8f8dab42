"""`python -m humanline_cli.lab.constants`: the cost model's constants measured with a real online run's parts on
the tiny world, written as JSON whose fitted numbers follow from the raw timings it also records, and read back
by `python -m humanline_cli.lab.speed --target`. The world is the shared cache's (HUMANLINE_CACHE, else ~/.cache/humanline;
the tests' session cache when another test set it first): built once, then only the bench is timed."""
from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys

import pytest

from humanline_cli.lab.constants import fit_line, other_line, sampler_target
from humanline_cli.lab.predict import call_s
from humanline_cli.precision import cpu_info
from humanline_cli.report.cost import Call
from tests.helpers.cli import TINY_WORLD


def _constants(args: list[str], cwd, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "humanline_cli.lab.constants", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


ONLINE = ["data=online", "objective=grpo", "train.batch_size=4", "data.prompts_per_round=4", "threads=1", *TINY_WORLD]


def test_constants_follow_from_the_recorded_timings(tmp_path):
    out = tmp_path / "constants.json"
    r = _constants(["--prompts", "16", "--steps", "3", "--out", str(out), *ONLINE], tmp_path, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(out.read_text())
    c = d["constants"]
    assert d["target"] == "this" and d["estimated"] is False and d["model"] == "tiny" and d["threads"] == 1
    assert d["loadavg_before"] and d["loadavg_after"]
    # the precision it was measured in (the default: fp32 on CPU), its copies' bytes, and the CPU it holds for
    assert (d["precision"], d["precision_why"], d["bytes_per_param"]) == ("fp32", None, 4)
    assert d["cpu"] == cpu_info()[0] and set(d["cpu_flags"]) <= set(cpu_info()[1])
    calls = d["detail"]["generation"]["calls"]
    # 1, then 16 / 64, / 16 (both raised to 2 prompts, kept once), / 4 and 16 prompts, x 8 samples
    assert [x["sequences"] for x in calls] == [8 * s for s in (1, 2, 4, 16)]
    # each size timed as often as spans about 3 s, 3 to 15 calls: a call's time is a median of many
    # (the one-prompt call takes a few hundredths of a second: the cap, 15)
    assert all(3 <= x["repeats"] <= 15 for x in calls) and calls[0]["repeats"] == 15
    assert c["concurrency"] == 256  # the HF sampler's batch size (conf/sampler: schema default)
    # peak tokens/s: the largest call's tokens over its time less the one-token call's fixed cost
    big = calls[-1]
    assert c["sample_tokens_per_s"] == pytest.approx(big["tokens"] / (big["seconds"] - c["call_fixed_s"]), rel=1e-12)
    # the curve: every size's tokens over its time less the fixed cost, by sequences per call
    assert c["sample_curve"] == [[x["sequences"], pytest.approx(x["tokens"] / (x["seconds"] - c["call_fixed_s"]),
                                                                rel=1e-12)] for x in calls]
    checks = d["detail"]["generation"]["check_inner_calls"]
    assert [x["sequences"] for x in checks] == [16, 32] and all(x["predicted_s"] > c["call_fixed_s"] for x in checks)
    small = calls[0]  # one wave: latency per decoding step over its longest completion
    assert c["decode_step_s"] == pytest.approx((small["seconds"] - c["call_fixed_s"]) / small["longest"], rel=1e-12)
    # training: the least-squares line through both mini-runs' (forward tokens, train seconds) points
    tr = d["detail"]["training"]
    assert [(t["batch_size"], t["async_lag"]) for t in tr] == [(4, 0), (2, 0), (4, 1)]
    a, b = fit_line([tuple(p) for t in tr[:2] for p in t["points"]])  # the line: the runs without the sampler process
    assert c["step_fixed_s"] == pytest.approx(a, rel=1e-12)
    assert c["train_flops_per_s"] == pytest.approx(8 * d["params"] / b, rel=1e-12)  # online: 6 + 2 reference
    assert math.isinf(c["push_bytes_per_s"]) and c["push_fixed_s"] >= 0 and c["sync_fixed_s"] > 0
    assert c["label_s_per_seq"] > 0 and c["other_step_s"] >= 0
    # the overlap factors: the run's batch with the sampler process beside it (lag 1) over the same batch alone
    alone, beside = tr[0], tr[2]
    step = lambda t: sum(s for _, s in t["points"]) / len(t["points"])  # noqa: E731
    assert c["async_train_factor"] == pytest.approx(step(beside) / step(alone), rel=1e-12)
    assert c["async_sample_factor"] == pytest.approx((beside["sample_s"] / beside["rounds"]) /
                                                     (alone["sample_s"] / alone["rounds"]), rel=1e-12)
    assert c["async_other_factor"] == pytest.approx((beside["other_s"] / beside["steps"]) /
                                                    (alone["other_s"] / alone["steps"]), rel=1e-12)
    assert beside["other_s"] > 0  # the sampler process's own times (sample, its wait for the trainer) are not the loop's
    assert alone["rounds"] == beside["rounds"] == 3  # 3 steps of 4 groups, rounds of 4 prompts: one a step
    # the sampler inside the loop: the alone runs' calls after their first, against the curve's prediction
    in_loop = d["detail"]["generation"]["in_loop_calls"]
    assert len(in_loop) >= 2 and all(x["sequences"] == 4 * 8 and x["seconds"] > 0 for x in in_loop)
    sampler = sampler_target(c)
    for x in in_loop:
        assert x["predicted_s"] == pytest.approx(call_s(Call(x["sequences"], x["tokens"], x["longest"]), sampler),
                                                 rel=1e-12)
    assert c["sample_loop_factor"] == pytest.approx(statistics.median(x["seconds"] / x["predicted_s"] for x in in_loop),
                                                    rel=1e-12)
    # `other` per step against the step's forward tokens, through the two batch sizes' runs
    assert tr[0]["tokens_per_step"] > tr[1]["tokens_per_step"] > 0
    o_step, o_tok = other_line([(t["tokens_per_step"], t["other_s"] / t["steps"]) for t in tr[:2]])
    assert (c["other_step_s"], c["other_s_per_token"]) == (pytest.approx(o_step, rel=1e-12, abs=1e-15),
                                                            pytest.approx(o_tok, rel=1e-12, abs=1e-18))
    # the one-time cost: the first (untimed) run's other beyond its 3 steps at the per-step rate
    first = d["detail"]["training_first"]
    per_step = c["other_step_s"] + c["other_s_per_token"] * first["tokens_per_step"]
    assert first["steps"] == 3 and c["other_once_s"] == pytest.approx(
        max(first["other_s"] - 3 * per_step, 0.0), rel=1e-12, abs=1e-15)


def test_other_line_rises_with_tokens_or_is_flat():
    # two batch sizes: exactly through both points (0.01 + 1e-5 x tokens)
    assert other_line([(1000.0, 0.02), (500.0, 0.015)]) == (pytest.approx(0.01, rel=1e-12), pytest.approx(1e-5, rel=1e-12))
    # falling with tokens is noise: the mean, flat
    assert other_line([(1000.0, 0.01), (500.0, 0.02)]) == (pytest.approx(0.015, rel=1e-12), 0.0)
    # a negative intercept: through zero (y = b x, b = sum y / sum x = 0.03 / 1500)
    assert other_line([(1000.0, 0.025), (500.0, 0.005)]) == (0.0, pytest.approx(0.03 / 1500, rel=1e-12))


def test_constants_need_an_online_run(tmp_path):
    r = _constants(TINY_WORLD, tmp_path)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "data=online" in err[0]
