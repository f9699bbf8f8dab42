"""`humanline report`'s generation cost table (report/cost.py): sampled sequences, generation calls and weight
pushes per regime at matched training units, read from the files real runs write (summary.json, samples.jsonl,
.hydra/overrides.yaml) and checked against hand-counted values."""
from __future__ import annotations

import csv
import json

import pytest
import yaml

from humanline_cli.report.aggregate import build_report
from tests.helpers.runs import config, run_dir


def _run(root, regime, obj, seed, *, rounds, sequences, steps=200, batch=32):
    cfg = config(obj=obj, regime="offline" if regime == "offline" else "online", seed=seed)
    if regime.startswith("stale"):
        cfg["data"]["generate_every"] = int(regime.removeprefix("stale"))
    d = run_dir(root, f"{regime}/{obj}_seed{seed}", cfg, win=0.6, wall=100.0)
    (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"objective={obj}", f"regime={regime}",
                                                                 f"seed={seed}"]))
    summary = json.loads((d / "summary.json").read_text())
    summary.update(steps=steps, batch_size=batch,
                   final_train_metrics={"online/round": rounds} if rounds else {"loss": 0.1})
    (d / "summary.json").write_text(json.dumps(summary))
    if sequences:
        (d / "samples.jsonl").write_text("".join(json.dumps({"round": 1, "completion": str(i)}) + "\n"
                                                 for i in range(sequences)))


def test_cost_table_counts_sequences_calls_and_pushes_per_regime(tmp_path):
    root = tmp_path / "sweep"
    for seed in (0, 1):
        # online GRPO: a round every 2 steps = 100 rounds of 16 prompts x 8 samples = 12,800 sequences
        _run(root, "online", "grpo", seed, rounds=100, sequences=12800)
        # stale-64: 4 rounds (steps 1, 65, 129, 193), the last one cut short: seed 0 and 1 sampled 12,800 / 12,288
        _run(root, "stale64", "grpo", seed, rounds=4, sequences=12800 - 512 * seed)
        _run(root, "offline", "grpo", seed, rounds=0, sequences=0)
    rep = build_report(root)
    with open(root / "cost.csv") as f:
        rows = {r["regime"]: r for r in csv.DictReader(f)}
    assert sorted(rows) == ["offline", "online", "stale64"]
    on, st, off = rows["online"], rows["stale64"], rows["offline"]
    assert on["n_runs"] == "2" and float(on["units_trained"]) == 200 * 32
    assert float(on["sampled_sequences"]) == 12800 and float(on["generation_calls"]) == 100
    assert float(on["sequences_per_call"]) == 128 and float(on["pushes_vs_online"]) == 1.0
    assert float(st["sampled_sequences"]) == (12800 + 12288) / 2  # mean over the seeds
    assert float(st["weight_pushes"]) == 4 and float(st["pushes_vs_online"]) == pytest.approx(4 / 100)
    assert float(st["sequences_per_call"]) == pytest.approx(12544 / 4)
    assert float(st["sequences_vs_online"]) == pytest.approx(12544 / 12800)
    assert float(off["generation_calls"]) == 0 and off["sequences_per_call"] == "" and float(off["pushes_vs_online"]) == 0
    assert "## Generation cost at matched training units" in rep.markdown
    assert "| arithmetic | grpo | stale64 | 2 | 6400 | 12544 | 4.0 | 4.0 | 3136 | 0.040x |" in rep.markdown


def test_learning_curves_average_seeds_at_each_step(tmp_path):
    """eval_vs_step.png: accuracy against the optimizer step, start (step 0), periodic evals (metrics.jsonl) and
    the final eval; the line is the mean of the seeds at the steps every seed evaluated."""
    from humanline_cli.report.plots import step_curves

    root = tmp_path / "sweep"
    for seed, (mid, final) in enumerate([(0.70, 0.90), (0.80, 0.94)]):
        _run(root, "online", "grpo", seed, rounds=100, sequences=0)
        d = root / "online" / f"grpo_seed{seed}"
        s = json.loads((d / "summary.json").read_text())
        s["eval"]["greedy"] = {"start_accuracy": 0.64, "accuracy": final}
        (d / "summary.json").write_text(json.dumps(s))
        (d / "metrics.jsonl").write_text(json.dumps({"step": 100, "eval/greedy/accuracy": mid}) + "\n"
                                         + json.dumps({"step": 150, "loss": 0.3}) + "\n")
    rep = build_report(root)
    assert "eval_vs_step.png" in rep.files and (root / "eval_vs_step.png").stat().st_size > 10_000
    greedy = step_curves(rep.frame, "greedy")
    run0 = greedy[greedy.run == next(r.Index for r in rep.frame.itertuples() if r.seed == 0)]
    assert list(zip(run0.step, run0.value)) == [(0, 0.64), (100, 0.70), (200, 0.90)]
    assert step_curves(rep.frame, "sampled").empty  # no sampled numbers at all: no curve
    assert "eval_vs_step.png" not in rep.skipped_plots
