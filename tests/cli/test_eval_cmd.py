"""`humanline eval` rebuilds the evaluator with the same builder as `humanline train`: on a
non-world layout (a save_to_disk dataset with MATH-style column names and a test split, string
prompts, a chat-template tokenizer, a tiny model made here) both evaluate the same test prompts."""
from __future__ import annotations

import json

import pytest

from humanline_cli.world.tokenizer import build_tokenizer
from tests.helpers.cli import run_cli
from tests.helpers.models import tiny_llama


def test_eval_command_uses_the_tasks_eval_split_columns_and_chat_template(tmp_path):
    import datasets

    tok = build_tokenizer()
    model_dir = tmp_path / "model"
    tiny_llama(0, vocab_size=len(tok), hidden_size=64, intermediate_size=128, head_dim=32,
               pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
               eos_token_id=tok.eos_token_id).save_pretrained(model_dir, safe_serialization=True)
    tok.save_pretrained(model_dir)
    train = [{"problem": f"{a}+{a}=", "solution": str(2 * a)} for a in range(10)]
    test = [{"problem": f"{a}*3=", "solution": str(3 * a)} for a in range(6)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train),
                          "test": datasets.Dataset.from_list(test)}).save_to_disk(str(tmp_path / "ds"))
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"{a}+1=", "chosen": str(a + 1), "rejected": str(a)}) + "\n"
                             for a in range(16)))
    run = tmp_path / "run"
    r = run_cli(["train", "task=math", f"model.name_or_path={model_dir}", f"task.prompts.eval={tmp_path / 'ds'}",
                 f"data.path={pairs}", "data.columns=null", "train.steps=2", "train.batch_size=4", "threads=1",
                 "eval.n_prompts=4", "eval.temperature=0", f"hydra.run.dir={run}",
                 # within the model's 64 positions (task=math's 2048/512/1024 would be refused)
                 "train.max_length=64", "train.max_prompt_length=32", "eval.max_new_tokens=16"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    in_run = [json.loads(x)["prompt"] for x in (run / "eval_samples.jsonl").read_text().splitlines()]
    assert in_run == [row["problem"] for row in test[:4]]  # the test split, renamed columns, first n
    r = run_cli(["eval", str(run), "--against", "start"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    by_eval = [json.loads(x)["prompt"] for x in (run / "eval_vs_start_samples.jsonl").read_text().splitlines()]
    assert by_eval == in_run
    result = json.loads((run / "eval_vs_start.json").read_text())
    assert result["n_prompts"] == 4 and result["judge"] == "verifier"
    # greedy generation from the same chat-wrapped prompt ids: the trained policy's replies match the run's
    trained = [json.loads(x)["policy"] for x in (run / "eval_samples.jsonl").read_text().splitlines()]
    assert [json.loads(x)["policy"] for x in (run / "eval_vs_start_samples.jsonl").read_text().splitlines()] == trained


def test_eval_error_line_masks_a_secret_override(tmp_path, capsys):
    from humanline_cli.cli.eval import main_eval

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("{}\n")
    (run / "model").mkdir()
    (run / "model" / "config.json").write_text("{}\n")
    assert main_eval([str(run), "+judge.api_key=sk-test-0123456789"]) == 2
    err = capsys.readouterr().err
    assert err == ("humanline: error: humanline eval takes judge=NAME, judge.KEY=VALUE, task.judge.KEY=VALUE, "
                   "task.prompts.KEY=VALUE, task.verifiable=BOOL and eval.KEY=VALUE overrides; got "
                   "'+judge.api_key=***'\n")


def test_eval_argument_errors_are_one_line(tmp_path, capsys):
    from humanline_cli.cli.eval import main_eval

    with pytest.raises(SystemExit) as e:
        main_eval([str(tmp_path), "--n-prompts", "many"])
    assert e.value.code == 2 and capsys.readouterr().err == (
        "humanline: error: eval: argument --n-prompts: invalid int value: 'many' (--help shows the usage)\n")
