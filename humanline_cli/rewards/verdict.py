"""Reading an LLM judge's pairwise verdict: `parse_verdict` turns a reply into 'A', 'B', 'tie' or None
(messy variants included: "**B**", "[[A]]", "Output (b)", "The better output is A."), `outcome_for_a`
maps a verdict on one presentation order to reply A's outcome, and `combine` merges the orders asked."""
from __future__ import annotations

import re

_WRAP = " \t\r\n\"'`*_#[](){}<>.,:;!?-"
_TIE = {"tie": "tie", "tied": "tie", "draw": "tie", "equal": "tie", "a tie": "tie"}
_PREFIX = re.compile(r"^(?:(?:final|my)\s+)?(?:answer|verdict|winner|choice|decision|output|response)\s*[:=\-]?\s*")
# What may follow a free-standing label: the end, punctuation, or "is better"-like words.
_AFTER = r"(?=\s*$|\s*[.,;:!*\"'`\n]|\s+(?:is|wins|was|seems|clearly|better|provides|gives)\b)"
_AFTER_RE = re.compile(r"\s*[\])]?" + _AFTER)
_DOUBLE = re.compile(r"\[\[\s*(?:output\s*)?\(?\s*(a|b|tie)\s*\)?\s*\]\]", re.I)
_KEYWORD = re.compile(r"(?:answer|verdict|winner|choice|decision|prefer(?:red|ence)?|(?:better|best)\s+(?:output|response))"
                      r"\s*(?:is|:|=|would be|-)?\s*[*\"'`]*\s*(?:output|response)?\s*[\[(]?\s*(a|b|tie)\b", re.I)
_LEADING = re.compile(r"^[\s*\"'`#>\[(]*(?:output|response)?\s*[\[(]?\s*(a|b|tie)\s*[\])]?" + _AFTER, re.I)
_BETTER = re.compile(r"(?:(?:output|response)\s*[\[(]?\s*(a|b)\s*[\])]?|\b(a|b))[*\"'`]*"
                     r"\s+is\s+(?:better|superior|preferable|the better)", re.I)
_MENTION = re.compile(r"(?:(?:output|response)\s*[\[(]?\s*(a|b)\s*[\])]?(?!\w))|(?:\((a|b)\))", re.I)


def parse_verdict(text: str | None) -> str | None:
    """'A' (the output shown first is better), 'B' (the one shown second), 'tie', or None.

    Tried in turn: the whole reply is a label (modulo quotes, markdown, punctuation, "Output (a)",
    "Answer:"); the last [[X]]; the last "answer/verdict/winner/better output is X"; a label that
    opens the reply; "Output X is better"; a single output mentioned, or "tie" with none mentioned.
    A lowercase free-standing "a" only counts where punctuation or "is better" follows it, since it is
    also an English article."""
    if not text or not text.strip():
        return None
    bare = _PREFIX.sub("", text.strip(_WRAP).lower()).strip(_WRAP)
    if bare in ("a", "b"):
        return bare.upper()
    if bare in _TIE:
        return "tie"
    found = _DOUBLE.findall(text)
    if found:
        return _label(found[-1])
    # After a keyword an upper-case label counts whatever follows ("The answer is A because ...");
    # "a" and "tie" need punctuation or "is better" after them ("I prefer a short reply" is no verdict).
    found = [m for m in _KEYWORD.finditer(text) if m.group(1) in ("A", "B", "b") or _AFTER_RE.match(text, m.end())]
    if found:
        return _label(found[-1].group(1))
    for pattern in (_LEADING, _BETTER):
        m = pattern.search(text)
        if m:
            return _label(next(g for g in m.groups() if g))
    mentioned = {(a or b).upper() for a, b in _MENTION.findall(text)}
    if len(mentioned) == 1:
        return mentioned.pop()
    if not mentioned and re.search(r"\b(?:tie|draw)\b", text, re.I):
        return "tie"
    return None


def _label(s: str) -> str:
    return "tie" if s.lower() == "tie" else s.upper()


def outcome_for_a(order: str, verdict: str | None) -> float | None:
    """Map a verdict on one presentation order to A's outcome: winning position -> 1.0, tie -> 0.5."""
    if verdict is None:
        return None
    if verdict == "tie":
        return 0.5
    first_wins = verdict == "A"
    return 1.0 if first_wins == (order == "ab") else 0.0


def combine(outcomes: list[float | None]) -> float | None:
    """One outcome from the orders asked: None if none parsed, the parsed ones if they agree, else a tie."""
    got = [o for o in outcomes if o is not None]
    if not got:
        return None
    return got[0] if all(o == got[0] for o in got) else 0.5
