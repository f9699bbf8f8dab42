"""Your own model, data and judge: task=custom end to end on a tiny Qwen2 model with a byte-level BPE
tokenizer built here (no Llama, no bundled world), offline and online, with a reward-model judge and
with no judge; a task file of your own through hydra.searchpath in a single run; truncation counted
and refused above the threshold; a custom model on a bundled task refused."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.cli import run_cli
from tests.helpers.models import build_tiny_qwen, write_files


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("custom")
    policy, rm = build_tiny_qwen(root)
    return {"policy": policy, "rm": rm, **write_files(root)}


SMALL = ["train.steps=2", "train.batch_size=4", "threads=1", "eval.n_prompts=4", "eval.max_new_tokens=8",
         "train.max_length=96", "train.max_prompt_length=48"]


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def test_custom_task_offline_with_a_reward_model_judge(world, tmp_path):
    run = tmp_path / "run"
    r = run_cli(["train", "task=custom", f"model.name_or_path={world['policy']}", f"data.path={world['pairs']}",
                 f"task.prompts.eval={world['prompts']}", "task.judge.kind=model",
                 f"task.judge.name_or_path={world['rm']}", *SMALL, f"hydra.run.dir={run}"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    s = _summary(run)
    assert s["task"] == "custom" and s["model"] == "qwen"  # named after what ran, not the option's `tiny`
    assert s["eval"]["judge"] == f"model:{world['rm']}" and s["eval"]["n_prompts"] == 4
    assert s["eval"]["accuracy"] is None and s["eval"]["reward_mean"] != 0.0  # a real RM score, not a verifier's
    assert "no completion cut" in r.stderr  # the header reports truncation


@pytest.mark.parametrize("objective", ["dpo", "grpo"])
def test_custom_task_online_with_a_reward_model_labeller_and_no_judge(world, tmp_path, objective):
    run = tmp_path / "run"
    r = run_cli(["train", "task=custom", f"objective={objective}", "data=online", f"model.name_or_path={world['policy']}",
                 f"task.prompts.train={world['prompts']}", "task.labeller.kind=model",
                 f"task.labeller.name_or_path={world['rm']}", "data.prompts_per_round=4", "data.n=2",
                 "data.max_new_tokens=8", *SMALL, f"hydra.run.dir={run}"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    s = _summary(run)
    assert s["eval"] is None and s["data"] == "online"  # judge kind none: trained, not evaluated
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) % 8 == 0 and len({x["score"] for x in samples}) > 1  # rounds of 4 prompts x 2


def test_a_task_file_of_your_own_through_the_searchpath_in_a_single_run(world, tmp_path):
    conf = tmp_path / "myconf" / "task"
    conf.mkdir(parents=True)
    (conf / "mine.yaml").write_text(
        "defaults:\n  - /schema/task/task@_here_\n  - _self_\nname: mine\n"
        "lengths: {max_length: 96, max_prompt_length: 48, max_new_tokens: 8}\n"
        f"prompts: {{eval: {world['prompts']}}}\noffline: {{path: {world['pairs']}}}\n"
        "labeller: {kind: none}\njudge: {kind: none}\n")
    run = tmp_path / "run"
    r = run_cli(["train", f"hydra.searchpath=[file://{tmp_path / 'myconf'}]", "task=mine",
                 f"model.name_or_path={world['policy']}", "train.steps=2", "train.batch_size=4", "threads=1",
                 f"hydra.run.dir={run}"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _summary(run)["task"] == "mine"


def test_truncation_is_counted_and_refused_above_the_threshold(world, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(world["policy"])
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True)
               for c in ("Write a short poem about the sea.", "Why is the sky blue?")]
    prompts = [p["input_ids"] if hasattr(p, "keys") else p for p in prompts]
    need = {c: [len(p) + len(tok(c, add_special_tokens=False)["input_ids"]) + 1 for p in prompts]
            for c in ("No.", "Rain falls softly on the quiet town.")}
    max_length = max(need["No."])  # every "No." fits, every "Rain ..." (the chosen side) is cut
    assert min(need["Rain falls softly on the quiet town."]) > max_length
    args = ["train", "task=custom", f"model.name_or_path={world['policy']}", f"data.path={world['pairs']}",
            "task.judge.kind=none", "train.steps=1", "train.batch_size=4", "threads=1",
            f"train.max_length={max_length}", f"train.max_prompt_length={max(len(p) for p in prompts)}"]
    r = run_cli([*args, f"hydra.run.dir={tmp_path / 'a'}"], tmp_path)
    assert r.returncode == 2 and "train.max_length" in r.stderr and "completions cut" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    # "Rain falls softly on the quiet town." never fits; "No." does: exactly half of the 32 completions are cut
    assert "16 of 32 completions cut (50.0%" in r.stderr
    r = run_cli([*args, "train.max_truncated_fraction=1.0", f"hydra.run.dir={tmp_path / 'b'}"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "16 of 32 completions cut" in r.stderr  # allowed, and still reported in the header


def test_a_custom_model_on_a_bundled_task_is_refused_or_warned(world, tmp_path, cache_dir):
    from tests.helpers.cli import FAST, TINY_WORLD

    base = ["train", *TINY_WORLD, *FAST, f"model.name_or_path={world['policy']}"]
    r = run_cli([*base, f"hydra.run.dir={tmp_path / 'a'}"], tmp_path)
    assert r.returncode == 2 and "task=custom" in r.stderr and len(r.stderr.strip().splitlines()) == 1
