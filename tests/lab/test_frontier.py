"""The staleness frontier: final accuracy per (K, humanline) against the mean logged drift from the sampler."""
from __future__ import annotations

import json
import math

import pytest

from humanline_cli.lab.frontier import frontier_rows, main, markdown, run_drift
from humanline_cli.report.frame import load
from tests.helpers.runs import config, run_dir


def _runs(root):
    # (K, humanline, seed) -> (greedy accuracy, drift/kl per logged step)
    plan = {(2, False, 0): (0.80, [0.0, 0.002]), (2, False, 1): (0.84, [0.0, 0.004]),
            (64, False, 0): (0.60, [0.0, 0.05, 0.10]), (64, False, 1): (0.64, [0.0, 0.07, 0.08]),
            (64, True, 0): (0.70, [0.0, 0.01]), (64, True, 1): (0.74, [0.0, 0.03])}
    for (k, hl, seed), (acc, drift) in plan.items():
        cfg = config(obj="grpo", regime="online", seed=seed, humanline=hl)
        cfg["data"]["generate_every"] = k
        d = run_dir(root, f"K{k}_hl-{hl}/grpo_seed{seed}", cfg, win=0.6, wall=10.0, acc=acc - 0.1)
        s = json.loads((d / "summary.json").read_text())
        s["eval"]["greedy"] = {"accuracy": acc, "start_accuracy": 0.5}
        (d / "summary.json").write_text(json.dumps(s))
        rows = [{"step": i + 1, "loss": 0.1, "drift/kl": x, "drift/logratio_mean": -x} for i, x in enumerate(drift)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # an offline run logs no drift: not on the frontier
    run_dir(root, "offline/grpo_seed0", config(obj="grpo", seed=0), win=0.6, wall=10.0)
    return load(root)


def test_frontier_rows_hand_computed(tmp_path):
    assert run_drift([{"step": 1, "drift/kl": 0.0}, {"step": 2, "drift/kl": 0.3}, {"step": 2, "x": 1}]) == 0.15
    assert run_drift([{"step": 1, "loss": 1.0}]) is None
    rows = frontier_rows(_runs(tmp_path / "sweep"))
    assert [(r["K"], r["humanline"], r["n"]) for r in rows] == [(2, False, 2), (64, False, 2), (64, True, 2)]
    k64 = rows[1]
    # per-run drift: (0 + .05 + .10) / 3 = .05 and (0 + .07 + .08) / 3 = .05: mean .05, zero-width interval
    assert k64["drift_kl"]["mean"] == pytest.approx(0.05) and k64["drift_kl"]["hi"] == pytest.approx(0.05)
    assert k64["drift_logratio"]["mean"] == pytest.approx(-0.05)
    # greedy 0.60, 0.64: mean 0.62, half t(0.975, 1) * sd / sqrt(2) = 12.706205 * 0.028284 / sqrt(2) = 0.25412
    assert k64["greedy"]["mean"] == pytest.approx(0.62)
    assert k64["greedy"]["lo"] == pytest.approx(0.62 - 12.706205 * math.sqrt(0.0008) / math.sqrt(2))
    assert k64["sampled"]["mean"] == pytest.approx(0.52)
    assert rows[0]["drift_kl"]["mean"] == pytest.approx((0.001 + 0.002) / 2)
    table = markdown(rows)
    assert table[3].startswith("| grpo | 64 | off | 2 | 5.00e-02 [5.00e-02, 5.00e-02] | -0.0500 ")


def test_frontier_cli_plots_and_refuses_an_empty_dir(tmp_path, capsys):
    _runs(tmp_path / "sweep")
    out = tmp_path / "frontier.png"
    assert main([str(tmp_path / "sweep"), "--out", str(out)]) == 0
    assert out.stat().st_size > 1000 and "| grpo | 2 | off | 2 |" in capsys.readouterr().out
    assert main([str(tmp_path / "nowhere")]) == 2
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
