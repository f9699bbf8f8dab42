"""eval.math500: benchmark accuracy with the math task's math-verify verifier, greedy and sampled, on a local
problem file, through a tiny Llama rigged so every completion is known in advance:

Every layer's output projections (attention o_proj, MLP down_proj) are zero, so the residual stream at the last
position is the last token's embedding and the next token depends on the last token alone (a bigram model).
Embeddings are one-hot: every token is state e0 except `<skip>` (e3) and the two answer tokens (e1, e2). After
e0 the head gives `\\boxed{4}` logit 8L and `\\boxed{7}` logit 8L - ln 1.5 (the final RMSNorm turns a one-hot
row into 8 x the row at hidden size 64); after `<skip>`, ` no idea` (no extractable answer); after an answer
token, EOS. So a problem ending in `<q>` is answered `\\boxed{4}` greedily and, at temperature T,
`\\boxed{4}` with p = 1 / (1 + 1.5^(-1/T)) (0.641 at T 0.7) else `\\boxed{7}`; a problem ending in `<skip>` is
never answered. Accuracies then follow by hand from the file's answers.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.helpers.cli import run_cli

L = 20.0
ANSWERS = ["\\boxed{4}", "\\boxed{7}", " no idea"]
MARKERS = ["<q>", "<skip>"]
# (problem, reference answer, correct greedily): the reference answers are math-verify equivalents of 4 where
# the greedy answer is right (8/2, 4.0, a whole solution with \boxed{4}), 7 where only a sample can be right
PROBLEMS = [
    ("What is 2+2? <q>", "4", True),
    ("What is 8/2? <q>", "\\frac{8}{2}", True),
    ("What is 3+4? <q>", "7", False),
    ("What is 2*2? <q>", "4.0", True),
    ("What is 1+1? <q>", "2", False),
    ("Say nothing. <skip>", "4", False),
    ("What is 5+2? <q>", "7", False),
    ("What is 10-6? <q>", "We subtract: $10-6=\\boxed{4}$.", True),
]


def build_rigged(root: Path) -> Path:
    import torch

    from tests.helpers.models import build_bpe_tokenizer, two_layer_llama

    tok = build_bpe_tokenizer([p for p, _, _ in PROBLEMS] * 4, 300, 512, None)
    tok.add_tokens(ANSWERS + MARKERS)
    model = two_layer_llama(tok, 512)
    ids = {t: tok.convert_tokens_to_ids(t) for t in ANSWERS + MARKERS}
    a4, a7, none, skip = ids["\\boxed{4}"], ids["\\boxed{7}"], ids[" no idea"], ids["<skip>"]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb.zero_()
        emb[:, 0] = 1.0                     # state e0
        for t, j in ((a4, 1), (a7, 2), (none, 1), (skip, 3)):
            emb[t] = 0.0
            emb[t, j] = 1.0                 # answer tokens (and ` no idea`) lead to EOS via e1/e2
        head.zero_()
        head[a4, 0] = L
        head[a7, 0] = L - math.log(1.5) / 8
        head[tok.eos_token_id, 1] = head[tok.eos_token_id, 2] = L
        head[none, 3] = L
    path = root / "rigged"
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def write_problems(path: Path) -> Path:
    path.write_text("".join(json.dumps({"problem": p, "answer": a}) + "\n" for p, a, _ in PROBLEMS))
    return path


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    root = tmp_path_factory.mktemp("math500")
    return {"model": build_rigged(root), "problems": write_problems(root / "math500.jsonl"), "root": root}


def p_four(temperature: float) -> float:
    """P(\\boxed{4}) after a <q> problem: softmax over logits 8L and 8L - ln 1.5, each divided by T."""
    return 1.0 / (1.0 + 1.5 ** (-1.0 / temperature))


def _spec(rig, *extra):
    from hydra import compose, initialize_config_module

    from humanline_cli.config import resolve

    with initialize_config_module(config_module="conf", version_base="1.3"):
        return resolve(compose("train", overrides=[
            "task=custom", f"model.name_or_path={rig['model']}", "data.path=unused.jsonl", "judge=none",
            f"eval.math500.prompts={rig['problems']}", "eval.math500.n_samples=8", "eval.max_new_tokens=4",
            "train.max_length=64", "train.max_prompt_length=32", "chat_template=false", *extra]))


def test_accuracy_by_hand_greedy_and_sampled(rig, tmp_path, one_thread):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from humanline_cli.sampling.hf import HFSampler
    from humanline_cli.train.build import build_math500, make_encoder

    spec = _spec(rig)
    tok = AutoTokenizer.from_pretrained(rig["model"])
    model = AutoModelForCausalLM.from_pretrained(rig["model"]).eval()
    ev = build_math500(spec, make_encoder(spec, tok), seed=0)
    m = ev.evaluate(HFSampler(model, tok, 64), tmp_path / "samples.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]

    # greedy: \boxed{4} after every <q> problem, ` no idea` after <skip>: right exactly where the file says
    assert [r["greedy"] for r in rows] == [" no idea" if "<skip>" in p else "\\boxed{4}" for p, _, _ in PROBLEMS]
    assert m["greedy_accuracy"] == sum(ok for _, _, ok in PROBLEMS) / 8 == 0.5
    assert m["greedy_n_unparsed"] == 1 and m["n"] == 8 and m["n_samples"] == 8 and m["temperature"] == 0.7
    assert m["greedy_accuracy_se"] == pytest.approx(math.sqrt(0.25 * 8 / 7) / math.sqrt(8), abs=1e-12)

    # sampled: each sample is \boxed{4} or \boxed{7} (<q>) or ` no idea` (<skip>); correct by the reference value
    value = {"4": "4", "\\frac{8}{2}": "4", "4.0": "4", "7": "7", "2": "2"}
    fours = sevens = 0
    expected = []
    for (problem, answer, _), r in zip(PROBLEMS, rows):
        assert len(r["samples"]) == 8
        if "<skip>" in problem:
            assert set(r["samples"]) == {" no idea"} and r["parsed"] == [False] * 8
            expected.append(0.0)
            continue
        assert set(r["samples"]) <= {"\\boxed{4}", "\\boxed{7}"}
        ref = value.get(answer, "4")  # the whole solution's boxed value is 4
        k4 = r["samples"].count("\\boxed{4}")
        fours, sevens = fours + k4, sevens + 8 - k4
        expected.append((k4 if ref == "4" else 8 - k4 if ref == "7" else 0) / 8)
        assert r["correct"] == [float(s == f"\\boxed{{{ref}}}") for s in r["samples"]]
    assert m["sampled_accuracy"] == pytest.approx(sum(expected) / 8, abs=1e-12) == m["pass_at_1"]
    assert m["pass_at_n"] == sum(e > 0 for e in expected) / 8
    assert m["sampled_n_unparsed"] == 8 and m["n_unparsed"] == 9
    # the draws follow softmax(logits / 0.7): 56 draws, p = 0.641; 4 sd either side (sd 0.064), so T 0.7 is
    # used (T 0 would give every draw \boxed{4}) and the two answers are not tied
    p = p_four(0.7)
    assert abs(fours / 56 - p) < 4 * math.sqrt(p * (1 - p) / 56), (fours, sevens)


def test_train_writes_math500_into_summary_metrics_and_report(rig, tmp_path):
    """`humanline train ... eval.math500.prompts=FILE` (judge=none: the benchmark alone) -> summary.json's
    eval.math500 and a metrics.jsonl row; `humanline eval RUN eval.math500.*` recomputes it into summary.json and
    eval_math500.json; `humanline report` shows it."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": p, "chosen": "\\boxed{4}", "rejected": " no idea"}) + "\n"
                             for p, _, _ in PROBLEMS))
    run = tmp_path / "runs" / "r"
    common = ["eval.math500.n_samples=2", "eval.max_new_tokens=4", "chat_template=false", "judge=none"]
    r = run_cli(["train", "task=custom", f"model.name_or_path={rig['model']}", f"data.path={pairs}",
                 f"eval.math500.prompts={rig['problems']}", *common, "train.steps=1", "train.batch_size=2",
                 "train.lr=1e-9", "train.weight_decay=0.0", "train.max_length=64", "train.max_prompt_length=32",
                 "threads=1", f"hydra.run.dir={run}"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads((run / "summary.json").read_text())["eval"]["math500"]
    # lr 1e-9 moves no logit by anything near the margins (8L, ln 1.5): the greedy answers are the rig's
    assert m["greedy_accuracy"] == 0.5 and m["greedy_n_unparsed"] == 1 and m["n"] == 8 and m["n_samples"] == 2
    assert m["prompts"] == str(rig["problems"]) and m["sampled_n_unparsed"] == 2
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = [x for x in rows if "eval/math500/greedy_accuracy" in x]
    assert len(last) == 1 and last[0]["step"] == 1 and last[0]["eval/math500/greedy_accuracy"] == 0.5
    assert last[0]["eval/math500/sampled_accuracy"] == m["sampled_accuracy"]
    assert len((run / "math500_samples.jsonl").read_text().splitlines()) == 8

    # humanline eval, the first 4 problems (answers 4, 8/2, 7, 4.0), greedy only: right on 3 of 4, none unparsed
    r = run_cli(["eval", str(run), "eval.math500.n_prompts=4", "eval.math500.n_samples=0"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "math500 (4 problems from" in r.stdout and "greedy 0.750 (0 unparsed)" in r.stdout
    s = json.loads((run / "summary.json").read_text())
    assert s["eval"]["math500"]["greedy_accuracy"] == 0.75 and s["eval"]["math500"]["by"] == "humanline eval"
    assert s["eval"]["math500"]["sampled_accuracy"] is None and s["status"] == "complete"
    assert json.loads((run / "eval_math500.json").read_text())["math500"]["n"] == 4

    from humanline_cli.report.aggregate import build_report

    rep = build_report(tmp_path / "runs")
    assert rep.cells.math500_greedy_mean.tolist() == [0.75] and "MATH-500 greedy 0.750" in rep.markdown


@pytest.mark.parametrize("content,message", [
    ('{"problem": "What is 2+2? <q>", "answer": "4"}\n{"problem": "x", "answer": \n', ":2: malformed JSON"),
    ('{"problem": "What is 2+2? <q>", "answer": "4"}\n{"problem": "What is 3+4?"}\n',
     ":2: no field 'answer' (eval.math500.answer_column; the row has ['problem'])"),
    ('{"question": "What is 2+2?", "answer": "4"}\n', ":1: no field 'problem' (eval.math500.problem_column"),
    ('{"problem": "What is 2+2?", "answer": " "}\n', ":1: an empty field 'answer'"),
])
def test_bad_problem_file_is_one_line(rig, tmp_path, content, message):
    """A bad line or a missing column: one error naming the file and line, before any weights load."""
    from transformers import AutoTokenizer

    from humanline_cli.errors import UserError
    from humanline_cli.train.build import build_math500, make_encoder

    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    spec = _spec(rig, f"eval.math500.prompts={bad}")
    with pytest.raises(UserError) as e:
        build_math500(spec, make_encoder(spec, AutoTokenizer.from_pretrained(rig["model"])))
    assert str(e.value).startswith(f"{bad}{message}"), str(e.value)


def test_bad_problem_file_exits_2_through_the_cli(rig, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "What is 2+2? <q>", "answer": "4"}\n{"problem": "What is 3+4?"}\n')
    r = run_cli(["train", "task=custom", f"model.name_or_path={rig['model']}", "data.path=pairs.jsonl", "judge=none",
                 f"eval.math500.prompts={bad}", "train.max_length=64", "train.max_prompt_length=32",
                 "eval.max_new_tokens=4", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert r.returncode == 2
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("humanline: error:")]
    assert errors == [f"humanline: error: {bad}:2: no field 'answer' (eval.math500.answer_column; the row has "
                      f"['problem'])"], r.stderr[-2000:]


@pytest.mark.parametrize("overrides,message", [
    (["eval.math500.greedy=false", "eval.math500.n_samples=0"], "eval.math500.greedy=false with eval.math500.n_samples=0"),
    (["eval.math500.temperature=0"], "config key 'eval.math500.temperature' must be > 0"),
    (["eval.math500.template=Solve this"], "config key 'eval.math500.template' must contain {problem}"),
    (["eval.math500.n_samples=-1"], "config key 'eval.math500.n_samples' must be >= 0"),
])
def test_bad_math500_settings(rig, overrides, message):
    from humanline_cli.errors import UserError

    with pytest.raises(UserError) as e:
        _spec(rig, *overrides)
    assert str(e.value).startswith(message), str(e.value)


def test_paper_math_evaluates_math500():
    """experiment=paper_math: MATH-500 from the hub (never downloaded here), greedy and 4 samples at T 0.7."""
    from hydra import compose, initialize_config_module

    from humanline_cli.config import resolve

    with initialize_config_module(config_module="conf", version_base="1.3"):
        m = resolve(compose("train", overrides=["experiment=paper_math"])).eval_cfg.math500
    assert (m.prompts, m.split, m.problem_column, m.answer_column) == ("HuggingFaceH4/MATH-500", "test", "problem",
                                                                       "answer")
    assert m.greedy and m.n_samples == 4 and m.temperature == 0.7
