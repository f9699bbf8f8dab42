"""`humanline bench`: argument split, the throughput arithmetic, and real runs through the CLI on the
tiny world (project plain, project +humanline and, when TRL is importable, TRL on the same data)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from humanline_cli.bench.clock import Run
from humanline_cli.bench.project import parse_args, summarise
from humanline_cli.errors import UserError
from tests.helpers.cli import TINY_WORLD, run_cli

HAS_TRL = importlib.util.find_spec("trl") is not None


def test_bench_keys_and_hydra_overrides_are_split():
    opts, overrides = parse_args(["objective=kto", "steps=5", "batch_size=16", "threads=2", "trl=false",
                                  "out=x.json", "+humanline=true", "task.world.sft.steps=40", "sampler=true"])
    assert (opts["steps"], opts["batch_size"], opts["threads"], opts["trl"], opts["out"], opts["sampler"]) == \
        (5, 16, 2, False, "x.json", True)
    assert opts["warmup"] == 2 and opts["repeats"] == 2  # defaults
    assert overrides == ["objective=kto", "+humanline=true", "task.world.sft.steps=40"]
    for bad in (["steps=0"], ["warmup=0"], ["steps=many"], ["trl=maybe"], ["objective"]):
        with pytest.raises(UserError):
            parse_args(bad)


@pytest.mark.parametrize("arg, msg", [
    ("prompts=0", "bench: prompts must be >= 1, got 0"),
    ("cache=maybe", "bench: cache must be true or false, got 'maybe'"),
    ("sampler=1", "bench: sampler must be true or false, got '1'"),
    ("batch_size=0", "bench: batch_size must be >= 1 or null (the config's own), got 0"),
    ("threads=0", "bench: threads must be >= 1 or null (the config's own), got 0"),
    ("trl=maybe", "bench: trl must be auto, true or false, got 'maybe'"),
    ("trl=2", "bench: trl must be auto, true or false, got '2'"),
])
def test_bench_keys_refuse_a_zero_size_and_a_non_boolean(arg, msg):
    with pytest.raises(UserError) as e:
        parse_args([arg])
    assert str(e.value) == msg


def _unwritable_outs(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    return [(tmp_path, f"bench: out={tmp_path} is a directory; name a file such as {tmp_path / 'bench.json'}"),
            (a_file / "b.json", f"bench: cannot write out={a_file / 'b.json'}: {a_file} is not a directory"),
            (Path("/proc/bench.json"), "bench: cannot write out=/proc/bench.json: ")]


def test_bench_out_is_checked_before_measuring(tmp_path, capsys, monkeypatch):
    import humanline_cli.bench.project as project
    import humanline_cli.lab.constants as constants

    def measure(*a, **k):  # never reached: out= is checked first
        raise AssertionError("measured before checking out=")

    monkeypatch.setattr(project, "run_bench", measure)
    monkeypatch.setattr(constants, "measure", measure)
    for out, msg in _unwritable_outs(tmp_path):
        for run, args in ((project.main_bench, [f"out={out}"]), (constants.main, ["--out", str(out)]),
                          (constants.main, ["--pool", str(tmp_path / "missing.json"), "--out", str(out)])):
            assert run(args) == 2
            err = capsys.readouterr().err
            assert err.startswith(f"humanline: error: {msg}") and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # nothing written


def test_summarise_arithmetic():
    # two runs: 3 steps of 0.5 s and 2 steps of 1.0 s, 8 units and 100 tokens (+ 40 KL tokens) per step
    runs = [Run([0.5, 0.5, 0.5], [8] * 3, [100] * 3, [40] * 3), Run([1.0, 1.0], [8] * 2, [100] * 2, [40] * 2)]
    row = summarise("project", runs, matmul_params=1000, peak=1e7)
    # 5 steps, 3.5 s, 40 units, 500 tokens, 200 KL tokens
    assert row["units_per_s"] == pytest.approx(40 / 3.5) and row["tokens_per_s"] == pytest.approx(500 / 3.5)
    assert row["step_s"] == pytest.approx(0.7) and row["step_s_per_run"] == pytest.approx([0.5, 1.0])
    # 8 P T (policy fwd+bwd 6PT + reference fwd 2PT) + 4 P T_kl = 8*1000*500 + 4*1000*200 = 4.8e6 FLOP
    assert row["flops_per_s"] == pytest.approx(4.8e6 / 3.5) and row["mfu"] == pytest.approx(4.8e6 / 3.5 / 1e7)
    assert "run_mfu" not in row  # no decoder positions recorded (TRL's rows)
    # the decoder ran 60 positions a step (rows sharing prompts): 8 P x 300 + 4 P x 200 = 3.2e6 FLOP ran
    for r in runs:
        r.positions = [60] * len(r.seconds)
    row = summarise("project", runs, matmul_params=1000, peak=1e7)
    assert row["positions"] == 300 and row["run_mfu"] == pytest.approx(3.2e6 / 3.5 / 1e7)


@pytest.fixture(scope="module")
def tiny_world(cache_dir):
    """Build the tiny world once, up front, so each CLI test below times only the bench."""
    from humanline_cli.bench.project import compose_spec
    from humanline_cli.train.build import prepare_world, resolve_path

    opts, overrides = parse_args(["threads=1", *TINY_WORLD])
    spec = compose_spec(overrides, opts, humanline=False)
    prepare_world(spec, progress=False)
    return resolve_path("world://policy", spec)


def _bench(tmp_path, objective: str) -> tuple[dict, str]:
    out = tmp_path / f"{objective}.json"
    r = run_cli(["bench", f"objective={objective}", "steps=2", "warmup=1", "repeats=1", "batch_size=8", "threads=1",
                 f"out={out}", *TINY_WORLD], cwd=tmp_path, env_extra={"COLUMNS": "200"}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text()), r.stdout


@pytest.mark.parametrize("objective,unit", [("dpo", "pairs"), ("ipo", "pairs"), ("kto", "examples"), ("grpo", "groups")])
def test_bench_cli_writes_consistent_json(tiny_world, tmp_path, objective, unit):
    res, stdout = _bench(tmp_path, objective)
    assert res["objective"] == objective and res["unit"] == unit and res["device"] == "cpu"
    assert res["precision"] == "fp32" and res["threads"] == 1 and res["batch_size"] == 8
    expected = {"project", "project_humanline", "project_cached"} | ({"trl"} if HAS_TRL else set())
    if HAS_TRL and objective != "grpo":
        expected.add("trl_cached")
    assert set(res["rows"]) == expected
    peak = res["matmul_peak"]["flops_per_s"]
    assert peak > 0 and res["params"] >= res["matmul_params"] > 0
    for row in res["rows"].values():
        assert row["steps_timed"] == 2 and row["units"] == 2 * 8  # the warm-up step is not timed
        assert row["units_per_s"] > 0 and row["tokens_per_s"] > 0 and row["flops_per_s"] > 0
        assert row["units_per_s"] == pytest.approx(row["units"] / row["seconds"], rel=1e-12)
        assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["seconds"], rel=1e-12)
        flops = 8 * res["matmul_params"] * row["tokens"] + 4 * res["matmul_params"] * row["kl_tokens"]
        assert row["flops_per_s"] == pytest.approx(flops / row["seconds"], rel=1e-12)
        assert row["mfu"] == pytest.approx(row["flops_per_s"] / peak, rel=1e-12)
        assert (row["kl_tokens"] > 0) == (objective == "kto")
    for name in ("project", "project_humanline", "project_cached"):  # the positions each step's decoder ran
        row = res["rows"][name]
        ran = 8 * res["matmul_params"] * row["positions"] + 4 * res["matmul_params"] * row["kl_tokens"]
        assert row["positions"] > 0 and row["run_mfu"] == pytest.approx(ran / row["seconds"] / peak, rel=1e-12)
    plain, hl = res["rows"]["project"], res["rows"]["project_humanline"]
    assert plain["tokens"] == hl["tokens"]  # same seed, same batches: only the reference differs
    assert res["humanline_overhead"] == pytest.approx(hl["step_s"] / plain["step_s"], rel=1e-12)
    assert "humanline overhead" in stdout
    cached = res["rows"]["project_cached"]
    assert cached["tokens"] == plain["tokens"]  # the same batches, the reference forward skipped
    assert cached["reference_cache_hit_fraction"] == 1.0 and "reference_cache_hit_fraction" not in plain
    assert res["cache_speedup"] == pytest.approx(plain["step_s"] / cached["step_s"], rel=1e-12)
    assert f"{res['cache_speedup']:.2f}x" in stdout
    if HAS_TRL:
        trl = res["rows"]["trl"]
        assert res["trl_ratio"] == pytest.approx(plain["units_per_s"] / trl["units_per_s"], rel=1e-12)
        assert res["trl_humanline_ratio"] == pytest.approx(hl["units_per_s"] / trl["units_per_s"], rel=1e-12)
        # TRL tokenises the same conversations to the same tokens (its order differs; sizes are close)
        assert 0.8 < trl["tokens"] / plain["tokens"] < 1.25
        assert f"{res['trl_ratio']:.2f}x" in stdout and "TRL" in stdout
        assert ("GRPOTrainer.compute_loss" in (res["trl_note"] or "")) == (objective == "grpo")
        if objective != "grpo":
            ratio = cached["units_per_s"] / res["rows"]["trl_cached"]["units_per_s"]
            assert res["trl_cached_ratio"] == pytest.approx(ratio, rel=1e-12)
            assert "precompute_ref_log_probs" in stdout
    else:
        assert res["trl_ratio"] is None and "TRL not installed" in res["trl_note"]


def test_bench_rejects_online_data(tiny_world, tmp_path):
    r = run_cli(["bench", "data=online", "steps=1", "warmup=1", "repeats=1", *TINY_WORLD], cwd=tmp_path)
    assert r.returncode == 2 and "offline" in r.stderr and "Traceback" not in r.stderr


def test_ctrl_c_while_measuring_is_one_line_exit_130(tmp_path, capsys, monkeypatch):
    import signal

    import humanline_cli.bench.project as project

    def measure(*a, **k):  # Ctrl-C lands mid-measurement
        raise KeyboardInterrupt

    monkeypatch.setattr(project, "run_bench", measure)
    monkeypatch.chdir(tmp_path)
    handler = signal.getsignal(signal.SIGINT)
    try:
        assert project.main_bench([]) == 130
    finally:
        signal.signal(signal.SIGINT, handler)
    assert capsys.readouterr().err == "humanline: bench interrupted (Ctrl-C) while measuring; nothing was written\n"
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(not HAS_TRL, reason="TRL not installed")
def test_bench_online_grpo_against_trl_grpo_trainer(tiny_world, tmp_path):
    """objective=grpo data=online: the project's online GRPO steps and TRL's GRPOTrainer.train, on the same prompts,
    labeller, group size and prompts per step: both rows time their steps, and each saw 4 prompts x 4 completions
    per step by its own record (the project's rounds; the prompts and completions TRL's reward function was given)."""
    out = tmp_path / "online.json"
    r = run_cli(["bench", "objective=grpo", "data=online", "steps=2", "warmup=1", "repeats=1", "batch_size=4",
                 "data.n=4", "data.max_new_tokens=8", "train.micro_batch_size=2", "threads=1", f"out={out}",
                 *TINY_WORLD], cwd=tmp_path, env_extra={"COLUMNS": "200"}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res["rows"]) == {"project", "trl"} and res["regime"] == "online" and res["trl_note"] is None
    assert res["online"]["n"] == 4 and res["online"]["prompts_per_step"] == 4
    for row in res["rows"].values():
        assert row["steps_timed"] == 2 and row["steps_per_s"] > 0 and row["tokens"] > 0
        assert row["units_per_step"] == [4, 4] and row["completions_per_step"] == [16, 16]
    project, trl = res["rows"]["project"], res["rows"]["trl"]
    assert res["trl_steps_ratio"] == pytest.approx(project["steps_per_s"] / trl["steps_per_s"], rel=1e-12)
    assert f"{res['trl_steps_ratio']:.2f}x" in r.stdout and "GRPOTrainer.train" in r.stdout


def test_summarise_gives_a_bf16_rows_share_of_the_fp32_peak_too():
    runs = [Run([0.5, 0.5], [8] * 2, [100] * 2, [0] * 2, precision="bfloat16")]
    row = summarise("trl", runs, matmul_params=1000, peak=4e7, fp32_peak=1e7)
    # 8 P T = 8 * 1000 * 200 = 1.6e6 FLOP in 1 s: 4% of the bf16 peak, 16% of the fp32 one
    assert row["mfu"] == pytest.approx(0.04) and row["mfu_fp32"] == pytest.approx(0.16)
    assert row["precision"] == "bfloat16"
    assert "mfu_fp32" not in summarise("trl", runs, matmul_params=1000, peak=4e7)  # an fp32 run: one peak


@pytest.mark.skipif(not HAS_TRL, reason="TRL is the [bench] extra")
def test_a_bf16_bench_runs_trl_with_bf16_true_beside_it(tiny_world, tmp_path):
    """backend.precision=bf16 on CPU: our steps under bf16 autocast, TRL's with bf16=True (TRL in fp32 against us in
    bf16 would be no comparison), each row's model FLOP/s as a share of the bf16 and of the fp32 matmul peak."""
    out = tmp_path / "bf16.json"
    r = run_cli(["bench", "objective=dpo", "steps=2", "warmup=1", "repeats=1", "batch_size=8", "threads=1",
                 "cache=false", "backend.precision=bf16", f"out={out}", *TINY_WORLD], cwd=tmp_path,
                env_extra={"COLUMNS": "200"}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["precision"] == "bfloat16" and res["matmul_peak"]["dtype"] == "bfloat16"
    assert res["rows"]["trl"]["precision"] == "bfloat16" and "TRL (bf16=True)" in r.stdout
    fp32_peak = res["fp32_matmul_peak"]
    assert fp32_peak > 0 and f"fp32 {fp32_peak / 1e9:.1f} GFLOP/s" in r.stdout
    for row in res["rows"].values():
        assert row["mfu_fp32"] == pytest.approx(row["flops_per_s"] / fp32_peak, rel=1e-12)


def test_sigterm_while_measuring_ends_with_one_line(monkeypatch, capsys, tmp_path):
    import os
    import signal
    import time

    from humanline_cli.bench import project

    def measure(*a):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
        raise AssertionError("SIGTERM did not stop the bench")

    monkeypatch.setattr(project, "run_bench", measure)
    unhandled = []  # where bench sets no handler of its own, this one takes the signal (not the test process)
    before = signal.signal(signal.SIGTERM, lambda *a: unhandled.append(a))
    try:
        assert project.main_bench([f"out={tmp_path / 'b.json'}"]) == 143
    finally:
        guard = signal.signal(signal.SIGTERM, before)
    assert capsys.readouterr().err == "humanline: bench stopped by SIGTERM while measuring; nothing was written\n"
    assert unhandled == [] and not (tmp_path / "b.json").exists()
    assert guard.__name__ == "<lambda>"  # the handler in place before the bench is back


def test_the_product_commands_show_no_lab_modes(capsys):
    """`humanline bench --help` and `humanline report --help` list what a user types: the cost model's constants,
    their pooling, the async timing and the predictions live in humanline_cli/lab/ (python -m ...)."""
    from humanline_cli.bench.project import main_bench
    from humanline_cli.report.aggregate import main_report

    assert main_bench(["--help"]) == 0
    with pytest.raises(SystemExit) as e:
        main_report(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "steps=20" in text and "--ignore" in text and "--margin" in text
    for lab in ("constants=", "pool=", "async_rounds=", "--target", "--gpu-check"):
        assert lab not in text, lab
    for lab in (["constants=true"], ["pool=a.json,b.json"], ["async_rounds=3"]):  # now Hydra overrides it refuses
        opts, overrides = parse_args(lab)
        assert overrides == lab
