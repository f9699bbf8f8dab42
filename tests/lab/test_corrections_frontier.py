"""The corrections frontier's numbers (lab/corrections_frontier.py): per (K, correction) the last step's accuracy with its
t-interval, paired differences by seed with the paired-t p, and the steps and loop seconds to the target."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from humanline_cli.lab.corrections_frontier import (
    cells,
    frontier_rows,
    main,
    paired,
    paired_rows,
    series,
    time_rows,
)
from humanline_cli.report.frame import clocks, load
from tests.helpers.runs import config, run_dir

T1 = 12.706204736174698  # t(0.975, 1)
START = 0.3
# (K, correction, seed) -> (greedy at step 32, greedy at step 64, sampled at 64)
PLAN = {(1, "none", 1): (0.50, 0.60, 0.40), (1, "none", 2): (0.50, 0.64, 0.42),
        (1, "tis", 1): (0.50, 0.60, 0.40), (1, "tis", 2): (0.50, 0.64, 0.42),
        (64, "tis", 1): (0.35, 0.40, 0.33), (64, "tis", 2): (0.35, 0.44, 0.35),
        (64, "humanline", 1): (0.45, 0.50, 0.37), (64, "humanline", 2): (0.45, 0.56, 0.38)}


def _runs(root, plan=PLAN):
    for (k, corr, seed), (mid, last, sampled) in plan.items():
        cfg = config(obj="grpo", regime="online", seed=seed)
        cfg["data"]["generate_every"] = k
        cfg["correction"] = {"kind": corr, "cap": 3.0}
        d = run_dir(root, f"K{k}_{corr}/grpo_seed{seed}", cfg, win=0.6, wall=100.0 * seed, acc=sampled)
        s = json.loads((d / "summary.json").read_text())
        s["steps"] = 64
        s["eval"]["greedy"] = {"accuracy": last, "start_accuracy": START}
        s["eval"]["sampled"] = {"accuracy": sampled, "start_accuracy": 0.25}
        s["wall_clock_s"] = {"total": 100.0 * seed, "setup": 10.0, "eval": 10.0}  # the loop: 100 x seed - 20 s
        (d / "summary.json").write_text(json.dumps(s))
        rows = [{"step": 32, "loss": 0.1, "time/train": 1.0, "wall_s": 40.0 * seed},
                {"step": 32, "eval/greedy/accuracy": mid, "eval/sampled/accuracy": sampled - 0.01}]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return cells(load(root))


def test_last_step_and_paired_differences_hand_computed(tmp_path):
    c = _runs(tmp_path / "sweep")
    front = frontier_rows(c)
    assert [(r["K"], r["correction"], r["n"]) for r in front] == [(1, "none", 2), (1, "tis", 2), (64, "humanline", 2),
                                                                   (64, "tis", 2)]
    hl64 = front[2]["greedy"]  # 0.50, 0.56: mean 0.53, sd 0.042426, half-width T1 x sd / sqrt(2) = T1 x 0.03
    assert hl64["mean"] == pytest.approx(0.53) and hl64["hi"] - hl64["mean"] == pytest.approx(T1 * 0.03)
    # the primary's shape: humanline - tis at K=64, greedy: differences 0.10, 0.12: mean 0.11, sd 0.014142,
    # half-width T1 x 0.01; t = 0.11 / 0.01 = 11 on 1 df: p = 2 (1 - F(11)) = 2 atan(1/11) / pi
    d = paired(c, "grpo", 64, "humanline", "tis", "greedy")
    assert d["seeds"] == [1, 2] and d["diffs"] == pytest.approx([0.10, 0.12])
    assert d["mean"] == pytest.approx(0.11) and d["lo"] == pytest.approx(0.11 - T1 * 0.01)
    assert d["p"] == pytest.approx(2 * math.atan(1 / 11) / math.pi, rel=1e-9)
    # equal runs: every difference 0, no p (a t-test of identical numbers has none)
    same = paired(c, "grpo", 1, "tis", "none", "sampled")
    assert same["diffs"] == [0.0, 0.0] and same["p"] is None
    contrasts = {(r["K"], r["contrast"], r["metric"]) for r in paired_rows(c)}
    assert contrasts == {(64, "humanline - tis", "greedy"), (64, "humanline - tis", "sampled"),
                         (1, "tis - none", "greedy"), (1, "tis - none", "sampled")}


def test_time_to_target_hand_computed(tmp_path):
    rows = {(r["K"], r["correction"]): r for r in time_rows(_runs(tmp_path / "sweep"))}
    # target: 0.3 + 0.9 x (0.62 - 0.3) = 0.588, from K=1 none's mean final
    assert rows[(1, "none")]["target"] == pytest.approx(0.588)
    # K=1: seed 1 reaches it at 32 + 32 x 0.088 / 0.10 = 60.16, seed 2 at 32 + 32 x 0.088 / 0.14 = 52.114; the
    # Kaplan-Meier median of two is the earlier; in loop seconds seed 1's curve (0, 40, 80 s) reaches it at
    # 40 + 40 x 0.88 = 75.2, seed 2's (0, 80, 180 s) at 80 + 100 x 0.088 / 0.14 = 142.9: the earlier is seed 1's
    assert rows[(1, "none")]["steps"] == pytest.approx(32 + 32 * 0.088 / 0.14)
    assert rows[(1, "none")]["seconds"] == pytest.approx(40 + 40 * 0.088 / 0.10)
    assert rows[(1, "none")]["loop_s"] == pytest.approx((80 + 180) / 2)
    # K=64: no seed reaches 0.588 (at most 0.56): none of 2, no median
    assert (rows[(64, "humanline")]["reached"], rows[(64, "humanline")]["steps"]) == (0, None)


def test_the_cli_prints_the_tables_and_plots(tmp_path, capsys):
    _runs(tmp_path / "sweep")
    out = tmp_path / "frontier.png"
    assert main([str(tmp_path / "sweep"), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert out.stat().st_size > 1000
    assert "| grpo | 64 | humanline - tis | greedy | 2 | +0.110 [" in text and "| grpo | 64 | tis | 2 | 0.420 [" in text
    assert main([str(tmp_path / "nowhere")]) == 2


def test_no_median_in_seconds_where_fewer_than_half_reached_the_target(tmp_path):
    """K=16: seed 3 alone reaches 0.588, at step 32 + 32 x 0.088 / 0.12 = 55.5 and loop second 120 + 160 x 0.088 /
    0.12 = 237.3; seeds 1 and 2 end short of it at step 64 but at loop seconds 80 and 180, before it. In steps the
    Kaplan-Meier curve stops at 2/3 (no median); in seconds it would fall to 0 at 237.3, a median that only the
    machine's uneven speed made: both are left out, as the note says (fewer than half reached it)."""
    plan = {key: v for key, v in PLAN.items() if key[:2] == (1, "none")}
    plan |= {(16, "none", 1): (0.40, 0.45, 0.3), (16, "none", 2): (0.40, 0.45, 0.3), (16, "none", 3): (0.50, 0.62, 0.3)}
    row = {(r["K"], r["correction"]): r for r in time_rows(_runs(tmp_path / "sweep", plan))}[(16, "none")]
    assert (row["reached"], row["n"], row["steps"], row["seconds"]) == (1, 3, None, None)


def test_time_to_target_sampled_and_the_evaluation_grid(tmp_path):
    rows = {(r["K"], r["correction"]): r for r in time_rows(_runs(tmp_path / "sweep"), "sampled")}
    # sampled: start 0.25, K=1 none's mean final (0.40 + 0.42) / 2 = 0.41: target 0.25 + 0.9 x 0.16 = 0.394;
    # seed 1's curve (0, 0.25), (32, 0.39), (64, 0.40) reaches it at 32 + 32 x 0.004 / 0.01 = 44.8, seed 2's
    # (0, 0.25), (32, 0.41) at 32 x 0.144 / 0.16 = 28.8: the Kaplan-Meier median of two is the earlier
    r = rows[(1, "none")]
    assert (r["metric"], r["start"], r["final"], r["target"]) == ("sampled", pytest.approx(0.25), pytest.approx(0.41),
                                                                   pytest.approx(0.394))
    assert r["steps"] == pytest.approx(28.8) and r["reached"] == 2
    # evaluated at the start, step 32 and the end (64): a time to target is resolved to the 32-step interval
    assert (r["evals"], r["every"]) == ([0, 32, 64], 32)


def test_the_plot_draws_each_cell_with_its_interval(tmp_path):
    drawn = series(frontier_rows(_runs(tmp_path / "sweep")))
    assert set(drawn) == {("grpo", "greedy"), ("grpo", "sampled")}
    assert set(drawn[("grpo", "greedy")]) == {"none", "tis", "humanline"}
    # humanline at K=64, greedy 0.50 and 0.56: mean 0.53, half-width T1 x 0.03
    (k, mean, lo, hi), = drawn[("grpo", "greedy")]["humanline"]
    assert (k, mean, lo, hi) == (64, pytest.approx(0.53), pytest.approx(0.53 - T1 * 0.03), pytest.approx(0.53 + T1 * 0.03))
    # tis: one point per K, in K order: K=1 (0.60, 0.64: mean 0.62) then K=64 (0.40, 0.44: mean 0.42)
    assert [(p[0], round(p[1], 9)) for p in drawn[("grpo", "greedy")]["tis"]] == [(1, 0.62), (64, 0.42)]


# the DPO/KTO study: objective x K x correction; (objective, K, correction) -> greedy, sampled per seed 1, 2
PAIRS = {("dpo", 1, "none"): ((0.50, 0.37), (0.52, 0.39)), ("dpo", 1, "trdpo"): ((0.51, 0.37), (0.55, 0.40)),
         ("dpo", 64, "none"): ((0.40, 0.30), (0.42, 0.31)), ("dpo", 64, "humanline"): ((0.45, 0.33), (0.46, 0.35)),
         ("dpo", 64, "trdpo"): ((0.40, 0.30), (0.40, 0.29)), ("kto", 64, "none"): ((0.35, 0.28), (0.37, 0.30)),
         ("kto", 64, "humanline"): ((0.38, 0.29), (0.44, 0.30))}


def _pairs(root):
    for (obj, k, corr), per_seed in PAIRS.items():
        for seed, (greedy, sampled) in enumerate(per_seed, start=1):
            cfg = config(obj=obj, regime="online", seed=seed)
            cfg["data"]["generate_every"] = k
            cfg["correction"] = {"kind": corr, "alpha": 0.6}
            d = run_dir(root, f"K{k}_{corr}/{obj}_seed{seed}", cfg, win=0.6, wall=50.0, acc=sampled)
            s = json.loads((d / "summary.json").read_text())
            s.update(steps=32, humanline=corr == "humanline")
            s["eval"]["greedy"] = {"accuracy": greedy, "start_accuracy": 0.3}
            s["eval"]["sampled"] = {"accuracy": sampled, "start_accuracy": 0.25}
            (d / "summary.json").write_text(json.dumps(s))
    return root


def test_the_pairs_study_table_hand_computed(tmp_path):
    c = cells(load(_pairs(tmp_path / "pairs")))
    front = {(r["objective"], r["K"], r["correction"]): r for r in frontier_rows(c)}
    assert set(front) == set(PAIRS)
    # kto, K=64, humanline: greedy 0.38, 0.44: mean 0.41, sd 0.042426, half-width T1 x 0.03
    g = front[("kto", 64, "humanline")]["greedy"]
    assert (g["mean"], g["hi"] - g["mean"], g["n"]) == (pytest.approx(0.41), pytest.approx(T1 * 0.03), 2)
    pairs = {(r["objective"], r["K"], r["contrast"], r["metric"]): r for r in paired_rows(c)}
    # dpo K=64 humanline - none: greedy 0.05, 0.04 (mean 0.045, half-width T1 x 0.005); trdpo - none: 0, -0.02
    d = pairs[("dpo", 64, "humanline - none", "greedy")]
    assert d["diffs"] == pytest.approx([0.05, 0.04]) and d["hi"] == pytest.approx(0.045 + T1 * 0.005)
    assert pairs[("dpo", 64, "trdpo - none", "greedy")]["diffs"] == pytest.approx([0.0, -0.02])
    # dpo K=1 trdpo - none, sampled: 0.0, 0.01; kto has no trdpo: humanline - none alone
    assert pairs[("dpo", 1, "trdpo - none", "sampled")]["diffs"] == pytest.approx([0.0, 0.01])
    assert {key[2] for key in pairs if key[0] == "kto"} == {"humanline - none"}
    assert ("dpo", 64, "humanline - trdpo", "greedy") in pairs


def test_a_study_csv_gives_the_same_tables_as_its_run_dirs(tmp_path, capsys):
    from humanline_cli.report.study_csv import export

    root = _pairs(tmp_path / "pairs")
    assert main([str(root), "--out", str(tmp_path / "a.png")]) == 0
    from_dirs = capsys.readouterr().out
    csv = tmp_path / "laptop_corrections_frontier_pairs.csv"
    assert export(root, csv) == 14
    assert main([str(csv), "--out", str(tmp_path / "b.png")]) == 0
    from_csv = capsys.readouterr().out
    assert from_csv.replace("b.png", "a.png") == from_dirs
    assert "| dpo | 64 | humanline - none | greedy | 2 | +0.045 [" in from_csv
    (tmp_path / "not.csv").write_text("a,b\n1,2\n")
    assert main([str(tmp_path / "not.csv")]) == 2


def test_loop_seconds_at_an_evaluation_between_two_train_rows():
    """Train rows every 10 steps, an evaluation at 32: its loop second lies between the rows at 30 (wall 70 s less
    setup 10 = 60) and 40 (95 less setup 10 and evaluation 5 = 80): 60 + 20 x 2 / 10 = 64; the end (step 64) is
    the summary's loop, 150 - 10 - 10 = 130; the start is 0."""
    summary = {"steps": 64, "wall_clock_s": {"total": 150.0, "setup": 10.0, "eval": 10.0}}
    metrics = [{"step": 30, "time/train": 50.0, "time/setup": 10.0, "wall_s": 70.0},
               {"step": 32, "eval/greedy/accuracy": 0.5, "wall_s": 90.0},
               {"step": 40, "time/train": 65.0, "time/setup": 10.0, "time/eval": 5.0, "wall_s": 95.0}]
    clock = clocks(summary, metrics)["loop_s"]
    assert clock == ([0.0, 30.0, 40.0, 64.0], [0.0, 60.0, 80.0, 130.0])
    assert np.interp(32, *clock) == pytest.approx(64.0)


def test_the_study_csv_keeps_the_loop_seconds_of_an_evaluation_between_train_rows(tmp_path, capsys):
    """Train rows at steps 30, 40 and 50, the evaluation at 32 (train.log_every 10, eval.every 32): the CSV keeps
    the train rows around each evaluation (30 and 40), the loop clock reads those alone, so the seconds to target
    read from the CSV are the run dirs' own."""
    from humanline_cli.report.study_csv import export

    root = tmp_path / "sweep"
    _runs(root)
    for m in root.glob("*/*/metrics.jsonl"):
        seed = int(m.parent.name.removeprefix("grpo_seed"))
        rows = [json.loads(x) for x in m.read_text().splitlines()]
        evals = [r for r in rows if "eval/greedy/accuracy" in r]
        rows = [{"step": 30, "time/train": 1.0, "wall_s": 30.0 * seed}, *evals,
                {"step": 40, "time/train": 1.0, "wall_s": 50.0 * seed},
                {"step": 50, "time/train": 1.0, "wall_s": 51.0 * seed}]  # not beside an evaluation: not read
        m.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # K=1 none, seed 1 reaches 0.588 at step 60.16: loop seconds 50 + (80 - 50) x 20.16 / 24 = 75.2
    assert {(r["K"], r["correction"]): r for r in time_rows(cells(load(root)))}[(1, "none")]["seconds"] == \
        pytest.approx(50 + 30 * 20.16 / 24)
    assert main([str(root), "--out", str(tmp_path / "a.png")]) == 0
    from_dirs = capsys.readouterr().out
    export(root, tmp_path / "study.csv")
    assert main([str(tmp_path / "study.csv"), "--out", str(tmp_path / "a.png")]) == 0
    assert capsys.readouterr().out == from_dirs


def test_asynchronous_rounds_are_cells_of_their_own_lag(tmp_path, capsys):
    """experiment=laptop_corrections_async: K=1 with data.async_lag 4 and 16: each lag its own cell (never pooled
    as seeds), its own paired contrasts, a line of its own in the plot at x = L."""
    root = tmp_path / "async"
    for lag, corr, seed, acc in ((4, "tis", 1, 0.50), (4, "tis", 2, 0.52), (16, "tis", 1, 0.40), (16, "tis", 2, 0.44),
                                 (16, "none", 1, 0.30), (16, "none", 2, 0.33)):
        cfg = config(obj="grpo", regime="online", seed=seed)
        cfg["data"]["async_lag"] = lag
        cfg["correction"] = {"kind": corr, "cap": 3.0}
        d = run_dir(root, f"L{lag}_{corr}/grpo_seed{seed}", cfg, win=0.6, wall=10.0, acc=acc)
        s = json.loads((d / "summary.json").read_text())
        s["eval"]["greedy"] = {"accuracy": acc, "start_accuracy": START}
        (d / "summary.json").write_text(json.dumps(s))
    c = cells(load(root))
    front = {(r["K"], r["L"], r["correction"]): r for r in frontier_rows(c)}
    assert set(front) == {(1, 4, "tis"), (1, 16, "tis"), (1, 16, "none")}
    assert front[(1, 16, "tis")]["greedy"]["mean"] == pytest.approx(0.42) and front[(1, 16, "tis")]["n"] == 2
    # tis - none at lag 16: 0.10, 0.11: mean 0.105
    (d,) = [r for r in paired_rows(c) if r["metric"] == "greedy"]
    assert (d["L"], d["contrast"], d["mean"]) == (16, "tis - none", pytest.approx(0.105))
    drawn = series(frontier_rows(c))[("grpo", "greedy")]
    assert [p[0] for p in drawn["tis, async"]] == [4, 16] and [p[0] for p in drawn["none, async"]] == [16]
    assert main([str(root), "--out", str(tmp_path / "a.png")]) == 0
    assert "| grpo | 1, lag 16 | tis - none | greedy | 2 | +0.105 [" in capsys.readouterr().out
