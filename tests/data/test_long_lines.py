"""A huge line in a data file (the fault: one 50 MB completion took minutes to load, silently). Reading the file is
a streamed parse; tokenising such a text is what costs, so it happens once, behind a progress bar, and collation
and length bucketing reuse its count and cut ids. A 300k-character line stands in for the 50 MB one."""
from __future__ import annotations

import json

from humanline_cli.data import collate as C
from humanline_cli.data.collate import Collator, Encoder
from humanline_cli.data.examples import to_units
from humanline_cli.data.files import load_rows
from humanline_cli.world.tokenizer import build_tokenizer


class CountingTokenizer:
    """Unit-test helper: the real tokenizer, counting the calls that tokenise a long text."""

    def __init__(self, tok):
        self._tok, self.long_calls = tok, 0

    def __call__(self, text, *a, **k):
        texts = text if isinstance(text, list) else [text]
        self.long_calls += sum(len(t) >= C.LONG_TEXT_CHARS for t in texts)
        return self._tok(text, *a, **k)

    def __getattr__(self, name):
        return getattr(self._tok, name)


class _Obj:
    beta = 0.1


def test_a_huge_line_is_tokenised_once_behind_a_progress_bar(tmp_path, monkeypatch, capsys):
    huge = "12+3=15 " * 37_500  # 300,000 characters the world tokenizer encodes (one token per character)
    rows = [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}, {"prompt": "2+2=", "chosen": huge, "rejected": "5"}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(C, "PROGRESS_CHARS", 200_000)  # the bar's threshold, below this file's 300k characters
    loaded, where = load_rows(str(path))
    units = to_units(loaded, where, "dpo")
    tok = CountingTokenizer(build_tokenizer())
    enc = Encoder(tok, 16, 32)
    enc.check_prompts(loaded, where)
    cut = enc.check_completions(loaded, where)
    assert tok.long_calls == 1  # the one pass that names an unencodable record, and counts the cut
    err = capsys.readouterr().err
    assert "tokenize data: 100%" in err and "300k/300k" in err, err
    # the cut: tokenising stops at the first 100,000 characters (LONG_TEXT_CHARS, more than char_bound(32) =
    # 2 x 13 (the world's longest vocabulary entry, "<|endoftext|>") x (32 + 64)): the prompt's tokens + 100,000
    # completion tokens + EOS beyond train.max_length=32 are counted, a lower bound of what is lost
    assert enc.char_bound(32) == C.LONG_TEXT_CHARS and 2 * 13 * (32 + C.CUT_SLACK_TOKENS) < C.LONG_TEXT_CHARS
    prompt_len = len(enc.prompt_ids("2+2="))
    assert (cut.cut, cut.tokens_lost, cut.bounded) == (1, prompt_len + 100_000 + 1 - 32, True)
    assert f"at least {prompt_len + 100_000 + 1 - 32} tokens" in cut.describe()
    # collation and length bucketing reuse that pass: the same ids as tokenising again, without doing so
    full = build_tokenizer()(huge, add_special_tokens=False)["input_ids"]
    assert enc.completion_ids("2+2=", huge) == full[:32 - prompt_len]
    collate = Collator(enc, _Obj(), bucketing=True)
    assert collate.length(units[1]) == 32
    batch = collate([units[1]])
    assert batch.seqs.input_ids.shape == (2, 32)
    assert tok.long_calls == 1


def test_tokenising_stops_at_the_length_that_matters(caplog):
    """Only a bounded prefix of a huge text is tokenised (tokenising costs ~800 bytes per token): a 10 MB prompt is
    refused at once, without transformers' over-long-sequence warning, and a huge completion's kept ids are those of
    the whole text."""
    import logging
    import time

    tok = build_tokenizer()
    longest = max(map(len, tok.get_vocab()))
    calls = []

    class Recording(CountingTokenizer):
        def __call__(self, text, *a, **k):
            calls.extend(len(t) for t in (text if isinstance(text, list) else [text]))
            return super().__call__(text, *a, **k)

    enc = Encoder(Recording(tok), 16, 32)
    huge = "12+3=" * 2_000_000  # 10,000,000 characters
    start = time.perf_counter()
    with caplog.at_level(logging.WARNING):
        try:
            enc.prompt_ids(huge, "data.jsonl:2")
        except Exception as e:  # noqa: BLE001 - the refusal is the point
            refusal = str(e)
    assert time.perf_counter() - start < 5.0  # ~0.2 s here; the whole text took ~48 s and 8 GB
    n = len(tok(huge[:C.LONG_TEXT_CHARS], verbose=False)["input_ids"])  # what the prefix holds
    assert n >= C.LONG_TEXT_CHARS
    assert refusal == f"data.jsonl:2: prompt has at least {n} tokens, more than train.max_prompt_length=16"
    assert max(calls) == C.LONG_TEXT_CHARS and not caplog.records  # no "Token indices sequence length" warning
    assert 2 * longest * (16 + C.CUT_SLACK_TOKENS) <= C.LONG_TEXT_CHARS
    calls.clear()
    ids = enc.completion_ids("1+1=", huge)
    assert max(calls) == C.LONG_TEXT_CHARS
    assert ids == tok(huge[:1000], add_special_tokens=False)["input_ids"][:32 - len(enc.prompt_ids("1+1="))]
    assert enc.text_tokens(huge) == C.LONG_TEXT_CHARS  # a lower bound: one token per character here
