"""task=chat_arithmetic without a model: the generated prompt files (deterministic, train and eval disjoint, the
difficulty knobs, written atomically into the cache) and the verifier that reads the reply's last number."""
from __future__ import annotations

import json
from fractions import Fraction

import pytest

from humanline_cli.errors import UserError
from humanline_cli.rewards.verifier import final_number, verify_batch
from humanline_cli.world import chat_arithmetic, generated

CFG = {"kind": "chat_arithmetic", "digits": 2, "op": "add", "n_train": 300, "n_eval": 50, "seed": 0}


def test_final_number_reads_the_last_number():
    assert final_number("To add 27 and 82: 27 + 82 = 109.") == 109
    assert final_number("The sum is 1,234.") == 1234
    assert final_number("82 - 90 = -8") == -8
    assert final_number("about 3.50") == Fraction(7, 2)
    assert final_number("no digits here") is None
    assert final_number("109 is the sum of 27 and 82") == 82  # the last number, whatever the prose says
    assert verify_batch(["27 + 82 = 109.", "= 109.0", "108", "", "109<|im_end|>"], ["109"] * 5,
                        "final_number") == [1.0, 1.0, 0.0, 0.0, 1.0]


def test_generated_prompts_are_deterministic_disjoint_and_correct():
    train, eval_ = chat_arithmetic.generate(CFG)
    assert (len(train), len(eval_)) == (300, 50)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in eval_}
    assert chat_arithmetic.generate(CFG) == (train, eval_)
    for r in train + eval_:
        a, op, b = r["prompt"].removeprefix("What is ").removesuffix("?").split()
        assert op == "+" and 10 <= int(a) <= 99 and 10 <= int(b) <= 99 and int(r["answer"]) == int(a) + int(b)
    mixed, _ = chat_arithmetic.generate({**CFG, "digits": 3, "op": "mixed"})
    ops = {r["prompt"].split()[3] for r in mixed}
    assert ops == {"+", "-", "*"}
    for r in mixed:
        a, op, b = r["prompt"].removeprefix("What is ").removesuffix("?").split()
        assert 100 <= int(a) <= 999 and 100 <= int(b) <= 999
        assert int(r["answer"]) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert int(r["answer"]) >= 0  # sub puts the larger operand first


def test_materialise_writes_once_and_names_by_the_knobs(tmp_path):
    d = generated.materialise(CFG, tmp_path)
    assert d == generated.task_dir(CFG, tmp_path) and d.name.startswith("chat_arithmetic-")
    rows = [json.loads(x) for x in (d / "prompts_eval.jsonl").read_text().splitlines()]
    assert rows == chat_arithmetic.generate(CFG)[1]
    assert generated.materialise(CFG, tmp_path) == d
    assert generated.task_dir({**CFG, "digits": 3}, tmp_path) != d
    assert [p.name for p in tmp_path.iterdir()] == [d.name]  # no temporary left behind


@pytest.mark.parametrize("bad, key", [({"op": "div"}, "op"), ({"digits": 0}, "digits"),
                                      ({"digits": 1, "n_train": 100}, "do not fit")])
def test_bad_knobs_are_one_line(bad, key):
    with pytest.raises(UserError) as e:
        chat_arithmetic.check({**CFG, **bad})
    assert key in str(e.value) and "\n" not in str(e.value)


def test_instruction_follows_each_question_and_keeps_the_problems(tmp_path):
    train, eval_ = chat_arithmetic.generate(CFG)
    said = {**CFG, "instruction": "Answer with the number only."}
    train_i, eval_i = chat_arithmetic.generate(said)
    assert [r["prompt"] for r in train_i] == [r["prompt"] + " Answer with the number only." for r in train]
    assert [r["answer"] for r in eval_i] == [r["answer"] for r in eval_]
    # a task without an instruction keeps its folder; one with an instruction gets its own
    assert generated.task_dir({**CFG, "instruction": ""}, tmp_path) == generated.task_dir(CFG, tmp_path)
    assert generated.task_dir(said, tmp_path) != generated.task_dir(CFG, tmp_path)


# the SmolLM2 fair study's setting: two-digit +- one-digit, 900 problems per operation, 1,800 in all
ROOM = {**CFG, "digits": 2, "digits_b": 1, "op": "add_sub", "n_train": 480, "n_eval": 400,
        "instruction": "Answer with the number only."}


def test_two_digit_plus_minus_one_digit_has_room_for_400_eval_prompts(tmp_path):
    train, eval_ = chat_arithmetic.generate(ROOM)
    assert (len(train), len(eval_)) == (480, 400)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in eval_}
    assert len({r["prompt"] for r in train + eval_}) == 880
    seen = set()
    for r in train + eval_:
        a, op, b = r["prompt"].removeprefix("What is ").removesuffix("? Answer with the number only.").split()
        assert 10 <= int(a) <= 99 and 0 <= int(b) <= 9  # a - b >= 1 whatever b: no swap needed
        assert int(r["answer"]) == {"+": int(a) + int(b), "-": int(a) - int(b)}[op]
        seen.add(op)
    assert seen == {"+", "-"}
    # 90 x 10 first and second operands, 2 operations: 1,800 problems, at most 90% (1,620) drawn
    chat_arithmetic.check({**ROOM, "n_train": 1220, "n_eval": 400})
    with pytest.raises(UserError, match="1800 distinct"):
        chat_arithmetic.check({**ROOM, "n_train": 1221, "n_eval": 400})
    # unset, the second operand's digits are the first's and the folder keeps its name
    assert generated.task_dir({**CFG, "digits_b": None}, tmp_path) == generated.task_dir(CFG, tmp_path)
    assert generated.task_dir(ROOM, tmp_path) != generated.task_dir({**ROOM, "digits_b": None}, tmp_path)
    with pytest.raises(UserError, match="digits_b"):
        chat_arithmetic.check({**ROOM, "digits_b": 0})


def test_no_carry_pool_keeps_the_ones_column_within_ten():
    """carry=false: 47 + 2 and 47 - 5, never 47 + 5 or 41 - 5. Per ones digit u of the first operand, u + b < 10
    leaves 10 - u values of b and b <= u leaves u + 1: 55 of 100 per operation, 9 x 55 x 2 = 990 problems."""
    cfg = {**ROOM, "carry": False}
    train, eval_ = chat_arithmetic.generate(cfg)
    assert (len(train), len(eval_)) == (480, 400)
    for r in train + eval_:
        a, op, b = r["prompt"].removeprefix("What is ").removesuffix("? Answer with the number only.").split()
        a, b = int(a), int(b)
        assert (a % 10 + b < 10) if op == "+" else (b <= a % 10), r["prompt"]
        assert int(r["answer"]) == (a + b if op == "+" else a - b)
    chat_arithmetic.check({**cfg, "n_train": 491, "n_eval": 400})  # 891 = 90% of 990
    with pytest.raises(UserError, match="990 distinct"):
        chat_arithmetic.check({**cfg, "n_train": 492, "n_eval": 400})
    with pytest.raises(UserError, match="carry"):
        chat_arithmetic.check({**cfg, "op": "mixed"})
    # carry=true (the default) keeps the pool's folder and problems
    assert chat_arithmetic.generate({**ROOM, "carry": True}) == chat_arithmetic.generate(ROOM)
