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


# ---- valid data the loader used to refuse or mangle ----------------------------------------------

def test_csv_cells_stay_text_and_only_format_fields_are_typed(tmp_path):
    path = tmp_path / "d.csv"
    # a BOM (Excel), numeric answers, a quoted comma, a quoted newline, a blank line, one empty score cell
    path.write_bytes("\ufeffprompt,chosen,rejected,score_chosen,score_rejected\n"
                     '12+45=,57,58,1,0.25\n"a, b",007,"x\ny",,\n\n1+1=,2,3,2e0,-1\n'.encode("utf-8"))
    rows, where = load_rows(str(path))
    assert rows == [
        {"prompt": "12+45=", "chosen": "57", "rejected": "58", "score_chosen": 1.0, "score_rejected": 0.25},
        {"prompt": "a, b", "chosen": "007", "rejected": "x\ny", "score_chosen": None, "score_rejected": None},
        {"prompt": "1+1=", "chosen": "2", "rejected": "3", "score_chosen": 2.0, "score_rejected": -1.0},
    ]
    assert [where(i) for i in range(3)] == [f"{path}:2", f"{path}:3", f"{path}:6"]  # the record's first line
    assert to_units(rows, where, "dpo")[0] == PairExample("12+45=", "57", "58")
    (g1, g2, g3) = to_units(rows, where, "grpo")
    assert g1.rewards == [1.0, 0.25] and g2.rewards == [1.0, 0.0] and g3.rewards == [2.0, -1.0]


def test_csv_unpaired_labels_and_prompt_answers(tmp_path):
    path = tmp_path / "u.csv"
    path.write_text("prompt,completion,label\n1+1=,2,true\n1+1=,3,FALSE\n2+2=,4,1\n2+2=,5, 0\n")
    rows, where = load_rows(str(path))
    assert [(r["completion"], r["label"]) for r in rows] == [("2", True), ("3", False), ("4", True), ("5", False)]
    assert to_units(rows, where, "kto")[3] == BinaryExample("2+2=", "5", False)
    prompts = tmp_path / "p.csv"
    prompts.write_text("question,answer\n12+45=,57\n3*3=,09\n")
    rows, _ = load_rows(str(prompts), columns={"question": "prompt"})
    assert rows == [{"prompt": "12+45=", "answer": "57"}, {"prompt": "3*3=", "answer": "09"}]


def test_csv_label_is_typed_after_renaming(tmp_path):
    path = tmp_path / "u.csv"
    path.write_text("q,a,good\nx,y,1\n")
    rows, _ = load_rows(str(path), columns={"q": "prompt", "a": "completion", "good": "label"})
    assert rows == [{"prompt": "x", "completion": "y", "label": True}]


def test_jsonl_may_mix_string_and_chat_rows(tmp_path):
    chat = {"prompt": _msgs("user", "1+1="), "chosen": _msgs("assistant", "2"), "rejected": _msgs("assistant", "3")}
    plain = {"prompt": "1+1=", "chosen": "2", "rejected": "3"}
    half = {"prompt": "1+1=", "chosen": _msgs("assistant", "2"), "rejected": "3"}
    rows, where = load_rows(str(_write_jsonl(tmp_path / "d.jsonl", [chat, plain, half])))
    assert rows == [chat, plain, half]
    units = to_units(rows, where, "dpo")
    assert [type(u.prompt) for u in units] == [list, str, str]
    # with a chat template, a string prompt becomes a user message: all three rows encode identically
    enc = Encoder(build_tokenizer(), max_prompt_length=16, max_length=24, wrap_strings=True)
    batch = Collator(enc, _Obj())(units)
    ids = batch.seqs.input_ids
    assert ids[0].tolist() == ids[1].tolist() == ids[2].tolist()
    assert enc.tok.decode(ids[0][batch.seqs.loss_mask[0]]) == "2<|eos|>"


def test_json_arrays_columns_and_lines_load_the_same_rows(tmp_path):
    rows = [PAIR, {"prompt": "1+1=", "chosen": "2", "rejected": "3"}]
    array = tmp_path / "a.json"
    array.write_text(json.dumps(rows, indent=2))
    lines = tmp_path / "l.json"
    lines.write_text("".join(json.dumps(r) + "\n" for r in rows))
    columns = tmp_path / "c.json"
    columns.write_text(json.dumps({"prompt": ["p", "q"], "chosen": ["1", "2"], "rejected": ["3", "4"]}, indent=1))
    a, wa = load_rows(str(array))
    b, wb = load_rows(str(lines))
    c, wc = load_rows(str(columns))
    assert a == b == rows
    second = array.read_text().splitlines().index("  {", 2) + 1  # the line the second object opens on
    assert (wa(0), wa(1)) == (f"{array}:2", f"{array}:{second}") and second > 2
    assert wb(1) == f"{lines}:2"
    assert c == [{"prompt": "p", "chosen": "1", "rejected": "3"}, {"prompt": "q", "chosen": "2", "rejected": "4"}]
    assert wc(1) == f"{columns} row 2"


def test_limit_stops_reading_before_later_lines(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [PAIR, PAIR], raw_lines=["{not json"])
    rows, _ = load_rows(str(path), limit=2)
    assert rows == [PAIR, PAIR]
    with pytest.raises(UserError, match=":3: malformed JSON"):
        load_rows(str(path))
