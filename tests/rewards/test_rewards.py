"""Labellers and judges: verifier (math-verify, exact), a tiny locally built reward model, the
world's scorers, and the checks that turn a broken reward into a clear error."""
from __future__ import annotations

import pytest
import torch

from humanline_cli.errors import RunFailed, UserError
from humanline_cli.rewards.reward_model import RewardModel
from humanline_cli.rewards.scorers import checked, make_scorer
from tests.helpers.models import build_remote_code_reward_model, build_tiny_reward_model


def test_math_verifier_values():
    _, score = make_scorer({"kind": "verifier", "method": "math"})
    got = score(["q"] * 4, ["so $\\boxed{0.5}$", "\\boxed{3}", "", "garbage {{"], ["\\frac{1}{2}", "4", "1", "2"])
    assert got == [1.0, 0.0, 0.0, 0.0]


def test_exact_verifier_and_missing_answers():
    _, score = make_scorer({"kind": "verifier", "method": "exact"})
    assert score(["q", "q"], [" 42 ", "41"], ["42", "42"]) == [1.0, 0.0]
    with pytest.raises(UserError, match="needs an 'answer' field"):
        score(["q"], ["1"], None)


def test_world_arithmetic_scorer_is_the_verifier():
    _, score = make_scorer({"kind": "world", "task": "arithmetic", "role": "judge"})
    assert score(["37+45="] * 4, ["82", "082", "81", ""]) == [1.0, 0.0, 0.0, 0.0]


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory):
    path = tmp_path_factory.mktemp("rm")
    model, tok = build_tiny_reward_model(path)
    return path, model, tok


def test_reward_model_scores_match_the_classifier_and_do_not_depend_on_batching(tiny_rm):
    path, model, tok = tiny_rm
    prompts, comps = ["12+34=", "1+1=", "99+1="], ["46", "2", "100 or so"]
    _, rm1 = make_scorer({"kind": "model", "name_or_path": str(path), "batch_size": 1})
    _, rm3 = make_scorer({"kind": "model", "name_or_path": str(path), "batch_size": 3})
    s1, s3 = rm1(prompts, comps), rm3(prompts, comps)
    assert s1 == pytest.approx(s3, abs=1e-5)
    text = tok.apply_chat_template([{"role": "user", "content": prompts[0]},
                                    {"role": "assistant", "content": comps[0]}], tokenize=False)
    ids = tok(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        direct = float(model(**ids).logits[0, 0])
    assert s1[0] == pytest.approx(direct, abs=1e-5)
    assert len(set(round(s, 6) for s in s1)) == 3  # different conversations, different scores


def test_reward_model_missing_path_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="cannot load reward model"):
        make_scorer({"kind": "model", "name_or_path": str(tmp_path / "nope")})


def test_checked_rejects_nan_and_wrong_counts():
    with pytest.raises(RunFailed, match="reward r returned a non-finite score"):
        checked("r", lambda p, c, a=None: [float("inf")], ["p"], ["c"])
    with pytest.raises(RunFailed, match="reward r returned 2 scores for 1 completions"):
        checked("r", lambda p, c, a=None: [1.0, 2.0], ["p"], ["c"])
    assert checked("r", lambda p, c, a=None: [1], ["p"], ["c"]) == [1.0]
    with pytest.raises(UserError, match="unknown reward kind"):
        make_scorer({"kind": "gpt"})


def _direct_scores(model, tok, prompts, comps):
    out = []
    for p, c in zip(prompts, comps):
        text = tok.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": c}],
                                       tokenize=False)
        with torch.no_grad():
            out.append(float(model(**tok(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0]))
    return out


def test_a_reward_model_whose_own_code_imports_a_name_transformers_5_dropped_loads(tmp_path, monkeypatch):
    # ArmoRM's modeling_custom.py imports LLAMA_INPUTS_DOCSTRING (gone in transformers 5): it loads and scores as the
    # same weights do in transformers' own class, and the estimate counts its bytes instead of dying in a traceback
    from humanline_cli.train import fit

    path = tmp_path / "gated_rm"
    model, tok = build_remote_code_reward_model(path)
    prompts, comps = ["12+34=", "1+1=", "99+1="], ["46", "2", "100 or so"]
    scores = RewardModel(str(path), batch_size=3, trust_remote_code=True)(prompts, comps)
    assert scores == pytest.approx(_direct_scores(model, tok, prompts, comps), abs=1e-5)
    monkeypatch.setattr(fit, "reward_models_on_rank", lambda spec, rank: {(str(path), True): ["task.labeller"]})
    assert fit._reward_bytes(None, 0) == 4 * sum(p.numel() for p in model.parameters())  # fp32 weights


def test_a_reward_models_own_code_that_does_not_import_is_one_line(tmp_path, monkeypatch):
    from humanline_cli.train import fit

    path = tmp_path / "broken_rm"
    build_remote_code_reward_model(path, extra_import="NO_SUCH_NAME")
    import transformers

    line = (f"cannot load reward model {path}: its own code (trust_remote_code) does not import under transformers "
            f"{transformers.__version__}: cannot import name 'NO_SUCH_NAME' from "
            f"'transformers.models.llama.modeling_llama'")
    with pytest.raises(UserError) as e:
        RewardModel(str(path), trust_remote_code=True)
    assert str(e.value).startswith(line)
    monkeypatch.setattr(fit, "reward_models_on_rank", lambda spec, rank: {(str(path), True): ["task.labeller"]})
    with pytest.raises(UserError) as e:  # the estimate, before any weight loads, says the same
        fit._reward_bytes(None, 0)
    assert str(e.value).startswith(line) and "\n" not in str(e.value)
