"""Tokenise prompts/completions (chat template when the data is conversational) and collate
examples into the batch types. Completions always end with EOS (added if the text lacks it)."""
from __future__ import annotations

import torch

from ..batches import BinaryBatch, GroupBatch, PairBatch, Seqs
from ..errors import UserError
from ..feedback import group_advantages
from .examples import BinaryExample, GroupExample, PairExample


def _ids(out) -> list[int]:
    """apply_chat_template returns a list or a BatchEncoding depending on the transformers version."""
    if hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    return list(out)


class Encoder:
    """Turns (prompt, completion) into token ids with one consistent convention for training,
    sampling and evaluation: prompt ids end where generation starts."""

    def __init__(self, tokenizer, max_prompt_length: int, max_length: int, wrap_strings: bool = False):
        self.tok = tokenizer
        self.wrap_strings = wrap_strings
        self.max_prompt_length = max_prompt_length
        self.max_length = max_length
        self._cache: dict = {}

    def prompt_ids(self, prompt, where: str = "prompt") -> list[int]:
        key = repr(prompt)
        if key not in self._cache:
            if isinstance(prompt, str) and self.wrap_strings:
                prompt = [{"role": "user", "content": prompt}]
            if isinstance(prompt, str):
                ids = self.tok(prompt, add_special_tokens=True)["input_ids"]
            else:
                if getattr(self.tok, "chat_template", None) is None:
                    raise UserError("conversational data needs a tokenizer with a chat template")
                ids = _ids(self.tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True))
            if len(ids) > self.max_prompt_length:
                raise UserError(f"{where}: prompt has {len(ids)} tokens, more than train.max_prompt_length="
                                f"{self.max_prompt_length}")
            self._cache[key] = ids
        return self._cache[key]

    def check_prompts(self, rows: list[dict], where) -> None:
        """Tokenise every row's prompt up front, so a missing or over-long one fails before any work,
        naming its record."""
        for i, row in enumerate(rows):
            if "prompt" not in row:
                raise UserError(f"{where(i)}: rows need a 'prompt' field")
            self.prompt_ids(row["prompt"], where(i))

    def completion_ids(self, prompt, completion) -> list[int]:
        budget = self.max_length - len(self.prompt_ids(prompt))
        if hasattr(completion, "ids"):  # sampled online: keep the sampler's exact token ids
            return list(completion.ids)[:budget]
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        return (ids + [self.tok.eos_token_id])[:budget]

    def prompt_text(self, prompt) -> str:
        """What a labeller/judge sees as the prompt: the string, or the last user message's content."""
        if isinstance(prompt, str):
            return prompt
        return [m["content"] for m in prompt if m["role"] == "user"][-1]


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
    def __init__(self, encoder: Encoder, objective_cfg):
        self.enc = encoder
        self.pad = encoder.tok.pad_token_id
        self.cfg = objective_cfg

    def _seqs(self, prompts, completions) -> Seqs:
        p_ids = [self.enc.prompt_ids(p) for p in prompts]
        c_ids = [self.enc.completion_ids(p, c) for p, c in zip(prompts, completions)]
        return make_seqs(p_ids, c_ids, self.pad)

    @staticmethod
    def _sampler_logps(seqs: Seqs, comps) -> torch.Tensor | None:
        """(N, T-1) sampling log-probs aligned with token_logps, when every completion carries them."""
        if not all(hasattr(c, "logps") for c in comps):
            return None
        out = torch.zeros(seqs.input_ids.shape[0], seqs.input_ids.shape[1] - 1)
        for i, c in enumerate(comps):
            start = int(seqs.loss_mask[i].nonzero()[0]) - 1 if seqs.loss_mask[i].any() else 0
            lp = torch.tensor(c.logps[: int(seqs.loss_mask[i].sum())], dtype=torch.float32)
            out[i, start : start + len(lp)] = lp
        return out

    def __call__(self, units: list):
        match units[0]:
            case PairExample():
                prompts = [u.prompt for u in units] * 2
                comps = [u.chosen for u in units] + [u.rejected for u in units]
                return PairBatch(self._seqs(prompts, comps))
            case BinaryExample():
                prompts = [u.prompt for u in units]
                comps = [u.completion for u in units]
                shifted = comps[1:] + comps[:1]  # prompt i with completion i+1: the KL estimate's mismatch
                return BinaryBatch(self._seqs(prompts, comps),
                                   torch.tensor([u.desirable for u in units], dtype=torch.bool),
                                   self._seqs(prompts, shifted))
            case GroupExample():
                prompts, comps, advs = [], [], []
                for u in units:
                    prompts += [u.prompt] * len(u.completions)
                    comps += list(u.completions)
                    advs.append(group_advantages(torch.tensor(u.rewards, dtype=torch.float64),
                                                 self.cfg.std_ddof, self.cfg.std_eps))
                seqs = self._seqs(prompts, comps)
                return GroupBatch(seqs, torch.cat(advs), self._sampler_logps(seqs, comps))
        raise TypeError(type(units[0]))
