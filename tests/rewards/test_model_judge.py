"""The frozen model as a pairwise judge (rewards/model_judge.py): its preference from the logits of "A" and "B" at the
reply's first position, both orders asked, on hand-made cases whose numbers are worked out below."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from humanline_cli.errors import UserError
from humanline_cli.rewards.model_judge import ModelJudge, letter_ids, outcome, preference
from tests.helpers.models import CORPUS, build_bpe_tokenizer

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _tok():
    return build_bpe_tokenizer(CORPUS + ["Output (A) Output (B) A B kind rude"], 300, 512, TEMPLATE)


class Rigged(torch.nn.Module):
    """A judge whose verdict is written by hand: at every real position z["A"] - z["B"] = 1 (it likes whatever is
    shown first) + 2 if the reply shown first says "kind"; at padded positions z["B"] = 50, so reading the
    logits anywhere but at a row's own last real token would flip every verdict."""

    def __init__(self, tok):
        super().__init__()
        self.tok, self.w = tok, torch.nn.Parameter(torch.zeros(1))
        self.a, self.b = letter_ids(tok)

    def forward(self, input_ids, attention_mask):
        n, t = input_ids.shape
        logits = torch.zeros(n, t, len(self.tok))
        for i in range(n):
            text = self.tok.decode(input_ids[i][attention_mask[i] == 1])
            first = text.split("## Output (A)\n", 1)[1].split("## Output (B)", 1)[0]
            logits[i, :, self.a] = 1.0 + (2.0 if "kind" in first else 0.0)
            logits[i, attention_mask[i] == 0, self.b] = 50.0
        return SimpleNamespace(logits=logits)


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_preference_cancels_position_bias_and_reads_the_replies():
    tok = _tok()
    judge = ModelJudge(Rigged(tok), tok, "rigged", batch_size=2)  # 2: rows of unequal length share a padded batch
    prompts = ["Say hi.", "Say hi.", "Reply to a friend who lost the match.", "Say hi."]
    a = ["That is kind of you.", "Go away.", "Bad luck, well played anyway!", "Same reply."]
    b = ["Go away.", "That is very kind of you, thank you so much.", "Oh no.", "Same reply."]
    prefs = judge.preferences(prompts, a, b)
    # pair 0: a first -> gap 1 + 2 = 3; b first -> gap 1: 1/2 + (sigmoid(3) - sigmoid(1)) / 2 = 0.61075777...
    assert prefs[0] == pytest.approx(0.5 + (sigmoid(3) - sigmoid(1)) / 2, abs=1e-12)
    assert prefs[0] == pytest.approx(0.6107577, abs=1e-7)
    # pair 1 is pair 0 mirrored: 1 - 0.61075777...
    assert prefs[1] == pytest.approx(1 - prefs[0], abs=1e-12)
    # neither says "kind": the judge's liking for the first reply cancels exactly; identical replies: exactly 1/2
    assert prefs[2] == 0.5 and prefs[3] == 0.5
    assert [outcome(p) for p in prefs] == [1.0, 0.0, 0.5, 0.5]


def test_outcome_and_preference_by_hand():
    assert preference(0.9, 0.9) == 0.5 and preference(0.9, 0.3) == pytest.approx(0.8)
    assert outcome(0.5 + 2e-9) == 1.0 and outcome(0.5 - 2e-9) == 0.0 and outcome(0.5 + 1e-10) == 0.5


def test_the_judge_is_frozen_and_its_input_is_the_chat_template_around_the_filled_template():
    tok = _tok()
    model = Rigged(tok)
    judge = ModelJudge(model, tok, "rigged")
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    text = tok.decode(judge.input_ids("Say {output_b} hi.", "first {output_a}", "second"))
    assert text.startswith("<|bos|><|user|>") and text.endswith("A or B.<|assistant|>")
    # the placeholders are filled in one pass: braces inside the texts stay as written
    assert "## Instruction\nSay {output_b} hi.\n\n## Output (A)\nfirst {output_a}\n\n## Output (B)\nsecond\n" in text


def test_a_tokenizer_that_splits_a_letter_is_refused_in_one_line():
    class Splits:
        def encode(self, text, add_special_tokens=False):
            return [1, 2] if text == "B" else [1]

    with pytest.raises(UserError, match="splits 'A' or 'B' into several tokens"):
        letter_ids(Splits())
