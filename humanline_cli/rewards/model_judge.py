"""A frozen causal LM as a pairwise judge, read from its next-token logits rather than from generated text (a
135M model rarely writes a parsable verdict, but it always has logits).

Consumes a model and its tokenizer, prompts and two lists of replies (A, e.g. the trained policy's; B, e.g. the
starting policy's). Produces, per pair, the judge's preference for A in [0, 1] and A's outcome (1 win, 1/2 tie,
0 loss).

One presentation order: templates/pairwise_ab.txt, filled with the instruction, the reply shown first as
Output (A) and the other as Output (B), sent as a user message through the tokenizer's chat template (the
generation prompt appended; plain text and a newline without a template). At the reply's first position the
judge's logits z give p_first = P("A" | "A" or "B") = sigmoid(z["A"] - z["B"]): the softmax restricted to the two
letters, whose normaliser cancels. Both orders are asked, which cancels position bias:

    preference(a over b) = 1/2 + (p_first(a shown first) - p_first(b shown first)) / 2

(a judge that ignores the replies, whatever its bias, gives exactly 1/2; identical replies give exactly 1/2).
Outcome: 1 above 1/2 + TIE_TOL, 0 below 1/2 - TIE_TOL, 1/2 between.
"""
from __future__ import annotations

import math
from importlib import resources

import torch

from humanline_cli.errors import UserError
from humanline_cli.rewards.llm_judge import render

TIE_TOL = 1e-9
LETTERS = ("A", "B")


def letter_ids(tokenizer) -> tuple[int, int]:
    """The token ids of "A" and "B", each one token, or a one-line UserError."""
    ids = [tokenizer.encode(x, add_special_tokens=False) for x in LETTERS]
    if any(len(i) != 1 for i in ids):
        raise UserError(f"eval.model_judge: the judge's tokenizer splits 'A' or 'B' into several tokens ({ids})")
    return ids[0][0], ids[1][0]


def preference(p_a_first: float, p_b_first: float) -> float:
    """P(a better than b) from both orders: p_a_first = P("A") with a shown first, p_b_first with b shown first."""
    return 0.5 + (p_a_first - p_b_first) / 2


def outcome(pref: float) -> float:
    return 1.0 if pref > 0.5 + TIE_TOL else 0.0 if pref < 0.5 - TIE_TOL else 0.5


class ModelJudge:
    """`model`: a causal LM, frozen here (no grad, eval mode); `name` is what reports call it."""

    def __init__(self, model: torch.nn.Module, tokenizer, name: str, batch_size: int = 8):
        self.model, self.tokenizer, self.name, self.batch_size = model, tokenizer, name, batch_size
        self.model.requires_grad_(False).eval()
        self.ids = letter_ids(tokenizer)
        self.template = resources.files(__package__).joinpath("templates/pairwise_ab.txt").read_text(encoding="utf-8")

    def input_ids(self, instruction: str, first: str, second: str) -> list[int]:
        """The judge's input ids for one order; the placeholders are filled in one pass (braces in a reply stay)."""
        text = render(self.template, instruction, first, second)
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False))
        return tok.encode(text + "\n", add_special_tokens=True)

    @torch.no_grad()
    def p_first(self, rows: list[list[int]]) -> list[float]:
        """P("A" | "A" or "B") at the position after each row's last token: right-padded batches, the logits read
        at each row's own last real position (a causal LM's earlier positions do not see the padding)."""
        a, b = self.ids
        device = next(self.model.parameters()).device
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        out: list[float] = []
        for s in range(0, len(rows), self.batch_size):
            chunk = rows[s:s + self.batch_size]
            width = max(len(r) for r in chunk)
            ids = torch.tensor([r + [pad] * (width - len(r)) for r in chunk], device=device)
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in chunk], device=device)
            logits = self.model(input_ids=ids, attention_mask=mask).logits
            last = torch.tensor([len(r) - 1 for r in chunk], device=device)
            z = logits[torch.arange(len(chunk), device=device), last].double()
            out += [1.0 / (1.0 + math.exp(-float(g))) for g in (z[:, a] - z[:, b]).tolist()]
        return out

    def preferences(self, instructions: list[str], replies_a: list[str], replies_b: list[str]) -> list[float]:
        """Per pair, the judge's preference for reply a (module docstring), both orders asked."""
        n = len(instructions)
        if not n == len(replies_a) == len(replies_b):
            raise ValueError(f"{n} instructions, {len(replies_a)} and {len(replies_b)} replies")
        rows = [self.input_ids(i, x, y) for i, x, y in zip(instructions, replies_a, replies_b)]
        rows += [self.input_ids(i, y, x) for i, x, y in zip(instructions, replies_a, replies_b)]
        p = self.p_first(rows)
        return [preference(p[k], p[n + k]) for k in range(n)]
