"""Reading an LLM judge's verdict (rewards/verdict.py): messy replies parsed, positions mapped to reply A's
outcome, the tie rule when the two orders disagree."""
from __future__ import annotations

import pytest

from humanline_cli.rewards.verdict import combine, outcome_for_a, parse_verdict


@pytest.mark.parametrize("text,verdict", [
    ("A", "A"), ("b", "B"), ('"B"', "B"), ("'a'", "A"), ("  A\n", "A"), ("B.", "B"), ("**B**", "B"), ("[[A]]", "A"),
    ("`tie`", "tie"), ("Tie.", "tie"), ("TIE", "tie"), ("[[tie]]", "tie"), ("It is a tie.", "tie"),
    ("Output (a)", "A"), ("Output (b)", "B"), ("Output B", "B"), ("Response (B)", "B"),
    ("output_b", "B"), ("Answer: B", "B"), ("Verdict - tie", "tie"), ("Final verdict: [[B]]", "B"),
    ("My final answer: **A**", "A"), ("The answer is A because it is clearer.", "A"),
    ("The better output is **B**.", "B"), ("B. Output (B) answers the question directly.", "B"),
    ("Output (a) is better than Output (b).", "A"), ("I think B is better than A.", "B"),
    ("Both are fine, but I prefer output (b).", "B"), ("Comparing them: [[A]] ... on reflection [[B]]", "B"),
    ("The answer is a", "A"),
    # no verdict
    ("", None), ("   ", None), (None, None), ("AA", None), ("m", None), ("Both outputs are fine.", None),
    ("I prefer a concise answer", None), ("A good answer would cite sources", None), ("<|eos|>", None),
    ("Output (a) and Output (b) are both wrong", None),
])
def test_parse_verdict_messy_outputs(text, verdict):
    assert parse_verdict(text) == verdict


def test_outcome_for_a_maps_positions_and_the_tie_rule():
    # order "ab": A is shown first, so verdict "A" (first better) is a win for A; in "ba" it is a loss.
    assert [outcome_for_a("ab", v) for v in ("A", "B", "tie", None)] == [1.0, 0.0, 0.5, None]
    assert [outcome_for_a("ba", v) for v in ("A", "B", "tie", None)] == [0.0, 1.0, 0.5, None]
    assert combine([1.0, 1.0]) == 1.0 and combine([0.0, 0.0]) == 0.0 and combine([0.5, 0.5]) == 0.5
    assert combine([1.0, 0.0]) == 0.5  # orders disagree: tie (a position-biased judge cancels out)
    assert combine([1.0, 0.5]) == 0.5  # win in one order, explicit tie in the other: still a disagreement
    assert combine([None, 0.0]) == 0.0 and combine([1.0, None]) == 1.0  # one parsable order decides alone
    assert combine([None, None]) is None and combine([]) is None
