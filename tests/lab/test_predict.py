"""The cost model's arithmetic on counted work, against numbers computed by hand."""
from __future__ import annotations

import math

import pytest

from humanline_cli.lab.predict import (
    Target,
    Work,
    flops_per_token,
    generation_s,
    predict,
    sample_rate,
    target_from_json,
    within,
)
from humanline_cli.report.cost import Call

T = Target(name="t", source="hand", estimated=False, call_fixed_s=0.5, sample_tokens_per_s=1000.0, decode_step_s=0.01,
           concurrency=4, push_fixed_s=0.1, push_bytes_per_s=1e9, label_s_per_seq=0.001, train_flops_per_s=1e12,
           step_fixed_s=0.2, sync_fixed_s=0.05, sync_bytes_per_s=1e10, other_step_s=0.1)
W = Work(params=1e9, weight_bytes=2e9, calls=(Call(8, 2000, 300), Call(2, 40, 30)), steps=4, train_tokens=10_000,
         reference_forward=True, gradient_checkpointing=False, syncs=2)


def test_phases_by_hand():
    p = predict(W, T)
    # call 1: 2 waves of 4; throughput 2000 / 1000 = 2.0 s, latency 2 x 300 x 0.01 = 6.0 s -> 6.0 (+0.5 fixed)
    # call 2: 1 wave; throughput 0.04 s, latency 30 x 0.01 = 0.3 s -> 0.3 (+0.5)
    assert p["sample"] == pytest.approx(6.5 + 0.8, rel=1e-12)
    assert p["push"] == pytest.approx(2 * (0.1 + 2e9 / 1e9), rel=1e-12)          # 4.2
    assert p["label"] == pytest.approx(10 * 0.001, rel=1e-12)                     # 0.01
    # (6 + 2 reference) x 1e9 x 1e4 / 1e12 = 80 s, plus 4 x 0.2 s per step
    assert p["train"] == pytest.approx(80.8, rel=1e-12)
    assert p["sync"] == pytest.approx(2 * (0.05 + 2e9 / 1e10), rel=1e-12)         # 0.5
    assert p["other"] == pytest.approx(0.4, rel=1e-12)
    assert p["loop"] == pytest.approx(7.3 + 4.2 + 0.01 + 80.8 + 0.5 + 0.4, rel=1e-12)  # 93.21
    assert "wait_for_sample" not in p


def test_flop_factor():
    assert flops_per_token(W) == 8e9
    both = Work(**{**vars(W), "gradient_checkpointing": True})
    assert flops_per_token(both) == 10e9
    neither = Work(**{**vars(W), "reference_forward": False})
    assert flops_per_token(neither) == 6e9


def test_throughput_bound_and_gpus():
    # 400 sequences of 10 tokens on 4-wide waves: throughput 4000 / 1000 = 4 s > latency 100 x 10 x 0.01 = ...
    c = Call(400, 4000, 10)
    assert generation_s(c, T) == pytest.approx(max(4.0, 100 * 10 * 0.01), rel=1e-12)  # 10 s: latency still
    c = Call(400, 40_000, 10)
    assert generation_s(c, T) == pytest.approx(40.0, rel=1e-12)  # throughput 40 s > latency 10 s
    t8 = Target(**{**vars(T), "gpus": 8})
    # 8 devices: waves ceil(400 / 32) = 13, throughput 40_000 / 8000 = 5 s, latency 13 x 10 x 0.01 = 1.3 s
    assert generation_s(c, t8) == pytest.approx(5.0, rel=1e-12)
    # training divides over the devices, syncs and pushes (each device its own copy) do not
    p1, p8 = predict(W, T), predict(W, t8)
    assert p8["train"] == pytest.approx(4 * 0.2 + 80.0 / 8, rel=1e-12)
    assert p8["sync"] == p1["sync"] and p8["push"] == p1["push"]
    assert p8["label"] == pytest.approx(p1["label"] / 8, rel=1e-12)


def test_measured_curve_sets_the_rate_at_each_call_size():
    # tokens/s measured at 8, 512 and 8192 sequences per call; log-linear between them, the ends held outside
    curved = Target(**{**vars(T), "sample_curve": ((512, 5000.0), (8, 1000.0), (8192, 6000.0))})
    assert sample_rate(curved, 4) == 1000.0 and sample_rate(curved, 8) == 1000.0
    assert sample_rate(curved, 512) == 5000.0 and sample_rate(curved, 100_000) == 6000.0
    # 2048 sequences: log2 11 between log2 9 and log2 13, half way: 5000 + (6000 - 5000) / 2
    assert sample_rate(curved, 2048) == pytest.approx(5500.0, rel=1e-12)
    # 64 sequences: log2 6 between log2 3 and log2 9, half way: 1000 + (5000 - 1000) / 2
    assert sample_rate(curved, 64) == pytest.approx(3000.0, rel=1e-12)
    # a 2048-sequence call of 11,000 tokens: throughput 11,000 / 5500 = 2.0 s; latency 512 waves of 4 x 5 x 0.01
    c = Call(2048, 11_000, 5)
    assert generation_s(c, curved) == pytest.approx(max(2.0, 512 * 5 * 0.01), rel=1e-12)  # 25.6 s: latency
    fast = Target(**{**vars(curved), "concurrency": 4096})
    assert generation_s(c, fast) == pytest.approx(2.0, rel=1e-12)
    # 8 devices: each holds 256 sequences, between 8 and 512 at log2 8 of log2 3..9: 1000 + 4000 x 5/6
    c8 = Target(**{**vars(fast), "gpus": 8})
    assert generation_s(c, c8) == pytest.approx(11_000 / (8 * (1000 + 4000 * 5 / 6)), rel=1e-12)
    # without a curve the peak is used, and a curve read from the bench's JSON round-trips
    assert sample_rate(T, 2048) == 1000.0
    d = {"constants": {**{k: getattr(T, k) for k in ("call_fixed_s", "sample_tokens_per_s", "decode_step_s",
                                                      "concurrency", "push_fixed_s", "push_bytes_per_s",
                                                      "label_s_per_seq", "train_flops_per_s", "step_fixed_s",
                                                      "sync_fixed_s", "sync_bytes_per_s")},
                       "sample_curve": [[8, 1000.0], [512, 5000.0]]}}
    assert target_from_json(d).sample_curve == ((8.0, 1000.0), (512.0, 5000.0))


def test_async_overlap():
    lagged = Work(**{**vars(W), "async_lag": 1})
    p = predict(lagged, T)
    trainer = 4.2 + 0.01 + 80.8 + 0.5 + 0.4  # 85.91 over 2 rounds: 42.955 each
    # wall = first call 6.5 + max(42.955, call 2's 0.8) + max(42.955, nothing left) = 92.41
    assert p["loop"] == pytest.approx(6.5 + 2 * (trainer / 2), rel=1e-12)
    assert p["wait_for_sample"] == pytest.approx(6.5, rel=1e-12)
    # a sampler slower than the trainer: the calls set the pace
    slow = Target(**{**vars(T), "train_flops_per_s": 1e14, "step_fixed_s": 0.0})
    q = predict(lagged, slow)
    trainer = 4.2 + 0.01 + 0.8 + 0.5 + 0.4  # train: 8e13 / 1e14 = 0.8 s
    assert q["loop"] == pytest.approx(6.5 + max(trainer / 2, 0.8) + trainer / 2, rel=1e-12)


def test_async_overlap_factors_scale_sampling_train_and_other():
    lagged = Work(**{**vars(W), "async_lag": 1})
    shared = Target(**{**vars(T), "async_sample_factor": 1.5, "async_train_factor": 1.1, "async_other_factor": 2.0})
    p = predict(lagged, shared)
    assert p["sample"] == pytest.approx(1.5 * 7.3, rel=1e-12)
    assert p["train"] == pytest.approx(1.1 * 80.8, rel=1e-12) and p["other"] == pytest.approx(2.0 * 0.4, rel=1e-12)
    trainer = 4.2 + 0.01 + 1.1 * 80.8 + 0.5 + 2.0 * 0.4  # 94.39 over 2 rounds
    assert p["loop"] == pytest.approx(1.5 * 6.5 + trainer, rel=1e-12)  # the first call, then the trainer's pace
    assert p["wait_for_sample"] == pytest.approx(1.5 * 6.5, rel=1e-12)
    # synchronous rounds: the factors do not apply (one process at a time)
    assert predict(W, shared) == predict(W, T)
    assert target_from_json({"constants": {**{k: getattr(shared, k) for k in (
        "call_fixed_s", "sample_tokens_per_s", "decode_step_s", "concurrency", "push_fixed_s", "push_bytes_per_s",
        "label_s_per_seq", "train_flops_per_s", "step_fixed_s", "sync_fixed_s", "sync_bytes_per_s")},
        "async_train_factor": 1.1}}).async_train_factor == 1.1


def test_other_once_per_run_plus_per_step():
    once = Target(**{**vars(T), "other_once_s": 0.3})
    assert predict(W, once)["other"] == pytest.approx(0.3 + 4 * 0.1, rel=1e-12)
    assert predict(W, once)["loop"] == pytest.approx(predict(W, T)["loop"] + 0.3, rel=1e-12)


def test_calls_inside_the_loop_scale_by_the_loop_factor():
    loop = Target(**{**vars(T), "sample_loop_factor": 1.2})
    assert predict(W, loop)["sample"] == pytest.approx(1.2 * 7.3, rel=1e-12)
    assert predict(W, loop)["loop"] == pytest.approx(predict(W, T)["loop"] + 0.2 * 7.3, rel=1e-12)
    both = Target(**{**vars(loop), "async_sample_factor": 1.5})  # the sampler process: both factors
    assert predict(Work(**{**vars(W), "async_lag": 1}), both)["sample"] == pytest.approx(1.5 * 1.2 * 7.3, rel=1e-12)


def test_other_grows_with_the_steps_tokens():
    # 10,000 forward tokens over the run at 2e-5 s each: 0.2 s beside the per-step 4 x 0.1
    tok = Target(**{**vars(T), "other_s_per_token": 2e-5})
    assert predict(W, tok)["other"] == pytest.approx(4 * 0.1 + 10_000 * 2e-5, rel=1e-12)
    assert target_from_json({"constants": {**{k: getattr(tok, k) for k in (
        "call_fixed_s", "sample_tokens_per_s", "decode_step_s", "concurrency", "push_fixed_s", "push_bytes_per_s",
        "label_s_per_seq", "train_flops_per_s", "step_fixed_s", "sync_fixed_s", "sync_bytes_per_s")},
        "other_s_per_token": 2e-5}}).other_s_per_token == 2e-5


def test_live_weights_push_is_fixed_cost_only():
    live = Target(**{**vars(T), "push_bytes_per_s": math.inf, "push_fixed_s": 0.0})
    assert predict(W, live)["push"] == 0.0


def test_within():
    assert within(114.9, 100.0) and within(85.1, 100.0)
    assert not within(115.1, 100.0) and not within(84.9, 100.0)
    assert not within(1.0, 0.0)


def test_paper_settings_counted_work():
    """The paper's runs, counted from their composed configs: math online generates every step (1600 calls of
    32 groups x 8), stale-64 every 64 steps (25 calls of 64 x 32 x 8 = 16,384), humanline syncs every 16 steps;
    instruction following online samples 512 prompts x 8 per round, a round serving 512 / 32 = 16 steps."""
    from hydra import compose, initialize_config_module

    from humanline_cli.lab.paper_speed import SETTINGS, counted_work

    math_, instr = SETTINGS
    with initialize_config_module(config_module="conf", version_base="1.3"):
        on = counted_work(compose("train", overrides=math_.regimes[0][1]), math_, 1)
        st = counted_work(compose("train", overrides=math_.regimes[1][1]), math_, 1)
        hl = counted_work(compose("train", overrides=math_.regimes[2][1]), math_, 1)
        io = counted_work(compose("train", overrides=instr.regimes[0][1]), instr, 1)
        off = counted_work(compose("train", overrides=instr.regimes[2][1]), instr, 1)
    assert len(on.calls) == 1600 and on.calls[0] == Call(256, 256 * 600, 2048) and on.syncs == 1600
    assert len(st.calls) == 25 and st.calls[0].sequences == 16384 and st.syncs == 25
    assert len(hl.calls) == 25 and hl.syncs == 1600 // 16
    # the same sequences are trained either way: 1600 steps x 256 x (200 + 600) tokens
    assert on.train_tokens == st.train_tokens == 1600 * 256 * 800
    assert on.gradient_checkpointing and flops_per_token(on) == 10 * on.params
    assert len(io.calls) == math.ceil(300 / 16) and io.calls[0].sequences == 512 * 8
    assert off.calls == () and off.syncs == 300 and off.train_tokens == 300 * 32 * 2 * 700
