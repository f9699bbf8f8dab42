"""Tokenise prompts/completions (chat template when the data is conversational) and collate
examples into the batch types (each objective's `collate`, core/objectives/). Completions always end with EOS (added
if the text lacks it)."""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from humanline_cli.core import objectives
from humanline_cli.core.batches import Seqs
from humanline_cli.data.examples import text_value
from humanline_cli.errors import UserError

# Texts this long (characters) are tokenised once, up front (check_completions): collation and length
# bucketing reuse their token count and first max_length ids instead of tokenising them again each epoch.
LONG_TEXT_CHARS = 100_000
# Offline completions totalling this many characters get a progress bar while they are tokenised (a 50 MB line
# takes minutes), in batches of at most BATCH_CHARS characters so the bar moves between long texts.
PROGRESS_CHARS = 4_000_000
BATCH_CHARS = 1_000_000
# A text is cut before it is tokenised where a prefix surely holds every token that can matter: tokenising costs
# ~800 bytes of peak memory per token (a 10 MB line: 8 GB), while only the first max_length tokens are kept. A
# token spans at most as many characters as the tokenizer's longest vocabulary entry (the entry's bytes or pieces,
# each at least one character), so 2 x that x (tokens + CUT_SLACK_TOKENS) characters hold more than `tokens`
# tokens (2: a normaliser that folds two characters into one); the slack keeps the cut's last word, which may
# tokenise differently alone, beyond the tokens kept.
CUT_SLACK_TOKENS = 64


def _ids(out) -> list[int]:
    """apply_chat_template returns a list or a BatchEncoding depending on the transformers version."""
    if hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    return list(out)


class Encoder:
    """Turns (prompt, completion) into token ids with one consistent convention for training,
    sampling and evaluation: prompt ids end where generation starts.

    Text the tokenizer cannot encode (a character outside a small vocabulary, which either raises
    inside the tokenizer or maps to its unknown token) is a UserError naming the record and the
    characters. The check costs one membership test per text; characters are only examined, one at a
    time and cached, once a text fails. Byte-level BPE tokenizers encode everything and never fail."""

    def __init__(self, tokenizer, max_prompt_length: int, max_length: int, wrap_strings: bool = False,
                 system_prompt: str | None = None):
        self.tok = tokenizer
        self.wrap_strings = wrap_strings
        self.system_prompt = system_prompt  # task.system_prompt: string prompts become [system, user] messages
        self.max_prompt_length = max_prompt_length
        self.max_length = max_length
        self._cache: dict = {}
        self._long: dict[str, tuple[int, list[int]]] = {}  # long text -> (its token count, its first max_length ids)
        self._char_ok: dict[str, bool] = {}
        self._unk = getattr(tokenizer, "unk_token_id", None)
        self._longest_token: int | None = None

    def char_bound(self, tokens: int) -> int | None:
        """Characters that surely hold more than `tokens` tokens (CUT_SLACK_TOKENS), at least LONG_TEXT_CHARS;
        None where the tokenizer's vocabulary cannot be read (texts are then tokenised whole)."""
        if self._longest_token is None:
            try:
                self._longest_token = max(map(len, self.tok.get_vocab()), default=0)
            except Exception:  # noqa: BLE001 - a tokenizer without a readable vocabulary: no cut
                self._longest_token = 0
        if self._longest_token <= 0:
            return None
        return max(LONG_TEXT_CHARS, 2 * self._longest_token * (tokens + CUT_SLACK_TOKENS))

    def _cut(self, text: str, tokens: int) -> str:
        """`text`, or the prefix of it that holds more than `tokens` tokens (char_bound)."""
        bound = self.char_bound(tokens) if len(text) > LONG_TEXT_CHARS else None
        return text[:bound] if bound is not None and len(text) > bound else text

    def _encodes(self, text: str) -> bool:
        try:
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
        except Exception:  # e.g. a WordLevel vocabulary without an unknown token raises
            return False
        return self._unk is None or self._unk not in ids

    def _bad_chars(self, text: str) -> list[str]:
        for c in set(text) - self._char_ok.keys():
            self._char_ok[c] = self._encodes(c)
        return [c for c in dict.fromkeys(text) if not self._char_ok[c]]

    def _unknown_pieces(self, text: str) -> list[str]:
        """Substrings a fast tokenizer maps to its unknown token, except the unknown token's own
        spelling (GPT-2's unk is also its eos: a literal '<|endoftext|>' is not an unknown character)."""
        try:
            enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        except Exception:  # slow tokenizers have no offsets
            return []
        pieces = [text[a:b] for i, (a, b) in zip(enc["input_ids"], enc["offset_mapping"]) if i == self._unk]
        return [p for p in dict.fromkeys(pieces) if p and p != self.tok.unk_token]

    def _unencodable(self, text: str, field: str, where: str, error: Exception | None) -> UserError | None:
        bad = self._bad_chars(text)
        if bad:
            shown = ", ".join(f"{c!r} (U+{ord(c):04X})" for c in bad[:8]) + (f" and {len(bad) - 8} more"
                                                                               if len(bad) > 8 else "")
            return UserError(f"{where}: {field} has character(s) the tokenizer cannot encode: {shown}")
        if error is not None:
            lines = str(error).splitlines()
            return UserError(f"{where}: the tokenizer cannot encode the {field} "
                             f"({type(error).__name__}: {lines[0] if lines else ''})")
        pieces = self._unknown_pieces(text)
        if pieces:
            return UserError(f"{where}: {field} has text the tokenizer maps to its unknown token "
                             f"{self.tok.unk_token!r}: {', '.join(repr(p) for p in pieces[:8])}")
        return None

    def _text_ids(self, text: str, field: str, where: str, add_special_tokens: bool = False) -> list[int]:
        try:
            # verbose=False: a text longer than the model's context is ours to cut or refuse, not a warning
            ids = self.tok(text, add_special_tokens=add_special_tokens, verbose=False)["input_ids"]
        except Exception as e:  # tokenizers raise plain Exceptions for characters outside the vocabulary
            raise self._unencodable(text, field, where, e) from None
        if self._unk is not None and self._unk in ids:
            err = self._unencodable(text, field, where, None)
            if err is not None:
                raise err
        return ids

    def prompt_ids(self, prompt, where: str = "prompt") -> list[int]:
        key = repr(prompt)
        if key not in self._cache:
            text_value(prompt, "prompt", where)  # online and eval prompt rows are not validated elsewhere
            if isinstance(prompt, str) and not (self.wrap_strings or self.system_prompt):
                cut = self._cut(prompt, self.max_prompt_length)
                ids = self._text_ids(cut, "prompt", where, add_special_tokens=True)
                self._refuse_long_prompt(ids, len(cut) < len(prompt), where)
            else:
                if getattr(self.tok, "chat_template", None) is None:
                    raise UserError("task.system_prompt needs a tokenizer with a chat template" if self.system_prompt
                                    and isinstance(prompt, str) else
                                    "conversational data needs a tokenizer with a chat template")
                messages = prompt
                if isinstance(prompt, str):
                    system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
                    messages = system + [{"role": "user", "content": prompt}]
                for m in messages:  # name the characters, not the chat template's internals
                    content = self._cut(m["content"], self.max_prompt_length)
                    self._refuse_long_prompt(self._text_ids(content, "prompt" if isinstance(prompt, str) else
                                                            f"prompt ({m['role']} message)", where),
                                             len(content) < len(m["content"]), where)
                try:
                    ids = _ids(self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
                except Exception as e:
                    lines = str(e).splitlines()
                    raise UserError(f"{where}: the tokenizer's chat template fails on this prompt "
                                    f"({type(e).__name__}: {lines[0] if lines else ''})") from None
            if len(ids) > self.max_prompt_length:
                raise UserError(f"{where}: prompt has {len(ids)} tokens, more than train.max_prompt_length="
                                f"{self.max_prompt_length}")
            self._cache[key] = ids
        return self._cache[key]

    def _refuse_long_prompt(self, ids: list[int], was_cut: bool, where: str) -> None:
        if len(ids) > self.max_prompt_length:
            many = f"at least {len(ids)}" if was_cut else f"{len(ids)}"  # counted in a prefix: the rest uncounted
            raise UserError(f"{where}: prompt has {many} tokens, more than train.max_prompt_length="
                            f"{self.max_prompt_length}")

    def check_prompts(self, rows: list[dict], where) -> None:
        """Tokenise every row's prompt up front, so a missing, over-long or unencodable one fails
        before any work, naming its record."""
        for i, row in enumerate(rows):
            if "prompt" not in row:
                raise UserError(f"{where(i)}: rows need a 'prompt' field")
            self.prompt_ids(row["prompt"], where(i))

    def check_completions(self, rows: list[dict], where, chunk: int = 1024) -> Truncation:
        """Tokenise every completion of offline rows (chosen / rejected / completion / completions)
        up front, so an unencodable one fails before any work, naming its record and field. Texts go
        to the tokenizer in batches; only a failing batch is re-encoded text by text to name the culprit.
        Returns how many completions (+ EOS) would be cut to fit max_length after their prompt. Many
        characters (PROGRESS_CHARS) show a progress bar; long texts (LONG_TEXT_CHARS) keep their count and cut
        ids, so this is the only time they are tokenised."""
        items = []
        for i, row in enumerate(rows):
            fields = [(f, row[f]) for f in ("chosen", "rejected", "completion") if f in row]
            if isinstance(row.get("completions"), list):
                fields += [(f"completions[{j}]", c) for j, c in enumerate(row["completions"])]
            for field, value in fields:
                value = text_value(value, field, where(i))
                items.append((i, field, value if isinstance(value, str) else value[-1]["content"]))
        cut = lost = longest = 0
        bounded = False  # a text was cut before tokenising: its tokens lost are a lower bound
        total = sum(len(text) for _, _, text in items)
        bar = None
        if total >= PROGRESS_CHARS:
            from tqdm import tqdm

            bar = tqdm(total=total, desc="tokenize data", unit="char", unit_scale=True, file=sys.stderr)
        try:
            for part in _batches(items, chunk, BATCH_CHARS):
                texts = [self._cut(text, self.max_length) for _, _, text in part]
                bounded = bounded or any(len(t) < len(text) for t, (_, _, text) in zip(texts, part))
                try:
                    encoded = self.tok(texts, add_special_tokens=False, verbose=False)["input_ids"]
                    suspects = [k for k, ids in enumerate(encoded) if self._unk is not None and self._unk in ids]
                except Exception:  # one unencodable text fails the whole batch
                    suspects, encoded = list(range(len(part))), None
                for k in suspects:
                    i, field, _ = part[k]
                    self._text_ids(texts[k], field, where(i))
                if encoded is None:
                    encoded = [self._text_ids(t, field, where(i)) for t, (i, field, _) in zip(texts, part)]
                for (i, _, text), ids in zip(part, encoded):
                    need = len(self.prompt_ids(rows[i]["prompt"], where(i))) + len(ids) + 1  # + EOS
                    longest = max(longest, need)
                    if need > self.max_length:
                        cut, lost = cut + 1, lost + need - self.max_length
                    if len(text) >= LONG_TEXT_CHARS:
                        self._long[text] = (len(ids), list(ids[:self.max_length]))
                if bar is not None:
                    bar.update(sum(len(text) for _, _, text in part))
        finally:
            if bar is not None:
                bar.close()
        return Truncation(len(items), cut, lost, longest, self.max_length, bounded)

    def text_tokens(self, text: str) -> int:
        """A completion text's token count (no EOS; a long text's, cut before tokenising, at least that); long texts
        from check_completions' pass."""
        if text in self._long:
            return self._long[text][0]
        return len(self.tok(self._cut(text, self.max_length), add_special_tokens=False, verbose=False)["input_ids"])

    def completion_ids(self, prompt, completion, where: str = "data", field: str = "completion") -> list[int]:
        budget = self.max_length - len(self.prompt_ids(prompt, where))
        if hasattr(completion, "ids"):  # sampled online: keep the sampler's exact token ids
            return list(completion.ids)[:budget]
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        # a long text's first max_length ids (budget <= max_length): the same cut, without tokenising it again
        ids = self._long[text][1] if text in self._long else self._text_ids(self._cut(text, self.max_length), field,
                                                                            where)
        return (ids + [self.tok.eos_token_id])[:budget]

    def prompt_text(self, prompt) -> str:
        """What a labeller/judge sees as the prompt: the string, or the last user message's content."""
        if isinstance(prompt, str):
            return prompt
        return [m["content"] for m in prompt if m["role"] == "user"][-1]


@dataclass(frozen=True)
class Truncation:
    """Completions that do not fit train.max_length after their prompt (counted before training)."""

    n: int
    cut: int
    tokens_lost: int
    longest: int       # prompt + completion + EOS tokens of the longest example
    max_length: int
    bounded: bool = False  # a text was cut before tokenising (Encoder.char_bound): tokens_lost, longest at least

    @property
    def fraction(self) -> float:
        return self.cut / self.n if self.n else 0.0

    def describe(self) -> str:
        if not self.cut:
            return f"no completion cut (longest example {self.longest} <= train.max_length {self.max_length} tokens)"
        least = "at least " if self.bounded else ""
        return (f"{self.cut} of {self.n} completions cut ({self.fraction:.1%}, {least}{self.tokens_lost} tokens and "
                f"their EOS lost; longest example {least}{self.longest} > train.max_length {self.max_length})")


def _batches(items: list, count: int, chars: int):
    """Consecutive runs of `items` ((row, field, text) triples) of at most `count` texts and, unless one text
    alone is longer, at most `chars` characters."""
    part, size = [], 0
    for item in items:
        if part and (len(part) == count or size + len(item[2]) > chars):
            yield part
            part, size = [], 0
        part.append(item)
        size += len(item[2])
    if part:
        yield part


def make_seqs(prompts: list[list[int]], completions: list[list[int]], pad_id: int) -> Seqs:
    """Right-padded prompt+completion sequences; loss_mask covers the completion tokens."""
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    n = len(prompts)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width), dtype=torch.bool)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        seq = p + c
        input_ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention[i, : len(seq)] = 1
        loss_mask[i, len(p) : len(seq)] = True
    return Seqs(input_ids, attention, loss_mask)


class Collator:
    """Units -> batches of data only (how a forward runs them is the policy's and the reference's own options,
    core/logprobs.ForwardOptions). `bucketing` (train.length_bucketing, which the builder turns off under
    train.packing) makes `bucket_length` available to the sources, which sort each rank's share of a step by it
    before cutting micro-batches."""

    def __init__(self, encoder: Encoder, objective_cfg, bucketing: bool = False):
        self.enc = encoder
        self.pad = encoder.tok.pad_token_id
        self.cfg = objective_cfg
        self.bucketing = bucketing
        self._text_lengths: dict[str, int] = {}  # completion text -> its token count + EOS

    def _seqs(self, prompts, completions) -> Seqs:
        p_ids = [self.enc.prompt_ids(p) for p in prompts]
        c_ids = [self.enc.completion_ids(p, c) for p, c in zip(prompts, completions)]
        return make_seqs(p_ids, c_ids, self.pad)

    @property
    def bucket_length(self):
        """`length` when micro-batches should be length-bucketed, else None."""
        return self.length if self.bucketing else None

    def _completion_length(self, completion) -> int:
        """Tokens of a completion as collated before the max_length cut (text: + EOS; cached per text)."""
        if hasattr(completion, "ids"):  # sampled online: the sampler's ids, no EOS added
            return len(completion.ids)
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        n = self._text_lengths.get(text)
        if n is None:
            n = self._text_lengths[text] = self.enc.text_tokens(text) + 1
        return n

    def length(self, unit) -> int:
        """Tokens of the unit's longest sequence: prompt + its longest completion, cut to max_length as
        the collated rows are (the prompt's ids come from the encoder's cache)."""
        comps = objectives.for_unit(unit).completions(unit)
        p = len(self.enc.prompt_ids(unit.prompt))
        return p + min(max(self._completion_length(c) for c in comps), max(self.enc.max_length - p, 0))

    def __call__(self, units: list, partners: list | None = None):
        """`partners` (KTO): the unit whose completion pairs with each unit's prompt for z0; the
        sources pass the next unit of the whole (global) batch, else the micro-batch wraps around."""
        return objectives.for_unit(units[0]).collate(units, partners, self._seqs, self.cfg)
