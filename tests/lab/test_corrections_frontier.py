"""The corrections frontier's numbers (lab/corrections_frontier.py): per (K, correction) the last step's accuracy with its
t-interval, paired differences by seed with the paired-t p, and the steps and loop seconds to the target."""
from __future__ import annotations

import json
import math

import pytest

from humanline_cli.lab.corrections_frontier import cells, frontier_rows, main, paired, paired_rows, time_rows
from humanline_cli.report.frame import load
from tests.helpers.runs import config, run_dir

T1 = 12.706204736174698  # t(0.975, 1)
START = 0.3
# (K, correction, seed) -> (greedy at step 32, greedy at step 64, sampled at 64)
PLAN = {(1, "none", 1): (0.50, 0.60, 0.40), (1, "none", 2): (0.50, 0.64, 0.42),
        (1, "tis", 1): (0.50, 0.60, 0.40), (1, "tis", 2): (0.50, 0.64, 0.42),
        (64, "tis", 1): (0.35, 0.40, 0.33), (64, "tis", 2): (0.35, 0.44, 0.35),
        (64, "humanline", 1): (0.45, 0.50, 0.37), (64, "humanline", 2): (0.45, 0.56, 0.38)}


def _runs(root):
    for (k, corr, seed), (mid, last, sampled) in PLAN.items():
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
