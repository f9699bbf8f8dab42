"""Bad data gets one line naming the file, the line and the problem: wrong types blamed on their own
line, CSV cells, characters the tokenizer cannot encode, and a zero row limit blamed on its key."""
from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from humanline_cli.data.collate import Encoder
from humanline_cli.data.examples import to_units
from humanline_cli.data.files import load_rows
from humanline_cli.errors import UserError
from humanline_cli.world.tokenizer import build_tokenizer
from tests.helpers.cli import FAST, TINY_WORLD, run_cli

ROW = {"prompt": "1+1=", "chosen": "2", "rejected": "3"}


def _jsonl(path, lines: list[str]):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises(UserError) as e:
        fn(*args, **kwargs)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


# ---- types blamed on the right line -----------------------------------------------------------------

def test_number_among_strings_is_blamed_on_its_own_line(tmp_path):
    lines = [json.dumps(ROW)] * 5 + [""] + [json.dumps({**ROW, "chosen": 25})] + [json.dumps(ROW)]
    path = _jsonl(tmp_path / "d.jsonl", lines)  # line 6 is blank, so the bad record is line 7
    rows, where = load_rows(str(path))
    assert len(rows) == 7 and rows[5]["chosen"] == 25
    msg = _error(to_units, rows, where, "dpo")
    assert msg == (f"{path}:7: field 'chosen' must be a string or a list of {{role, content}} messages, "
                   f"got int 25")


def test_json_array_element_is_blamed_on_the_line_it_opens(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([ROW, ROW, {**ROW, "rejected": {"x": 1}}], indent=2))
    third = [i for i, line in enumerate(path.read_text().splitlines(), 1) if line == "  {"][2]
    rows, where = load_rows(str(path))
    assert _error(to_units, rows, where, "kto").startswith(f"{path}:{third}: field 'rejected' must be a string")
    bad = tmp_path / "bad.json"
    bad.write_text('[\n  {"prompt": "a",\n   "chosen": }\n]\n')
    assert _error(load_rows, str(bad)) == f"{bad}:3: malformed JSON (Expecting value at column 14)"


def test_a_duplicate_key_is_refused_with_its_file_line_and_key(tmp_path):
    """json keeps the last of two values silently (pyarrow, under `datasets`, refuses the row): which one the
    user meant is not ours to guess, in a row or in a chat message, in JSON Lines, a JSON array or columns."""
    lines = [json.dumps(ROW), '{"prompt": "1+1=", "chosen": "2", "rejected": "3", "chosen": "4"}']
    path = _jsonl(tmp_path / "d.jsonl", lines)
    assert _error(load_rows, str(path)) == f"{path}:2: duplicate key 'chosen' in a JSON object (which value is meant?)"
    chat = _jsonl(tmp_path / "chat.jsonl", [json.dumps(ROW), json.dumps(ROW),
                                            '{"prompt": [{"role": "user", "content": "a", "content": "b"}], '
                                            '"chosen": "2", "rejected": "3"}'])
    assert _error(load_rows, str(chat)).startswith(f"{chat}:3: duplicate key 'content'")
    array = tmp_path / "d.json"
    array.write_text('[\n  {"prompt": "a", "chosen": "b", "rejected": "c"},\n  {"prompt": "a",\n   "chosen": "b",'
                     '\n   "rejected": "c", "prompt": "z"}\n]\n')
    assert _error(load_rows, str(array)).startswith(f"{array}:3: duplicate key 'prompt'")  # the element's line
    columns = tmp_path / "c.json"
    columns.write_text('{"prompt": ["a"],\n "chosen": ["b"],\n "rejected": ["c"],\n "chosen": ["d"]}')
    assert _error(load_rows, str(columns)).startswith(f"{columns}:4: duplicate key 'chosen'")


def test_not_utf8_names_the_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(json.dumps(ROW).encode() + b"\n" + b'{"prompt": "\xff"}\n')
    assert _error(load_rows, str(path)) == f"{path}:2: not UTF-8 text (byte 13 of the line)"


@pytest.mark.parametrize("text,needle", [
    ("prompt,completion,label\na,b,true\na,c,yes\n", ":3: field 'label' must be true/false/1/0, got 'yes'"),
    ("prompt,chosen,rejected,score_chosen,score_rejected\na,b,c,1,0\na,b,c,high,0\n",
     ":3: field 'score_chosen' must be a number, got 'high'"),
    ('prompt,chosen,rejected\n"multi\nline",b,c\na,b\n', ":4: 2 cells, but the header has 3 columns"),
    ("prompt,chosen,prompt\na,b,c\n", ":1: duplicate column(s) ['prompt'] in the CSV header"),
    ("prompt,completions,rewards\na,b,1\n", "column 'completions': CSV cells hold text, not lists"),
    ('prompt,chosen,rejected\na,b,c\n"[{""role"": ""user"", ""content"": ""1+1=""}]",2,3\n',
     ":3: field 'prompt' holds a list of chat messages, but CSV cells are text (the cell would be trained as its "
     "JSON); chat data needs JSONL, JSON or Parquet"),
    ("prompt,chosen,rejected\n", "is empty"),
    ("", "is empty"),
])
def test_bad_csv_names_file_and_line(tmp_path, text, needle):
    path = tmp_path / "d.csv"
    path.write_text(text)
    msg = _error(load_rows, str(path))
    assert needle in msg and str(path) in msg


def test_empty_json_file(tmp_path):
    empty = tmp_path / "e.json"
    empty.write_text("\n")
    assert _error(load_rows, str(empty)) == f"data {str(empty)!r} is empty"


def test_zero_limit_names_the_key_not_the_file(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [json.dumps({"prompt": "1+1="})])
    msg = _error(load_rows, str(path), "train", 0, None, limit_key="eval.n_prompts")
    assert msg.startswith("eval.n_prompts must be at least 1, got 0") and "empty" not in msg
    assert _error(load_rows, str(path), limit=-3).startswith("limit must be at least 1, got -3")
    assert load_rows(str(path), limit=1, limit_key="eval.n_prompts")[0] == [{"prompt": "1+1="}]


# ---- characters the tokenizer cannot encode ---------------------------------------------------------

class _Counting:
    """Delegates to a tokenizer, counting direct encode calls (to show the check stays cheap)."""

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def __call__(self, text, **kw):
        self.calls.append(text)
        return self.tok(text, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_world_tokenizer_unknown_characters_are_named(tmp_path):
    enc = Encoder(build_tokenizer(), max_prompt_length=16, max_length=24)
    assert _error(enc.prompt_ids, "Hi 1+1=", "d.jsonl:4") == (
        "d.jsonl:4: prompt has character(s) the tokenizer cannot encode: 'H' (U+0048)")
    chat = [{"role": "user", "content": "what is 1+1? 😀"}]
    assert _error(enc.prompt_ids, chat, "d.jsonl:5") == (
        "d.jsonl:5: prompt (user message) has character(s) the tokenizer cannot encode: '😀' (U+1F600)")
    assert _error(enc.completion_ids, "1+1=", "Two é", "d.jsonl:6", "chosen") == (
        "d.jsonl:6: chosen has character(s) the tokenizer cannot encode: 'T' (U+0054), 'é' (U+00E9)")
    # '?' is in the vocabulary: 5 specials, 10 digits, '+=-*', 26 letters, then ' .,:;?!'
    assert enc.completion_ids("1+1=", "two?", "d.jsonl:7") == [5 + 14 + 19, 5 + 14 + 22, 5 + 14 + 14, 50, 2]
    wrapped = Encoder(build_tokenizer(), 16, 24, wrap_strings=True)  # a string prompt becomes a user message
    assert _error(wrapped.prompt_ids, "ok ÷", "d.jsonl:8") == (
        "d.jsonl:8: prompt has character(s) the tokenizer cannot encode: '÷' (U+00F7)")


def test_check_completions_names_row_and_field(tmp_path):
    enc = Encoder(build_tokenizer(), max_prompt_length=16, max_length=24)
    rows = [ROW, {"prompt": "2+2=", "completions": ["4", "Four"], "rewards": [1.0, 0.0]},
            {"prompt": "p", "completion": "q", "label": True}]
    where = lambda i: f"d.jsonl:{i + 1}"  # noqa: E731
    assert _error(enc.check_completions, rows, where) == (
        "d.jsonl:2: completions[1] has character(s) the tokenizer cannot encode: 'F' (U+0046)")
    rows[1] = {**ROW, "rejected": [{"role": "assistant", "content": "Nope"}]}
    assert _error(enc.check_completions, rows, where) == (
        "d.jsonl:2: rejected has character(s) the tokenizer cannot encode: 'N' (U+004E)")
    rows[1] = ROW
    ok = enc.check_completions(rows, where)  # returns the truncation count once every text encodes
    assert (ok.n, ok.cut) == (5, 0)
    assert _error(enc.check_prompts, [{"prompt": 5}], where) == (
        "d.jsonl:1: field 'prompt' must be a string or a list of {role, content} messages, got int 5")


def test_unknown_character_check_is_cheap_and_cached():
    tok = _Counting(build_tokenizer())
    enc = Encoder(tok, max_prompt_length=16, max_length=64)
    for i in range(50):
        enc.completion_ids("1+1=", f"answer {i}")
    assert len(tok.calls) == 51  # the prompt once (cached), each completion once: no per-character probing
    tok.calls.clear()
    _error(enc.completion_ids, "1+1=", "BAB")
    assert sorted(tok.calls) == ["A", "B", "BAB"]  # the failing text, then each distinct character once
    tok.calls.clear()
    _error(enc.completion_ids, "1+1=", "ABBA")
    assert tok.calls == ["ABBA"]  # verdicts on 'A' and 'B' are cached
    tok.calls.clear()
    rows = [{"prompt": "1+1=", "chosen": f"{i}", "rejected": f"{i + 1}"} for i in range(3000)]
    enc.check_completions(rows, lambda i: f"d:{i + 1}")
    assert [len(c) for c in tok.calls] == [1024] * 5 + [6000 - 5 * 1024]  # 6000 texts in 6 batched calls
    tok.calls.clear()
    rows[2500]["rejected"] = "NO"  # text 2 * 2500 + 1 = 5001: the 906th of the fifth batch (5001 - 4 * 1024 = 905)
    assert _error(enc.check_completions, rows, lambda i: f"d:{i + 1}") == (
        "d:2501: rejected has character(s) the tokenizer cannot encode: 'N' (U+004E), 'O' (U+004F)")
    # 5 batches (the last raises), its texts one by one up to the culprit, then 'N' and 'O' alone
    assert [len(c) for c in tok.calls[:5]] == [1024] * 5 and len(tok.calls) == 5 + 906 + 2
    assert tok.calls[5 + 905] == "NO" and sorted(tok.calls[-2:]) == ["N", "O"]


def _byte_level(special: list[str]) -> PreTrainedTokenizerFast:
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(["hello world"] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=core)


def test_byte_level_bpe_encodes_everything():
    tok = PreTrainedTokenizerFast(tokenizer_object=_byte_level([]).backend_tokenizer, eos_token=None)
    enc = Encoder(tok, max_prompt_length=64, max_length=128)
    text = "Héllo 😀 ÷ ?"
    assert tok.decode(enc.prompt_ids(text, "x")) == text
    # GPT-2 style: the unknown token is also end-of-text, and spelling it in the data is not an unknown character
    gpt2 = _byte_level(["<|endoftext|>"])
    gpt2.add_special_tokens({"unk_token": "<|endoftext|>", "eos_token": "<|endoftext|>"})
    enc = Encoder(gpt2, max_prompt_length=64, max_length=128)
    ids = enc.completion_ids("Q", "A 😀<|endoftext|>", "x")
    assert gpt2.decode(ids) == "A 😀<|endoftext|><|endoftext|>"


def test_tokenizer_with_an_unk_token_is_checked():
    vocab = {"[UNK]": 0, "[EOS]": 1, **{c: i + 2 for i, c in enumerate("abc ")}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", eos_token="[EOS]")
    enc = Encoder(tok, max_prompt_length=16, max_length=32)
    assert enc.completion_ids("ab", "cab", "x") == [4, 2, 3, 1]
    assert _error(enc.completion_ids, "ab", "cab d", "f.csv:9", "completion") == (
        "f.csv:9: completion has character(s) the tokenizer cannot encode: 'd' (U+0064)")


# ---- through the CLI ----------------------------------------------------------------------------------

def _train(tmp_path, *args):
    return run_cli(["train", *TINY_WORLD, *FAST, *args, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)


def _one_line_exit_2(r, needle: str, tmp_path):
    assert r.returncode == 2, r.stderr[-2000:]
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "run" / "summary.json").exists()


def test_cli_blames_the_wrong_type_on_line_7(tmp_path, cache_dir):
    lines = [json.dumps(ROW)] * 6 + [json.dumps({**ROW, "chosen": 25})]
    data = _jsonl(tmp_path / "prefs.jsonl", lines)
    _one_line_exit_2(_train(tmp_path, f"data.path={data}"), f"{data}:7: field 'chosen' must be a string", tmp_path)


def test_cli_names_the_unknown_character_in_a_prompt(tmp_path, cache_dir):
    data = _jsonl(tmp_path / "prefs.jsonl", [json.dumps(ROW), json.dumps({**ROW, "prompt": "What is 1+1="})])
    _one_line_exit_2(_train(tmp_path, f"data.path={data}"),
                     f"{data}:2: prompt has character(s) the tokenizer cannot encode: 'W' (U+0057)", tmp_path)


def test_cli_trains_on_csv_with_numeric_answers_and_mixed_jsonl(tmp_path, cache_dir):
    csv_path = tmp_path / "prefs.csv"
    csv_path.write_text("prompt,chosen,rejected\n" + "".join(f"{a}+{b}=,{a + b},{a + b + 1}\n"
                                                             for a in range(10, 14) for b in range(20, 22)))
    r = _train(tmp_path, f"data.path={csv_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "complete"
    chat = {"prompt": [{"role": "user", "content": "1+2="}], "chosen": [{"role": "assistant", "content": "3"}],
            "rejected": [{"role": "assistant", "content": "4"}]}
    mixed = _jsonl(tmp_path / "mixed.jsonl", [json.dumps(ROW), json.dumps(chat)] * 4)
    r = run_cli(["train", *TINY_WORLD, *FAST, "objective=kto", f"data.path={mixed}",
                 f"hydra.run.dir={tmp_path / 'run2'}"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((tmp_path / "run2" / "summary.json").read_text())["status"] == "complete"



def test_cli_names_the_unknown_character_in_a_completion(tmp_path, cache_dir):
    data = _jsonl(tmp_path / "prefs.jsonl", [json.dumps(ROW)] * 3 + [json.dumps({**ROW, "rejected": "Three"})])
    _one_line_exit_2(_train(tmp_path, f"data.path={data}"),
                     f"{data}:4: rejected has character(s) the tokenizer cannot encode: 'T' (U+0054)", tmp_path)


def test_cli_zero_eval_prompts_names_the_key_not_the_file(tmp_path, cache_dir):
    r = _train(tmp_path, "eval.n_prompts=0")
    _one_line_exit_2(r, "eval.n_prompts", tmp_path)
    assert "empty" not in r.stderr and "0" in r.stderr


def test_cli_refuses_a_chat_prompt_with_an_unknown_role_offline(tmp_path, cache_dir):
    wizard = {**ROW, "prompt": [{"role": "wizard", "content": "1+2="}]}
    data = _jsonl(tmp_path / "prefs.jsonl", [json.dumps(ROW), json.dumps(wizard)])
    _one_line_exit_2(_train(tmp_path, f"data.path={data}"), f"humanline: error: {data}:2: field 'prompt' has a "
                     "message with role 'wizard' (roles: system, user, assistant, tool)", tmp_path)


def test_cli_refuses_a_chat_prompt_without_a_user_message_online(tmp_path, cache_dir):
    rows = [{"prompt": [{"role": "user", "content": "1+2="}]}] * 2 + [{"prompt": [{"role": "system", "content": "1+2="}]}]
    prompts = _jsonl(tmp_path / "prompts.jsonl", [json.dumps(r) for r in rows])
    r = _train(tmp_path, "data=online", f"task.prompts.train={prompts}")
    _one_line_exit_2(r, f"humanline: error: {prompts}:3: field 'prompt' has no 'user' message", tmp_path)
