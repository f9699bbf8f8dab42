"""Sentiment lexicons as scorers, for a task without a verifier or a learned reward model that installs offline:
VADER's compound score (vaderSentiment: rule-based valence with negation, intensifiers and punctuation, in
[-1, 1]) and AFINN's word valences (afinn: integers -5..5 per listed word), summed and divided by the reply's
word count, so a long reply is not rewarded for length alone. Both read only the reply, never the prompt. A task
trains on one and judges with the other (task=chat_sentiment), so that a policy exploiting one lexicon's quirks
shows up as a gap between its training reward and its judged score."""
from __future__ import annotations

from functools import cache

from humanline_cli.errors import UserError


@cache
def _vader():
    try:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
    except ImportError:
        raise UserError("kind=lexicon, lexicon=vader needs the vaderSentiment package: "
                        "pip install 'humanline[lexicon]' (just setup installs it)") from None
    return SentimentIntensityAnalyzer()


@cache
def _afinn():
    try:
        from afinn import Afinn
    except ImportError:
        raise UserError("kind=lexicon, lexicon=afinn needs the afinn package: "
                        "pip install 'humanline[lexicon]' (just setup installs it)") from None
    return Afinn()


def vader(text: str) -> float:
    return float(_vader().polarity_scores(text)["compound"])


def afinn(text: str) -> float:
    words = len(text.split())
    return float(_afinn().score(text)) / words if words else 0.0


SCORERS = {"vader": vader, "afinn": afinn}


def scorer(name: str):
    """A Scorer (prompts, completions, answers) -> one score per completion, by lexicon name."""
    if name not in SCORERS:
        raise UserError(f"unknown lexicon {name!r} (vader | afinn)")
    score = SCORERS[name]
    score("")  # load the lexicon now: a missing package stops setup with one line, not the first round
    return lambda prompts, completions, answers=None: [score(_text(c)) for c in completions]


def _text(completion) -> str:
    """A completion as text: a string, or chat messages (the assistant's content)."""
    if isinstance(completion, str):
        return completion
    return " ".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
