"""The end of a run: a tempered run (objective.tempered_logps) with sampler=vllm evaluates in the engine's
log-prob mode (the main evaluator's sampled baseline and MATH-500's T=0.7 samples); the model and a
summary.json are written before any end-of-run evaluation, so one that fails leaves a usable model and a
rerun of the same command evaluates without training again."""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.cli import FAST, TINY_WORLD, run_cli

# experiment=paper_math on the bundled arithmetic world: the recipe's hub prompts, system prompt, verifier
# labeller and lengths replaced by the world's (its tokenizer knows lower-case, digits and a few signs)
PAPER_MATH_TINY = [
    "experiment=paper_math", "task=arithmetic", "model=tiny", "backend=cpu", *TINY_WORLD, "threads=1",
    "train.steps=1", "train.log_every=1", "eval.n_prompts=4", "eval.max_new_tokens=6", "data.n=4",
    "data.max_new_tokens=6", "task.system_prompt=null", "task.prompts.train=world://prompts_train.jsonl",
    "task.prompts.eval=world://prompts_eval.jsonl", "task.prompts.eval_split=train", "task.prompts.columns=null",
    "task.labeller={kind: world, task: arithmetic, role: labeller, weights: null, method: math}",
    "task.lengths={max_length: 64, max_prompt_length: 32, max_new_tokens: 8}", "eval.math500.n_samples=2"]
PROBLEMS = [("2+3=", "5"), ("5+7=", "12"), ("7+8=", "15"), ("6+6=", "12")]


@pytest.mark.slow
def test_paper_math_with_vllm_completes_with_math500_accuracy(cache_dir, tmp_path):
    problems = tmp_path / "math500.jsonl"
    problems.write_text("".join(json.dumps({"problem": p, "answer": a}) + "\n" for p, a in PROBLEMS))
    run = tmp_path / "run"
    r = run_cli(["train", *PAPER_MATH_TINY, f"eval.math500.prompts={problems}", f"hydra.run.dir={run}"], tmp_path,
                env_extra={"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    config = json.loads((run / "resolved_config.json").read_text())
    assert config["objective"]["tempered_logps"] is True and config["sampler"]["name"] == "vllm"
    s = json.loads((run / "summary.json").read_text())
    assert s["status"] == "complete" and s["objective"] == "grpo" and s["data"] == "online"
    assert s["eval"]["start_accuracy"] is not None  # the sampled baseline ran on the tempered engine
    m = s["eval"]["math500"]
    assert m["n"] == 4 and m["n_samples"] == 2 and m["temperature"] == 0.7
    rows = [json.loads(x) for x in (run / "math500_samples.jsonl").read_text().splitlines()]
    assert [(row["prompt"], row["answer"]) for row in rows] == PROBLEMS
    # the accuracies read back from the per-problem verdicts (the verifier: the reply's number is the answer)
    assert [row["greedy_correct"] for row in rows] == [float(row["greedy"].strip() == row["answer"]) for row in rows]
    assert m["greedy_accuracy"] == sum(row["greedy_correct"] for row in rows) / 4
    assert m["sampled_accuracy"] == sum(sum(row["correct"]) / 2 for row in rows) / 4
    assert (run / "model" / "model.safetensors").is_file()


def _cfg(run_dir_overrides):
    from hydra import compose, initialize_config_module

    from humanline_cli.cli.overrides import normalize_overrides

    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose("train", overrides=normalize_overrides(run_dir_overrides))


@pytest.mark.slow
def test_an_eval_failure_keeps_the_model_and_the_rerun_only_evaluates(cache_dir, tmp_path, monkeypatch, one_thread):
    """The judge fails after the last step: model/ and summary.json (status "trained") are there and the
    model loads; the same command then resumes at the last step's checkpoint and only evaluates."""
    from humanline_cli.config import resolve
    from humanline_cli.errors import RunFailed
    from humanline_cli.eval.evaluator import Evaluator
    from humanline_cli.train.job import Context, run_rank
    from humanline_cli.train.rundir import prepare_run_dir

    cfg = _cfg([*TINY_WORLD, *FAST, "objective=dpo"])  # train.steps=3, checkpoint_every 50: not due at 3
    spec = resolve(cfg)
    run = tmp_path / "run"
    real_evaluate = Evaluator.evaluate

    def judge_down(self, sampler, samples_path=None):
        raise RunFailed("judge unreachable")

    monkeypatch.setattr(Evaluator, "evaluate", judge_down)
    prepare_run_dir(run, spec.config, True)
    with pytest.raises(RunFailed, match="judge unreachable"):
        run_rank(spec, Context(run, tmp_path))
    s = json.loads((run / "summary.json").read_text())
    assert s["status"] == "trained" and s["eval"] is None and s["steps"] == 3
    assert json.loads((run / "failed.json").read_text())["error"] == "RunFailed: judge unreachable"
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run / "model")  # usable: loads and runs
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()
    saved = (run / "model" / "model.safetensors").stat().st_mtime_ns
    rows = (run / "metrics.jsonl").read_text()
    assert [json.loads(x)["step"] for x in rows.splitlines()] == [1, 2, 3]

    monkeypatch.setattr(Evaluator, "evaluate", real_evaluate)
    assert prepare_run_dir(run, spec.config, True) == 3  # the rerun's checkpoint: the last step
    s = run_rank(spec, Context(run, tmp_path))
    assert s["status"] == "complete" and s["resumed_from_step"] == 3 and 0.0 <= s["eval"]["accuracy"] <= 1.0
    assert (run / "metrics.jsonl").read_text() == rows  # no step trained again
    assert (run / "model" / "model.safetensors").stat().st_mtime_ns == saved  # the first attempt's model kept
    assert json.loads((run / "summary.json").read_text())["status"] == "complete"
    assert not (run / "failed.json").exists()
