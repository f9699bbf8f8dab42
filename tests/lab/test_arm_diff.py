"""Two runs compared step by step on hand-made metrics.jsonl: the numbers that differ, clocks aside, and where the
band clamped tokens."""
from __future__ import annotations

import json

from humanline_cli.lab.arm_diff import compare, main, train_rows


def _run(tmp_path, name, rows):
    d = tmp_path / name
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def _rows(ratio_at_2, unclamped_at_2, loss_at_3=0.3):
    return [{"step": 1, "loss": 0.1, "grpo/ratio_mean": 1.0, "humanline/unclamped_fraction": 1.0, "wall_s": 5.0,
             "time/train": 2.0, "tokens_per_s": 80.0},
            {"step": 2, "loss": 0.2, "grpo/ratio_mean": ratio_at_2, "humanline/unclamped_fraction": unclamped_at_2,
             "wall_s": 9.0},
            {"step": 2, "eval/accuracy": 0.5},  # an evaluation row: no loss, not a training step
            {"step": 3, "loss": loss_at_3, "grpo/ratio_mean": 1.0, "humanline/unclamped_fraction": 1.0, "wall_s": 13.0}]


def test_only_the_ratio_at_the_clamped_step_differs(tmp_path, capsys):
    a = _run(tmp_path, "lo1", _rows(0.9990, 0.9958))
    b = _run(tmp_path, "open", [{**r, "wall_s": r.get("wall_s", 0) + 1} for r in _rows(1.0010, 1.0)])
    r = compare(train_rows(a), train_rows(b))
    assert r["steps"] == 3 and r["only_a"] == r["only_b"] == []
    assert r["differ"] == {"grpo/ratio_mean": [2], "humanline/unclamped_fraction": [2]}
    assert r["clamped_b"] == {} and list(r["clamped_a"]) == [2]
    assert abs(r["clamped_a"][2] - 0.0042) < 1e-12  # 1 - 0.9958 in float64
    assert main([str(a), str(b)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["3 steps logged by both",
                   "differ (clocks aside): grpo/ratio_mean at steps 2; humanline/unclamped_fraction at steps 2",
                   "tokens the band clamped, lo1: 0.42% at step 2", "tokens the band clamped, open: none"]


def test_a_differing_loss_and_a_missing_step_are_named(tmp_path):
    a = _run(tmp_path, "a", _rows(1.0, 1.0))
    b = _run(tmp_path, "b", _rows(1.0, 1.0, loss_at_3=0.31)[:2])
    r = compare(train_rows(a), train_rows(b))
    assert r["differ"] == {} and r["only_a"] == [3]
    b2 = _run(tmp_path, "b2", _rows(1.0, 1.0, loss_at_3=0.31))
    assert compare(train_rows(a), train_rows(b2))["differ"] == {"loss": [3]}


def test_not_a_run_dir_is_one_line_and_exit_2(tmp_path, capsys):
    assert main([str(tmp_path), str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"arm_diff: error: {tmp_path}: no metrics.jsonl (not a run dir)"


def test_a_key_one_run_never_logs_is_named_apart(tmp_path, capsys):
    a = _run(tmp_path, "lo1", _rows(1.0, 0.99))
    b = _run(tmp_path, "open", [{k: v for k, v in r.items() if k != "humanline/unclamped_fraction"}
                                for r in _rows(1.0, 1.0)])
    r = compare(train_rows(a), train_rows(b))
    assert r["differ"] == {} and r["logged_by_a"] == ["humanline/unclamped_fraction"] and r["logged_by_b"] == []
    assert main([str(a), str(b)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1:3] == ["differ (clocks aside): nothing", "logged by lo1 only: humanline/unclamped_fraction"]
