"""`python -m humanline_cli.lab.speed DIR --target T`: the cost model applied to the work runs recorded (samples.jsonl
tokens per completion, metrics.jsonl tokens_processed per step), beside their measured phases; the matched-quality
speedup from learning curves; cost.csv's generated tokens and longest completion per call. Run dirs are written by
hand here, so every expected number is computed in the test."""
from __future__ import annotations

import csv
import json
import math

import pytest
import yaml

from humanline_cli.lab.constants import fit_line
from humanline_cli.lab.constants import main as constants_main
from humanline_cli.lab.speed import main as speed_main
from humanline_cli.lab.speed import parse_target
from humanline_cli.report.aggregate import build_report
from humanline_cli.report.frame import curve, run_points
from humanline_cli.report.gap_closed import time_to

CONSTANTS = {"target": "this", "estimated": False, "model": "tiny", "params": 1000, "bytes_per_param": 4,
             "source": "hand", "constants": {
                 "call_fixed_s": 0.5, "sample_tokens_per_s": 10.0, "decode_step_s": 0.1, "concurrency": 4,
                 "push_fixed_s": 0.0, "push_bytes_per_s": math.inf, "label_s_per_seq": 0.01,
                 "train_flops_per_s": 8000.0, "step_fixed_s": 1.0, "sync_fixed_s": 0.2, "sync_bytes_per_s": math.inf,
                 "other_step_s": 0.25, "gpus": 1}}


def _run(root, regime, seed, *, rounds, tokens_per_step, wall, evals=(), final=0.8, lag=0, humanline=False):
    """A complete online GRPO run: `rounds` = [[tokens of each completion], ...], one step per entry of
    tokens_per_step, `wall` the summary's wall_clock_s, `evals` [(step, greedy accuracy, wall_s, setup)]."""
    d = root / f"{regime}_seed{seed}"
    (d / ".hydra").mkdir(parents=True)
    gen = int(regime.removeprefix("stale")) if regime.startswith("stale") else None
    cfg = {"objective": {"name": "grpo"}, "data": {"regime": "online", "async_lag": lag, "generate_every": gen},
           "seed": seed,
           "humanline": humanline, "hl": {"sync": True, "sync_every": 2},
           "task": {"name": "arithmetic"}, "model": {"name": "tiny"},
           "train": {"steps": len(tokens_per_step), "gradient_checkpointing": False}}
    (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"regime={regime}", f"seed={seed}"]))
    steps = len(tokens_per_step)
    (d / "summary.json").write_text(json.dumps({
        "status": "complete", "objective": "grpo", "data": "online", "humanline": humanline, "task": "arithmetic",
        "seed": seed, "model": "tiny", "steps": steps, "batch_size": 2,
        "eval": {"greedy": {"start_accuracy": 0.5, "accuracy": final}, "accuracy": final},
        "final_train_metrics": {"online/round": len(rounds)}, "wall_clock_s": wall}))
    rows = [{"step": i + 1, "tokens_processed": t, "time/train": 0.0, "wall_s": 0.0, "time/setup": 0.0}
            for i, t in enumerate(tokens_per_step)]
    for step, acc, wall_s, setup in evals:
        rows[step - 1].update({"wall_s": wall_s, "time/setup": setup})
        rows.append({"step": step, "eval/greedy/accuracy": acc})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "samples.jsonl").write_text("".join(json.dumps({"round": r + 1, "completion": "x", "tokens": t}) + "\n"
                                             for r, toks in enumerate(rounds) for t in toks))
    return d


def test_predicted_beside_measured_per_regime(tmp_path):
    root = tmp_path / "sweep"
    # online: 2 calls of 4 completions, 4 steps of 100 forward tokens
    _run(root, "online", 0, rounds=[[2, 3, 1, 2], [4, 4, 1, 1]], tokens_per_step=[100] * 4,
         wall={"total": 60.0, "setup": 10.0, "eval": 5.0, "save": 1.0, "sample": 5.0, "label": 0.1, "train": 30.0,
               "sync": 0.5, "push": 0.0})
    # stale: 1 call of 8 completions (2 waves of 4), the same 4 steps
    _run(root, "stale64", 0, rounds=[[2, 3, 1, 2, 4, 4, 1, 1]], tokens_per_step=[100] * 4,
         wall={"total": 50.0, "setup": 10.0, "eval": 5.0, "save": 1.0, "sample": 2.0, "label": 0.1, "train": 30.0,
               "sync": 0.2, "push": 0.0})
    cfile = tmp_path / "constants.json"
    cfile.write_text(json.dumps(CONSTANTS))
    assert speed_main([str(root), "--target", str(cfile)]) == 0
    with open(root / "predicted.csv") as f:
        rows = {(r["regime"], r["phase"]): r for r in csv.DictReader(f)}
    # online, call 1: 1 wave, throughput 8 / 10 = 0.8 s, latency 3 x 0.1 = 0.3 s -> 0.8 + 0.5 fixed = 1.3
    #         call 2: throughput 1.0 s, latency 0.4 s -> 1.5; sample = 2.8
    # train: 4 x 1.0 + (6 + 2 reference) x 1000 x 400 / 8000 = 4 + 400 = 404; sync: one per round, 2 x 0.2
    # label: 8 completions x 0.01; other: 4 x 0.25
    on_loop = 2.8 + 404 + 0.4 + 0.08 + 1.0
    assert float(rows[("online", "sample")]["predicted_s"]) == pytest.approx(2.8, rel=1e-9)
    assert float(rows[("online", "train")]["predicted_s"]) == pytest.approx(404.0, rel=1e-9)
    assert float(rows[("online", "loop")]["predicted_s"]) == pytest.approx(on_loop, rel=1e-9)
    # measured loop: total less setup, eval, save = 44; other = 44 - (5 + 0.1 + 30 + 0.5) = 8.4
    assert float(rows[("online", "loop")]["measured_s"]) == pytest.approx(44.0, rel=1e-12)
    assert float(rows[("online", "other")]["measured_s"]) == pytest.approx(8.4, rel=1e-9)
    # stale: 2 waves x longest 4 x 0.1 = 0.8 s vs throughput 18 / 10 = 1.8 s -> 1.8 + 0.5; one sync
    st_loop = 2.3 + 404 + 0.2 + 0.08 + 1.0
    assert float(rows[("stale64", "loop")]["predicted_s"]) == pytest.approx(st_loop, rel=1e-9)
    assert float(rows[("stale64", "loop")]["predicted_speedup_vs_online"]) == pytest.approx(on_loop / st_loop, rel=1e-6)
    assert float(rows[("stale64", "loop")]["measured_speedup_vs_online"]) == pytest.approx(44.0 / 34.0, rel=1e-6)
    md = (root / "predicted.md").read_text()
    assert md.startswith("# Predicted wall-clock (cost model)") and "**Target this (constants.json)**" in md
    # the product's report writes no prediction
    assert "Predicted" not in build_report(root).markdown and not (root / "report.csv").read_text().count("predicted")
    # cost.csv: generated tokens and the longest completion per call (mean over calls)
    with open(root / "cost.csv") as f:
        cost = {r["regime"]: r for r in csv.DictReader(f)}
    assert float(cost["online"]["generated_tokens"]) == 18 and float(cost["online"]["longest_completion_per_call"]) == 3.5
    assert float(cost["stale64"]["longest_completion_per_call"]) == 4


def test_gpu_target_is_labelled_an_estimate_with_sources(tmp_path, capsys):
    root = tmp_path / "sweep"
    _run(root, "online", 0, rounds=[[2, 3]], tokens_per_step=[100, 100], wall={"total": 10.0, "train": 5.0})
    cfile = tmp_path / "constants.json"
    cfile.write_text(json.dumps(CONSTANTS))
    assert speed_main([str(root), "--target", str(cfile), "--target", "h100x8"]) == 0
    md = (root / "predicted.md").read_text()
    assert "**Target h100x8** (ESTIMATE: built on public figures and assumptions)" in md
    assert "NVIDIA H100 Tensor Core GPU datasheet" in md and "mfu 0.4 (assumed)" in md
    with open(root / "predicted.csv") as f:
        gpu = [r for r in csv.DictReader(f) if r["target"] == "h100x8"]
    assert gpu and all(r["estimated"] == "True" and r["measured_s"] == "" for r in gpu)


def test_bad_target_is_one_line_exit_2(tmp_path, capsys):
    root = tmp_path / "sweep"
    _run(root, "online", 0, rounds=[[2]], tokens_per_step=[10], wall={"total": 1.0})
    assert speed_main([str(root), "--target", "a100"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--target 'a100'" in err[0]
    assert not (root / "predicted.md").exists()
    missing = tmp_path / "no_such_constants.json"
    assert speed_main([str(root), "--target", str(missing)]) == 2
    assert capsys.readouterr().err == f"humanline: error: --target {missing}: no such file\n"
    assert speed_main([str(root), "--target", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"humanline: error: --target {tmp_path}: is a directory, not a constants file "
                                       "from `python -m humanline_cli.lab.constants`\n")
    assert not (root / "predicted.md").exists()


def test_curve_and_reach_by_hand():
    summary = {"steps": 4, "eval": {"greedy": {"start_accuracy": 0.5, "accuracy": 0.9}},
               "wall_clock_s": {"total": 30.0, "setup": 5.0, "eval": 3.0}}
    metrics = [{"step": 2, "time/train": 1.0, "wall_s": 16.0, "time/setup": 5.0, "time/eval": 1.0},
               {"step": 2, "eval/greedy/accuracy": 0.7}]
    pts = curve(run_points(summary, metrics), "greedy accuracy", "step", "loop_s")
    # loop seconds at step 2: 16 - 5 - 1 = 10; at the end: 30 - 5 - 3 = 22
    assert pts == [(0, 0.0, 0.5), (2, 10.0, 0.7), (4, 22.0, 0.9)]
    # 0.8 lies halfway from 0.7 to 0.9: step 3, 16 s
    steps, secs = ([(p[i], p[2]) for p in pts] for i in (0, 1))
    assert (time_to(steps, 0.8), time_to(secs, 0.8)) == pytest.approx((3.0, 16.0))
    assert time_to(steps, 0.95) is None


def test_matched_quality_is_a_censored_median_with_seeds_reached(tmp_path):
    root = tmp_path / "sweep"
    wall = {"total": 40.0, "setup": 0.0, "train": 30.0}
    finals = (0.80, 0.82, 0.84)
    for seed, final in enumerate(finals):
        # online reaches its finals at the end: step 4, 40 s; a mid-run eval at step 2 (20 s) at 0.6
        _run(root, "online", seed, rounds=[[1]], tokens_per_step=[10] * 4, wall=wall, final=final,
             evals=[(2, 0.6, 20.0, 0.0)])
        # stale64: 0.9 by step 2 (10 s) on seeds 0 and 1; seed 2 stays at 0.6
        good = seed < 2
        _run(root, "stale64", seed, rounds=[[1]], tokens_per_step=[10] * 4, wall={**wall, "total": 20.0},
             final=0.9 if good else 0.6, evals=[(2, 0.9 if good else 0.6, 10.0, 0.0)])
    rep = build_report(root)
    # the target rule: start 0.5 + 0.9 x (online's mean final 0.82 - 0.5) = 0.788, whatever the seed count
    target = 0.5 + 0.9 * (0.82 - 0.5)
    assert (f"arithmetic / grpo: greedy accuracy {target:.4g} (start 0.5 + 0.9 x (online's mean final 0.82 - start))"
            in rep.markdown)
    # online: from (step 2, 20 s, 0.6) to (step 4, 40 s, final), all three reach it: 38.8, 37.09, 35.67 s;
    # with nothing censored the Kaplan-Meier median of three is the middle one, final 0.82's
    on = [20 + 20 * (target - 0.6) / (f - 0.6) for f in finals]
    assert on == pytest.approx([38.8, 37.090909, 35.666667])
    # stale64 seeds 0, 1: from (0 s, 0.5) to (10 s, 0.9): 10 x 0.288 / 0.4 = 7.2 s at step 2 x 0.72 = 1.44;
    # seed 2 never reaches it, censored at its end (20 s). Kaplan-Meier: 3 at risk at 7.2 s, 2 reach it, the
    # share short of it drops to 1/3 there, so the median is 7.2 s (the censored seed still counts in the
    # risk set, where a mean over the seeds that reached it would simply drop it)
    st = 10 * (target - 0.5) / 0.4
    section = rep.markdown.split("## Speedup at matched quality", 1)[1]
    line = next(x for x in section.splitlines() if x.startswith("| arithmetic | grpo | stale64 |"))
    assert line == (f"| arithmetic | grpo | stale64 | 2 of 3 (not reached: 1) | 1.4 | {st:.1f} | "
                    f"{on[1] / st:.2f}x | 2.00x |")  # 37.0909 / 7.2 = 5.15x; equal steps: 40 / 20
    online = next(x for x in section.splitlines() if x.startswith("| arithmetic | grpo | online |"))
    assert online == f"| arithmetic | grpo | online | 3 of 3 | 3.7 | {on[1]:.1f} | 1.00x | 1.00x |"
    assert "speedup at equal steps (not matched quality)" in rep.markdown


def test_fit_line_by_hand():
    # y = 0.5 + 0.01 x exactly
    assert fit_line([(100, 1.5), (200, 2.5), (300, 3.5)]) == pytest.approx((0.5, 0.01))
    # a negative intercept is noise: the line through the origin with the mean ratio sum(y) / sum(x)
    assert fit_line([(100, 0.5), (200, 1.6)]) == pytest.approx((0.0, 2.1 / 300))


def test_pooled_constants_are_medians_with_their_spread_and_predict(tmp_path, capsys):
    """`python -m humanline_cli.lab.constants --pool a,b,c`: each constant the median of three sets, the curve per
    size likewise, every constant's spread kept; the report reads the pooled file as a target and names the spread."""
    files = []
    for i, (flops, other, curve512) in enumerate([(8000.0, 0.25, 12.0), (6000.0, 0.35, 10.0), (10000.0, 0.30, 9.0)]):
        d = json.loads(json.dumps(CONSTANTS))
        d.update(threads=1, overrides=["experiment=x"], host="vm", objective="grpo",
                 source=f"measured by `humanline bench constants=true` on vm at 2026-12-02 0{i}:00:00 UTC (loadavg 1)")
        d["constants"].update(train_flops_per_s=flops, other_step_s=other, sample_curve=[[8, 5.0 + i], [512, curve512]])
        files.append(tmp_path / f"c{i}.json")
        files[-1].write_text(json.dumps(d))
    out = tmp_path / "pooled.json"
    assert constants_main(["--pool", ",".join(map(str, files)), "--out", str(out)]) == 0
    p = json.loads(out.read_text())
    c = p["constants"]
    assert c["train_flops_per_s"] == 8000.0 and c["other_step_s"] == 0.30 and c["call_fixed_s"] == 0.5
    assert c["sample_curve"] == [[8, 6.0], [512, 10.0]] and c["sample_tokens_per_s"] == 10.0  # the largest call's
    s = p["spread"]
    assert s["train_flops_per_s"]["spread"] == pytest.approx((10000 - 6000) / 8000, rel=1e-12)  # 50%
    assert s["sample_curve@512"]["spread"] == pytest.approx((12 - 9) / 10, rel=1e-12)
    assert s["call_fixed_s"]["spread"] == 0.0 and p["pooled_from"] == ["c0.json", "c1.json", "c2.json"]
    assert "median of 3 sets" in p["source"] and "00:00:00" in p["source"] and "02:00:00" in p["source"]
    printed = capsys.readouterr().out
    assert "train_flops_per_s" in printed and "50.0%" in printed  # the spread table
    spec = parse_target(str(out))
    assert spec.constants["constants"]["train_flops_per_s"] == 8000.0
    from humanline_cli.lab.speed import spread_note

    assert "train_flops_per_s 50%" in spread_note(p) and "sample_curve@512 30%" in spread_note(p)


def test_pooling_refuses_sets_of_another_run(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({**CONSTANTS, "threads": 1, "overrides": ["experiment=x"]}))
    b.write_text(json.dumps({**CONSTANTS, "threads": 2, "overrides": ["experiment=x"]}))
    out = tmp_path / "pooled.json"
    assert constants_main(["--pool", f"{a},{b}", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "b.json was measured for another run" in err[0] and not out.exists()
    assert constants_main(["--pool", str(a), "--out", str(out)]) == 2 and not out.exists()
    b.write_text(json.dumps({**CONSTANTS, "threads": 1, "overrides": ["experiment=x"], "precision": "bf16"}))
    assert constants_main(["--pool", f"{a},{b}", "--out", str(out)]) == 2  # a: measured before precision, in fp32
    assert "b.json was measured for another run than a.json (model, threads, precision or overrides differ)" in \
        capsys.readouterr().err and not out.exists()


def _constants_set(tmp_path, name, curve, inputs=None, hour=0):
    d = json.loads(json.dumps(CONSTANTS))
    d.update(threads=1, overrides=["experiment=x"], host="vm", objective="grpo",
             source=f"measured by `humanline bench constants=true` on vm at 2026-12-02 0{hour}:00:00 UTC (loadavg 1)")
    if inputs is not None:
        d["inputs"] = inputs
    d["constants"]["sample_curve"] = curve
    (tmp_path / name).write_text(json.dumps(d))
    return tmp_path / name


def test_pooling_refuses_sets_of_other_prompts_and_a_set_twice(tmp_path, capsys):
    out = tmp_path / "pooled.json"
    a = _constants_set(tmp_path, "a.json", [[1, 900.0], [16, 5672.0], [64, 11121.0]])
    b = _constants_set(tmp_path, "b.json", [[1, 880.0], [16, 5600.0]], hour=1)  # prompts=16: no 64-sequence call
    assert constants_main(["--pool", f"{a},{b}", "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        "humanline: error: --pool: b.json was measured with other inputs than a.json (curve at 1, 16 sequences "
        "vs curve at 1, 16, 64 sequences); pool sets of the same --prompts and --steps\n")
    c = _constants_set(tmp_path, "c.json", [[1, 900.0]], {"prompts": 8, "constant_steps": 12}, hour=2)
    d = _constants_set(tmp_path, "d.json", [[1, 900.0]], {"prompts": 8, "constant_steps": 6}, hour=3)
    assert constants_main(["--pool", f"{c},{d}", "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        "humanline: error: --pool: d.json was measured with other inputs than c.json (prompts=8, "
        "constant_steps=6, curve at 1 sequences vs prompts=8, constant_steps=12, curve at 1 sequences); pool sets "
        "of the same --prompts and --steps\n")
    assert constants_main(["--pool", f"{a},{a}", "--out", str(out)]) == 2
    assert capsys.readouterr().err == ("humanline: error: --pool: a.json is the same measurement as a.json; "
                                       "pool distinct sets\n")
    assert not out.exists()


def test_target_constants_of_another_setting_leave_the_run_out_with_a_note(tmp_path):
    root = tmp_path / "sweep"
    wall = {"total": 60.0, "setup": 10.0, "eval": 5.0, "save": 1.0, "sample": 5.0, "label": 0.1, "train": 30.0,
            "sync": 0.5, "push": 0.0}
    for seed, threads in ((0, 1), (1, 2)):
        d = _run(root, "online", seed, rounds=[[2, 3, 1, 2]], tokens_per_step=[100] * 4, wall=wall)
        cfg = yaml.safe_load((d / ".hydra" / "config.yaml").read_text())
        (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump({**cfg, "threads": threads}))
    cfile = tmp_path / "constants.json"
    cfile.write_text(json.dumps({**CONSTANTS, "threads": 1, "overrides": ["train.steps=4", "objective=grpo"]}))
    assert speed_main([str(root), "--target", str(cfile)]) == 0
    with open(root / "predicted.csv") as f:
        assert {r["n_runs"] for r in csv.DictReader(f)} == {"1"}  # seed 0 only
    assert ("this (constants.json): 1 complete run(s) left out, measured for another setting than the constants "
            "file's: online_seed1 (threads=2, the constants' 1)") in (root / "predicted.md").read_text()
    cfile.write_text(json.dumps({**CONSTANTS, "threads": 1, "overrides": ["train.steps=8"]}))
    assert speed_main([str(root), "--target", str(cfile)]) == 0
    assert ("online_seed0 (train.steps=4, the constants' 8), online_seed1 (threads=2, the constants' 1)"
            in (root / "predicted.md").read_text())


def test_constants_predict_runs_of_their_own_precision_only(tmp_path):
    """A bf16 run is not predicted from constants measured in fp32 (a set without `precision` was measured in fp32),
    nor an fp32 run from a bf16 set, each left out in one line; a bf16 set's syncs copy 2 bytes a parameter."""
    root = tmp_path / "sweep"
    wall = {"total": 60.0, "setup": 10.0, "eval": 5.0, "save": 1.0, "sample": 5.0, "label": 0.1, "train": 30.0,
            "sync": 0.5, "push": 0.0}
    for seed, compute in ((0, "bfloat16"), (1, "float32")):
        d = _run(root, "online", seed, rounds=[[2, 3, 1, 2]], tokens_per_step=[100] * 4, wall=wall)
        summary = json.loads((d / "summary.json").read_text())
        (d / "summary.json").write_text(json.dumps({**summary, "precision": {"compute": compute, "why": None}}))
    cfile = tmp_path / "constants.json"
    cfile.write_text(json.dumps(CONSTANTS))
    assert speed_main([str(root), "--target", str(cfile)]) == 0
    assert ("1 complete run(s) left out, measured for another setting than the constants file's: online_seed0 (it "
            "computed in bf16, the constants were measured in fp32: measure a bf16 set with backend.precision=bf16 "
            "among the constants' overrides)") in (root / "predicted.md").read_text()
    cfg = yaml.safe_load((root / "online_seed0" / ".hydra" / "config.yaml").read_text())
    (root / "online_seed0" / ".hydra" / "config.yaml").write_text(yaml.safe_dump({**cfg, "backend": {"precision": "auto"}}))
    bf16 = json.loads(json.dumps(CONSTANTS))  # measured with backend.precision=bf16, the run's auto computed in bf16
    bf16.update(precision="bf16", bytes_per_param=2, overrides=["backend.precision=bf16"])
    bf16["constants"]["sync_bytes_per_s"] = 1000.0
    cfile.write_text(json.dumps(bf16))
    assert speed_main([str(root), "--target", str(cfile)]) == 0
    with open(root / "predicted.csv") as f:
        rows = {r["phase"]: r for r in csv.DictReader(f)}
    assert rows["sync"]["n_runs"] == "1"  # seed 0 only
    # one round, one sync: 0.2 s fixed + 2 bytes x 1,000 parameters at 1,000 bytes/s
    assert float(rows["sync"]["predicted_s"]) == pytest.approx(0.2 + 2.0, rel=1e-12)
    assert "online_seed1 (it computed in fp32, the constants were measured in bf16" in (root / "predicted.md").read_text()
