"""A newcomer's own model and data: a checkpoint missing weights (a causal LM given as the
reward model) refused in one line; a copied run dir never a second seed in `humanline report`; column
renames in every spelling the docs show, through the real Hydra composition; lengths checked against
the model's positions before any weight loads; `humanline eval` with any judge after training without one."""
from __future__ import annotations

import json
import shutil

import pytest

from tests.helpers.cli import run_cli
from tests.helpers.models import build_tiny_qwen, write_files


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("own")
    policy, rm = build_tiny_qwen(root)
    return {"root": root, "policy": policy, "rm": rm, **write_files(root)}


# ---------------------------------------------------------------- 1a: missing weights are an error
def test_a_causal_lm_as_reward_model_or_a_reward_model_as_policy_is_refused(world):
    import torch

    from humanline_cli.errors import UserError
    from humanline_cli.models import load_policy
    from humanline_cli.rewards.scorers import make_scorer

    for key in ("task.judge", "task.labeller", "reward"):
        with pytest.raises(UserError) as e:
            make_scorer({"kind": "model", "name_or_path": str(world["policy"])}, None, key)
        msg = str(e.value)
        assert msg.startswith(f"{key}.name_or_path={world['policy']}: ") and "score.weight" in msg, msg
        assert "\n" not in msg
    with pytest.raises(UserError) as e:  # the reward model has no lm_head: as a policy it would be random
        load_policy(str(world["rm"]), torch.device("cpu"))
    assert str(e.value).startswith(f"model.name_or_path={world['rm']}: ") and "lm_head.weight" in str(e.value)
    name, scorer = make_scorer({"kind": "model", "name_or_path": str(world["rm"])}, None, "task.judge")
    assert name == f"model:{world['rm']}" and "//" not in name  # a clean judge name
    assert len(scorer(["a"], ["b"])) == 1


def test_train_with_a_causal_lm_judge_stops_in_one_line_before_training(world, tmp_path):
    run = tmp_path / "run"
    r = run_cli(["train", "task=custom", f"model.name_or_path={world['policy']}", f"data.path={world['pairs']}",
                 f"task.prompts.eval={world['prompts']}", "task.judge.kind=model",
                 f"task.judge.name_or_path={world['policy']}", "train.steps=1", "train.batch_size=4", "threads=1",
                 "train.max_length=96", "train.max_prompt_length=48", "eval.max_new_tokens=8",
                 f"hydra.run.dir={run}"], tmp_path)
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith(f"humanline: error: task.judge.name_or_path={world['policy']}: "), lines
    assert "score.weight" in lines[-1] and "LOAD REPORT" not in r.stderr
    assert not (run / "summary.json").exists() and not (run / "model").exists()


# ---------------------------------------------------------------- 1b: duplicate run dirs in report
def test_report_counts_a_copied_run_dir_once_and_says_which(tmp_path, capsys):
    from humanline_cli.report.aggregate import build_report, main_report
    from tests.helpers.runs import make_run

    root = tmp_path / "runs"
    make_run(root, "a", "dpo", "offline", False, 0, win=0.6, wall=10.0)
    make_run(root, "c", "dpo", "offline", False, 1, win=0.7, wall=10.0)
    shutil.copytree(root / "a", root / "b")                                 # a copy (to re-judge it, say)
    make_run(root, "d", "dpo", "offline", False, 0, win=0.62, wall=12.0)    # the same config and seed, rerun
    rep = build_report(root)
    (cell,) = rep.cells.to_dict("records")
    assert cell["n_seeds"] == 2 and sorted(cell["seeds"]) == [0, 1]       # before: 4 "seeds"
    assert cell["win_rate_mean"] == pytest.approx((0.6 + 0.7) / 2, abs=1e-12)
    dups = {d.dropped.path.name: (d.kept.path.name, d.same_outputs) for d in rep.duplicates}
    assert dups == {"b": ("a", True), "d": ("a", False)}
    assert "`b` duplicates `a` (identical outputs)" in rep.markdown
    assert "`d` duplicates `a` (outputs differ)" in rep.markdown
    assert main_report([str(root), "--out", str(tmp_path / "out")]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the console wraps long lines
    assert f"duplicate run dir: {root / 'b'} duplicates {root / 'a'} (a copy: identical outputs); counted once" in out


# ---------------------------------------------------------------- 2: column renames, every spelling
SPELLINGS = [  # (override, data.columns, task.prompts.columns) after composing task=custom
    ("data.columns={instruction: prompt}", {"instruction": "prompt"}, {}),
    ("data.columns.instruction=prompt", {"instruction": "prompt"}, {}),
    ("+data.columns={instruction: prompt}", {"instruction": "prompt"}, {}),
    ("++data.columns={instruction: prompt}", {"instruction": "prompt"}, {}),
    ("task.offline.columns={instruction: prompt}", {"instruction": "prompt"}, {}),
    ("task.offline.columns.instruction=prompt", {"instruction": "prompt"}, {}),
    ("task.prompts.columns={question: prompt}", {}, {"question": "prompt"}),
    ("task.prompts.columns.question=prompt", {}, {"question": "prompt"}),
    ("+task.prompts.columns={question: prompt}", {}, {"question": "prompt"}),
    ("++task.prompts.columns={question: prompt}", {}, {"question": "prompt"}),
]


@pytest.mark.parametrize("override,data_columns,prompt_columns", SPELLINGS, ids=[s[0] for s in SPELLINGS])
def test_every_column_rename_spelling_composes(override, data_columns, prompt_columns):
    from hydra import compose, initialize_config_module

    from humanline_cli.config import resolve

    with initialize_config_module(config_module="conf", version_base="1.3"):
        spec = resolve(compose("train", overrides=["task=custom", "data.path=x.jsonl", "task.prompts.eval=y.jsonl",
                                                    override]))
    assert spec.data_cfg.columns == data_columns and spec.task_cfg.prompts.columns == prompt_columns


def test_the_data_renames_stack_on_the_tasks_own():
    from hydra import compose, initialize_config_module

    from humanline_cli.config import resolve

    with initialize_config_module(config_module="conf", version_base="1.3"):
        spec = resolve(compose("train", overrides=["task=custom", "data.path=x.jsonl", "task.prompts.eval=y.jsonl",
                                                    "task.offline.columns={a: prompt, b: chosen}",
                                                    "data.columns={b: rejected, c: chosen}"]))
        math = resolve(compose("train", overrides=["task=math", "model.name_or_path=m"]))
    assert spec.data_cfg.columns == {"a": "prompt", "b": "rejected", "c": "chosen"}  # data.columns wins per key
    assert math.data_cfg.columns["instruction"] == "prompt"                        # the task's own still apply
    assert math.task_cfg.prompts.columns == {"problem": "prompt", "solution": "answer"}
    with initialize_config_module(config_module="conf", version_base="1.3"):  # null: no renames at all
        plain = resolve(compose("train", overrides=["task=math", "model.name_or_path=m", "data.columns=null"]))
    assert plain.data_cfg.columns is None


def test_renamed_training_data_and_eval_prompts_train_from_the_command_line(world, tmp_path):
    pairs, prompts = tmp_path / "pairs.jsonl", tmp_path / "prompts.jsonl"
    pairs.write_text("".join(json.dumps({"instruction": r["prompt"], "good": r["chosen"], "bad": r["rejected"]}) + "\n"
                             for r in map(json.loads, world["pairs"].read_text().splitlines())))
    prompts.write_text("".join(json.dumps({"question": r["prompt"]}) + "\n"
                               for r in map(json.loads, world["prompts"].read_text().splitlines())))
    run = tmp_path / "run"
    r = run_cli(["train", "task=custom", f"model.name_or_path={world['policy']}", f"data.path={pairs}",
                 "data.columns={instruction: prompt, good: chosen, bad: rejected}",
                 f"task.prompts.eval={prompts}", "task.prompts.columns={question: prompt}",
                 "task.judge.kind=model", f"task.judge.name_or_path={world['rm']}", "train.steps=1",
                 "train.batch_size=4", "threads=1", "eval.n_prompts=4", "eval.max_new_tokens=8", "eval.greedy=false",
                 "train.max_length=96", "train.max_prompt_length=48", "train.save_model=false",
                 f"hydra.run.dir={run}"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((run / "summary.json").read_text())
    assert s["eval"]["n_prompts"] == 4 and s["eval"]["judge"] == f"model:{world['rm']}"


# ---------------------------------------------------------------- 3: lengths, before any weight loads
@pytest.fixture(scope="module")
def short_model(world):
    """A GPT-2-style model with 256 positions: config.json and the tokenizer, and NO weights file, so a
    check that reads anything but config.json would fail with another message."""
    from transformers import AutoTokenizer, GPT2Config

    path = world["root"] / "gpt2-256"
    tok = AutoTokenizer.from_pretrained(world["policy"])
    GPT2Config(vocab_size=len(tok), n_positions=256, n_embd=32, n_layer=1, n_head=2,
               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_lengths_past_the_models_positions_stop_in_one_line(world, short_model, tmp_path):
    run = tmp_path / "run"  # task=custom's default lengths 1024/512/512 on a 256-position model
    r = run_cli(["train", "task=custom", f"model.name_or_path={short_model}", f"data.path={world['pairs']}",
                 "task.judge.kind=none", "threads=1", f"hydra.run.dir={run}"], tmp_path)
    assert r.returncode == 2, r.stderr[-3000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"humanline: error: train.max_length (1024) > the model's max_position_embeddings (256, "
                           f"{short_model}/config.json): set train.max_length<=256"), line
    assert "Traceback" not in r.stderr and not (run / "model").exists()


def test_the_vllm_engines_length_is_checked_against_the_model_too(world, short_model):
    from hydra import compose, initialize_config_module

    from humanline_cli.config import resolve
    from humanline_cli.errors import UserError
    from humanline_cli.train.lengths import check_model_lengths, model_positions

    assert model_positions(str(short_model)) == 256  # GPT-2's n_positions, read from config.json alone
    base = ["task=custom", f"model.name_or_path={short_model}", "data=online", f"task.prompts.train={world['prompts']}",
            "task.labeller.kind=verifier", "sampler=vllm", "train.max_length=256", "train.max_prompt_length=128",
            "data.max_new_tokens=64"]
    with initialize_config_module(config_module="conf", version_base="1.3"):
        fits = resolve(compose("train", overrides=base))             # max_model_len = train.max_length = 256
        too_long = resolve(compose("train", overrides=[*base, "sampler.max_model_len=1024"]))
    check_model_lengths(fits, str(short_model))
    with pytest.raises(UserError) as e:
        check_model_lengths(too_long, str(short_model))
    assert str(e.value).startswith("sampler.max_model_len (1024) > the model's max_position_embeddings (256, ")


@pytest.mark.parametrize("overrides,message", [
    # evaluation only samples: its budget is bounded by vLLM's engine (and the model's positions), not train.max_length
    (["data=online", "task.prompts.train=p.jsonl", "task.labeller.kind=verifier", "sampler=vllm",
      "sampler.max_model_len=1024", "task.prompts.eval=e.jsonl", "task.judge.kind=verifier", "eval.max_new_tokens=600"],
     "sampler.max_model_len (1024) < train.max_prompt_length (512) + eval.max_new_tokens (600)"),
    (["data=online", "task.prompts.train=p.jsonl", "task.labeller.kind=verifier", "sampler=vllm",
      "sampler.max_model_len=600"], "sampler.max_model_len (600) < train.max_prompt_length (512) + "
                                    "data.max_new_tokens (512)"),
    (["judge=llm"], "config key 'task.prompts.eval' is missing: task 'custom' has no held-out prompts for judge=llm"),
    (["task.judge.kind=model", "task.judge.name_or_path=rm"], "config key 'task.prompts.eval' is missing"),
])
def test_lengths_against_each_other_and_eval_prompts_for_every_judge(overrides, message):
    from hydra import compose, initialize_config_module

    from humanline_cli.config import resolve
    from humanline_cli.errors import UserError

    with initialize_config_module(config_module="conf", version_base="1.3"), pytest.raises(UserError) as e:
        resolve(compose("train", overrides=["task=custom", "data.path=x.jsonl", "model.name_or_path=m",
                                             *overrides]))
    assert str(e.value).startswith(message), str(e.value)


def test_a_vllm_validation_error_is_shown_whole():
    """The engine's start-up error as vLLM raises it (a pydantic ValidationError whose first line names no
    cause) reaches the user whole, on one line."""
    import pydantic

    from humanline_cli.errors import RunFailed
    from humanline_cli.sampling.vllm import VLLMSampler

    class ModelConfig(pydantic.BaseModel):
        max_model_len: int

        @pydantic.field_validator("max_model_len")
        @classmethod
        def fits(cls, v):
            raise ValueError(f"User-specified max_model_len ({v}) is greater than the derived max_model_len (256)")

    def start():
        ModelConfig(max_model_len=1024)

    sampler = object.__new__(VLLMSampler)  # only _call's error path, without an engine
    sampler._broken, sampler._engine_threads, sampler.timeout_s, sampler._cuda_device = None, 1, 30.0, None
    with pytest.raises(RunFailed) as e:
        sampler._call(start, "start")
    msg = str(e.value)
    assert msg.startswith("vLLM start failed: ValidationError: 1 validation error for ModelConfig; ")
    assert "User-specified max_model_len (1024) is greater than the derived max_model_len (256)" in msg
    assert "\n" not in msg


# ---------------------------------------------------------------- 5: a rerun after a failed run
def test_a_rerun_after_a_failed_run_starts_over_without_resume_false(world, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"instruction": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"]})
                             + "\n" for r in map(json.loads, world["pairs"].read_text().splitlines())))
    run = tmp_path / "run"
    base = ["train", "task=custom", f"model.name_or_path={world['policy']}", f"data.path={pairs}",
            "task.judge.kind=none", "train.steps=1", "train.batch_size=4", "threads=1", "train.max_length=96",
            "train.max_prompt_length=48", "train.save_model=false", f"hydra.run.dir={run}"]
    r = run_cli(base, tmp_path)  # no `prompt` field: a data error, the run fails
    assert r.returncode == 2 and "prompt" in r.stderr and (run / "failed.json").is_file(), r.stderr[-2000:]
    r = run_cli([*base, "data.columns={instruction: prompt}"], tmp_path)  # fixed by a changed key
    assert r.returncode == 0, r.stderr[-2000:]
    assert "held a failed run of another config with no checkpoint: starting over" in r.stderr
    assert (run / "previous-1" / "failed.json").is_file() and not (run / "failed.json").exists()
    assert json.loads((run / "summary.json").read_text())["status"] == "complete"


# ---------------------------------------------------------------- 4: judging later, with any judge
@pytest.fixture(scope="module")
def judgeless_run(world, tmp_path_factory):
    """The README's online-style case: a run trained with task.judge.kind=none and no eval prompts."""
    root = tmp_path_factory.mktemp("judgeless")
    run = root / "run"
    r = run_cli(["train", "task=custom", f"model.name_or_path={world['policy']}", f"data.path={world['pairs']}",
                 "task.judge.kind=none", "train.steps=1", "train.batch_size=4", "threads=1", "train.max_length=96",
                 "train.max_prompt_length=48", f"hydra.run.dir={run}"], root)
    assert r.returncode == 0, r.stderr[-3000:]
    questions = root / "questions.jsonl"  # eval prompts under another field name, renamed on the command line
    questions.write_text("".join(json.dumps({"question": json.loads(x)["prompt"]}) + "\n"
                                 for x in world["prompts"].read_text().splitlines()))
    return {"run": run, "questions": questions, "root": root}


def _eval(run, *args, capsys):
    """`humanline eval RUN --against start ...` in this process (the CLI's own entry, no interpreter start-up):
    (exit code, stderr lines)."""
    from humanline_cli.cli.eval import main_eval

    capsys.readouterr()
    code = main_eval([str(run), "--against", "start", "eval.n_prompts=4", "eval.max_new_tokens=8", "eval.greedy=false",
                      *args])
    return code, capsys.readouterr().err.strip().splitlines()


def test_eval_after_training_without_a_judge_names_what_to_add(judgeless_run, capsys):
    run = judgeless_run["run"]
    code, err = _eval(run, capsys=capsys)
    assert code == 2 and err == [
        f"humanline: error: {run} was trained without a judge (task.judge.kind=none): name one, e.g. "
        f"task.judge.kind=model task.judge.name_or_path=DIR, task.judge.kind=verifier, or judge=llm "
        f"(and task.prompts.eval=FILE if the run had no eval prompts)"], err
    for judge in (["judge=llm"], ["task.judge.kind=model", "task.judge.name_or_path=x"]):
        code, err = _eval(run, *judge, capsys=capsys)  # no eval prompts: one line for every judge
        assert code == 2 and len(err) == 1 and "config key 'task.prompts.eval' is missing" in err[0], err


def test_eval_with_a_reward_model_named_on_the_command_line(world, judgeless_run, capsys):
    run, prompts = judgeless_run["run"], [f"task.prompts.eval={judgeless_run['questions']}",
                                          "task.prompts.columns={question: prompt}"]
    code, err = _eval(run, *prompts, "task.judge.kind=model", f"task.judge.name_or_path={world['rm']}", capsys=capsys)
    assert code == 0, err
    res = json.loads((run / "eval_vs_start.json").read_text())
    assert res["judge"] == f"model:{world['rm']}" and res["n_prompts"] == 4
    assert 0.0 <= res["win_rate"] <= 1.0 and res["reward_mean"] is not None
    code, err = _eval(run, *prompts, "task.judge.kind=model", f"task.judge.name_or_path={world['policy']}",
                      capsys=capsys)
    assert code == 2 and err[-1].startswith(f"humanline: error: task.judge.name_or_path={world['policy']}: ")
    assert "score.weight" in err[-1]


def test_eval_with_every_judgment_unparsable_exits_2_with_the_count(judgeless_run, capsys):
    from tests.helpers.served import Stub, completion

    run = judgeless_run["run"]
    with Stub(lambda body, n, headers: (200, {}, completion("I cannot decide."))) as stub:
        code, err = _eval(run, f"task.prompts.eval={judgeless_run['questions']}",
                          "task.prompts.columns={question: prompt}", "judge=llm", f"judge.base_url={stub.url}",
                          "judge.model=stub", "judge.cache_dir=null", capsys=capsys)
    assert code == 2, err
    assert err[-1].startswith(f"humanline: error: {run} vs start: no parsable judgment, 4 of 4 pairs unparsable"), err
    assert len(stub.requests) >= 4  # every pair was asked


# ---------------------------------------------------------------- 5: third-party INFO off the console
def test_third_party_info_goes_to_the_log_file_not_the_console(tmp_path):
    """The real composed job-logging config plus the job's train.log: httpx's INFO line per judge call reaches
    train.log only."""
    import io
    import logging
    import logging.config

    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from humanline_cli.train.job import _attach_log

    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose("train", return_hydra_config=True)
    conf = OmegaConf.to_container(cfg.hydra.job_logging, resolve=False)
    console = io.StringIO()
    conf["handlers"]["console"]["stream"] = console
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        logging.config.dictConfig(conf)
        _attach_log(tmp_path)  # what the job adds once it holds its run dir
        logging.getLogger("httpx").info('HTTP Request: POST http://127.0.0.1/v1/chat/completions "HTTP/1.1 200 OK"')
        logging.getLogger("httpx").warning("retrying")
        logging.getLogger("humanline_cli.train.job").info("our own line")
        for h in root.handlers:
            h.flush()
    finally:
        for h in root.handlers:
            h.close()
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    shown, logged = console.getvalue(), (tmp_path / "train.log").read_text()
    assert "HTTP Request" not in shown and "retrying" in shown and "our own line" in shown
    assert "HTTP Request" in logged and "retrying" in logged and "our own line" in logged
