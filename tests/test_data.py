"""Data loading (JSONL / Parquet / save_to_disk), format detection, conversions and bad input."""
from __future__ import annotations

import json

import datasets
import pytest
import torch

from humanline_cli.data.collate import Collator, Encoder
from humanline_cli.data.examples import BinaryExample, GroupExample, PairExample, to_units
from humanline_cli.data.files import load_rows
from humanline_cli.errors import UserError
from humanline_cli.world.tokenizer import build_tokenizer


def _msgs(role, text):
    return [{"role": role, "content": text}]


PAIR = {"prompt": _msgs("user", "12+34="), "chosen": _msgs("assistant", "46"),
        "rejected": _msgs("assistant", "47"), "score_chosen": 1.0, "score_rejected": 0.0}


def _write_jsonl(path, rows, raw_lines=()):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        for line in raw_lines:
            f.write(line + "\n")
    return path


class _Obj:
    std_ddof, std_eps = 0, 0.01


@pytest.fixture(scope="module")
def encoder():
    return Encoder(build_tokenizer(), max_prompt_length=16, max_length=24)


def test_jsonl_parquet_and_disk_load_the_same_rows(tmp_path):
    rows = [PAIR, {**PAIR, "prompt": _msgs("user", "01+02=")}]
    a, where = load_rows(str(_write_jsonl(tmp_path / "d.jsonl", rows)))
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "disk"))
    b, _ = load_rows(str(tmp_path / "d.parquet"))
    c, _ = load_rows(str(tmp_path / "disk"))
    assert a == b == c == rows
    assert where(1) == f"{tmp_path / 'd.jsonl'}:2"


def test_pairs_convert_to_each_objective_as_in_the_paper():
    rows = [PAIR]
    where = lambda i: f"f:{i + 1}"  # noqa: E731
    (dpo,) = to_units(rows, where, "dpo")
    assert dpo == PairExample(PAIR["prompt"], PAIR["chosen"], PAIR["rejected"])
    kto = to_units(rows, where, "kto")  # one desirable + one undesirable example per pair
    assert [(u.completion, u.desirable) for u in kto] == [(PAIR["chosen"], True), (PAIR["rejected"], False)]
    (grpo,) = to_units(rows, where, "grpo")  # a scored pair is a group of 2
    assert grpo == GroupExample(PAIR["prompt"], [PAIR["chosen"], PAIR["rejected"]], [1.0, 0.0])


def test_groups_feed_dpo_by_best_vs_worst_with_gap_threshold():
    g = {"prompt": "p", "completions": ["a", "b", "c"], "rewards": [0.2, 0.9, 0.5]}
    tiny = {"prompt": "q", "completions": ["a", "b"], "rewards": [0.5, 0.505]}
    units = to_units([g, tiny], lambda i: str(i), "dpo", min_gap=0.01)
    assert units == [PairExample("p", "b", "a")]  # the q group's gap 0.005 <= 0.01 is dropped


def test_unpaired_only_feeds_kto(tmp_path):
    rows = [{"prompt": "p", "completion": "a", "label": True}]
    assert to_units(rows, str, "kto") == [BinaryExample("p", "a", True)]
    with pytest.raises(UserError, match="needs paired or grouped"):
        to_units(rows, str, "dpo")


def test_collate_pairs_masks_completion_and_eos(encoder):
    batch = Collator(encoder, _Obj())([PairExample(PAIR["prompt"], PAIR["chosen"], PAIR["rejected"])])
    s = batch.seqs
    tok = encoder.tok
    # <bos><|user|>12+34=<|assistant|> is 9 tokens, then '4','6',<eos>
    assert s.input_ids.shape == (2, 12)
    assert s.loss_mask[0].tolist() == [False] * 9 + [True] * 3
    assert tok.decode(s.input_ids[0, 9:11]) == "46" and s.input_ids[0, 11] == tok.eos_token_id
    assert tok.decode(s.input_ids[1, 9:11]) == "47"


def test_collate_kto_builds_mismatched_kl_pairs(encoder):
    units = [BinaryExample(_msgs("user", "1+1="), _msgs("assistant", "2"), True),
             BinaryExample(_msgs("user", "2+2="), _msgs("assistant", "44"), False)]
    b = Collator(encoder, _Obj())(units)
    assert b.labels.tolist() == [True, False]
    kl0 = encoder.tok.decode(b.kl_seqs.input_ids[0][b.kl_seqs.loss_mask[0]], skip_special_tokens=True)
    assert kl0 == "44"  # prompt 0 with completion 1


def test_collate_group_advantages(encoder):
    g = GroupExample("1+1=", ["2", "3", "2", "3"], [1.0, 0.0, 1.0, 0.0])
    b = Collator(encoder, _Obj())([g])
    assert torch.allclose(b.advantages, torch.tensor([1, -1, 1, -1]) * 0.5 / 0.51)


@pytest.mark.parametrize("content,needle", [
    (['{"prompt": "a", "chosen": "b", "rejected": "c"}', '{"prompt": "a", "chosen": '], ":2: malformed JSON"),
    (['[1, 2]'], ":1: expected a JSON object"),
    ([], "is empty"),
])
def test_malformed_jsonl_names_file_and_line(tmp_path, content, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(content) + ("\n" if content else ""))
    with pytest.raises(UserError) as e:
        load_rows(str(path))
    assert needle in str(e.value) and str(path) in str(e.value)


@pytest.mark.parametrize("rows,needle", [
    ([{"prompt": "a", "chosen": "b"}], "match no known format"),
    ([PAIR, {**PAIR, "chosen": 5}], ":2: field 'chosen' must be a string"),
    ([PAIR, {**PAIR, "score_chosen": "high"}], ":2: field 'score_chosen' must be a finite number"),
    ([{"prompt": "p", "completion": "a", "label": "yes"}], ":1: field 'label' must be true/false"),
    ([{"prompt": "p", "completions": ["a"], "rewards": [1, 2]}], ":1: 'completions' and 'rewards'"),
    ([{**PAIR, "chosen": _msgs("user", "x")}], "must end with a 'assistant' message"),
])
def test_bad_records_name_file_and_line(tmp_path, rows, needle):
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    loaded, where = load_rows(str(path))
    with pytest.raises(UserError) as e:
        to_units(loaded, where, "kto")
    assert needle in str(e.value)


def test_too_long_prompt_is_rejected(encoder):
    with pytest.raises(UserError, match="d.jsonl:3: prompt has 18 tokens, more than train.max_prompt_length=16"):
        encoder.prompt_ids(_msgs("user", "1" * 15), "d.jsonl:3")  # 15 chars + bos, user, assistant


def test_missing_local_file(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_rows(str(tmp_path / "nope.jsonl"))
