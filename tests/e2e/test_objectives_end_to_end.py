"""End to end through the real CLI (subprocesses, Hydra multirun, wandb offline) on a tiny world:
every objective with and without humanline trains, changes every trainable parameter, and leaves
the documented outputs; bad input exits 2 with one line."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from humanline_cli.core.objectives import PROPERTIES
from tests.helpers.cli import FAST, TINY_WORLD, run_cli

SUMMARY_KEYS = {"objective", "data", "humanline", "task", "model", "seed", "steps", "eval", "wall_clock_s"}


@pytest.fixture(scope="module")
def sweep(cache_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sweep")
    r = run_cli(["train", "-m", "objective=dpo,kto,grpo", "+humanline=true,false", *TINY_WORLD, *FAST,
                 "wandb.mode=offline", f"hydra.sweep.dir={out}"], cwd=out)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def _runs(sweep: Path) -> list[Path]:
    return sorted(p.parent for p in sweep.glob("*/summary.json"))


def _start_policy(cache_dir: Path) -> dict:
    (policy,) = [p for p in cache_dir.glob("arithmetic-*/policy") if p.is_dir()]
    return load_file(policy / "model.safetensors")


def test_multirun_makes_one_complete_run_dir_per_job(sweep):
    runs = _runs(sweep)
    assert len(runs) == 6
    seen = set()
    for run in runs:
        s = json.loads((run / "summary.json").read_text())
        assert set(s) >= SUMMARY_KEYS and s["status"] == "complete"
        seen.add((s["objective"], s["humanline"]))
        assert s["data"] == "offline" and s["task"] == "arithmetic" and s["steps"] == 3
        ev = s["eval"]
        lo, hi = ev["win_rate_ci"]
        assert 0.0 <= lo <= ev["win_rate"] <= hi <= 1.0
        assert 0.0 <= ev["accuracy"] <= 1.0 and ev["accuracy"] == ev["reward_mean"]
        w = s["wall_clock_s"]
        assert {"total", "setup", "train", "eval", "sample", "label"} <= set(w)
        assert w["total"] >= w["train"] > 0 and w["sample"] == 0.0 and w["label"] == 0.0
        assert (run / ".hydra" / "config.yaml").exists() and (run / "eval_samples.jsonl").exists()
    assert seen == {(o, h) for o in ("dpo", "kto", "grpo") for h in (True, False)}


def test_metrics_jsonl_rows(sweep):
    for run in _runs(sweep):
        s = json.loads((run / "summary.json").read_text())
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2, 3]
        for r in rows:
            assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "wall_s"} <= set(r)
            assert r["tokens_per_s"] > 0
            assert ("humanline/unclamped_fraction" in r) == s["humanline"]
            # plain offline: the reference is fixed, so its log-probs are cached (no unit repeats in 3 steps)
            assert r.get("reference_cache/hit_fraction", "off") == ("off" if s["humanline"] else 0.0)
        if s["objective"] == "dpo":
            assert abs(rows[0]["loss"] - 0.6931471805599453) < 1e-5  # ln 2: policy == reference at step 1


def test_every_trainable_parameter_changed(sweep, cache_dir):
    start = _start_policy(cache_dir)
    for run in _runs(sweep):
        trained = load_file(run / "model" / "model.safetensors")
        assert trained.keys() == start.keys()
        unchanged = [k for k in start if (trained[k] == start[k]).all()]
        assert not unchanged, f"{run.name}: unchanged {unchanged}"
        assert (run / "model" / "tokenizer.json").exists()


def test_wandb_offline_run_reads_back(sweep):
    run = _runs(sweep)[0]
    (wrun,) = list((run / "wandb").glob("offline-run-*"))
    wandb_cli = Path(sys.executable).parent / "wandb"  # CI runs the venv's python without activating it
    out = subprocess.run([str(wandb_cli), "leet", "inspect", "--summary", "--json", str(wrun)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    s = json.loads((run / "summary.json").read_text())
    assert str(s["objective"]) in text and "loss" in text


def test_help_and_cfg_job(tmp_path):
    r = run_cli(["train", "--help"], cwd=tmp_path)
    assert r.returncode == 0 and f"objective: {', '.join(sorted(PROPERTIES))}" in r.stdout
    r = run_cli(["train", "--cfg", "job", "objective=kto", "+humanline=true"], cwd=tmp_path)
    assert r.returncode == 0 and "name: kto" in r.stdout and "humanline: true" in r.stdout


@pytest.mark.parametrize("args,needle", [
    (["objective=foo"], "unknown objective 'foo'"),
    (["task=nope"], "unknown task 'nope'"),
    (["train.lr=abc"], "train.lr"),
    (["+humanline=true", "+humanline=false"], "humanline"),
    (["data.path=missing.jsonl"], "missing.jsonl does not exist"),
    (["train.lrr=1"], "config key 'train.lrr'"),
    (["objective=grpo", "objective.ratio_denominator=sampler"], "needs data=online"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, cache_dir, args, needle):
    r = run_cli(["train", *TINY_WORLD, *FAST, *args, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert r.returncode == 2
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "run" / "summary.json").exists()


def test_malformed_data_names_file_and_line(tmp_path, cache_dir):
    data = tmp_path / "prefs.jsonl"
    data.write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n{"prompt": "1+2=", "chosen": 3\n')
    r = run_cli(["train", f"data.path={data}", *TINY_WORLD, *FAST, f"hydra.run.dir={tmp_path / 'run'}"],
                cwd=tmp_path)
    assert r.returncode == 2 and f"{data}:2: malformed JSON" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_relative_data_path_is_found_with_hydra_job_chdir(tmp_path, cache_dir):
    """hydra.job.chdir=true moves the job into its run dir: a relative data.path still means the file next
    to where the command was typed (the malformed line 2 proves it was found and read)."""
    (tmp_path / "prefs.jsonl").write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n'
                                          '{"prompt": "1+2=", "chosen": 3\n')
    r = run_cli(["train", "data.path=prefs.jsonl", "hydra.job.chdir=true", *TINY_WORLD, *FAST,
                 f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert r.returncode == 2 and f"{tmp_path / 'prefs.jsonl'}:2: malformed JSON" in r.stderr, r.stderr[-2000:]


def test_eval_command_against_start_and_against_itself(sweep, tmp_path):
    run = _runs(sweep)[0]
    r = run_cli(["eval", str(run), "--against", "start", "--n-prompts", "16"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((run / "eval_vs_start.json").read_text())
    lo, hi = res["win_rate_ci"]
    assert res["n_prompts"] == 16 and 0.0 <= lo <= res["win_rate"] <= hi <= 1.0 and "win rate" in r.stdout
    # the same policy, sampled with the same seed, ties on every prompt: exactly 1/2 with a zero-width CI
    r = run_cli(["eval", str(run), "--against", str(run), "--n-prompts", "16"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    same = json.loads((run / f"eval_vs_{run.name}.json").read_text())
    assert same["win_rate"] == 0.5 and same["win_rate_ci"] == [0.5, 0.5]
    bad = run_cli(["eval", str(tmp_path)], cwd=tmp_path)
    assert bad.returncode == 2 and "not a run dir" in bad.stderr


def test_metrics_rows_carry_phase_times(sweep):
    row = json.loads((_runs(sweep)[0] / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"time/setup", "time/train", "time/sample", "time/label", "time/sync"} <= set(row)
    assert row["time/train"] > 0 and row["time/sample"] == 0.0
