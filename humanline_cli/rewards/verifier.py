"""Verifiable rewards: 1.0 if the completion's final answer equals the reference answer, else 0.0.

method=math uses the `math-verify` package (LaTeX / boxed answers, numeric equivalence);
method=math_latex is the authors' math recipe's extraction of the completion's answer (open-r1's accuracy
reward): LaTeX only (\\boxed first, then $...$ and the like, never a bare number outside LaTeX), units and
equations normalised, the first match; method=exact compares stripped strings; method=final_number reads the
last number in the completion ("27 + 82 = 109." -> 109; thousands commas allowed) and compares it with the answer
as a number. Reference answers come from the prompt rows' `answer` field.
"""
from __future__ import annotations

import re
from fractions import Fraction

from humanline_cli.errors import UserError

# a signed integer or decimal, thousands commas allowed ("1,234.5"); a minus only directly before the digits
NUMBER = re.compile(r"(?<![\d.])-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|(?<![\d.])-?\d+(?:\.\d+)?")


def verify_batch(completions: list[str], answers: list | None, method: str = "math") -> list[float]:
    if answers is None:
        raise UserError("reward kind=verifier needs an 'answer' field in the prompt rows")
    match method:
        case "exact":
            return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answers)]
        case "final_number":
            return [float(final_number(c) == _number(str(a))) for c, a in zip(completions, answers)]
        case "math" | "math_latex":
            return math_verdicts(completions, answers, method)[0]
        case _:
            raise UserError(f"unknown verifier method {method!r} (math | math_latex | exact | final_number)")


def _number(text: str) -> Fraction | None:
    try:
        return Fraction(text.strip().replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def final_number(text: str) -> Fraction | None:
    """The last number written in `text` (exact, as a Fraction), None when it has none."""
    found = NUMBER.findall(text)
    return _number(found[-1]) if found else None


def math_verdicts(completions: list[str], answers: list, method: str = "math") -> tuple[list[float], list[bool]]:
    """math-verify: (1.0 / 0.0 per completion, whether an answer could be extracted from it at all).
    A completion without an extractable answer (parse gives nothing) is wrong and counted as unparsed;
    an exception inside math-verify is wrong, never a crash. method=math_latex: the recipe's extraction."""
    try:
        from math_verify import parse, verify
    except ImportError:
        raise UserError(f"reward method={method} needs math-verify: pip install -e '.[math]'") from None
    extract = parse if method == "math" else _latex_first_match()
    scores, parsed = [], []
    for c, a in zip(completions, answers):
        a = str(a)  # a bare answer, or a whole reference solution with \boxed{...}
        gold = parse(a if a.startswith("$") or "\\boxed" in a else "$" + a + "$")
        try:
            pred = extract(c) if c.strip() else []
            parsed.append(bool(pred))
            scores.append(float(bool(verify(gold, pred))) if pred else 0.0)
        except Exception:  # unparseable model output is simply wrong, never a crash
            parsed.append(False)
            scores.append(0.0)
    return scores, parsed


def _latex_first_match():
    """text -> math-verify's parse with the recipe's answer extraction (method=math_latex)."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse

    config = [LatexExtractionConfig(
        # the recipe also set equations=True, which this latex2sympy2_extended ignores (the parser handles
        # equations) and warns about on every call
        normalization_config=NormalizationConfig(nits=False, malformed_operators=False, basic_latex=True,
                                                 boxed="all", units=True),
        boxed_match_priority=0,             # \boxed{...} before any other LaTeX
        try_extract_without_anchor=False)]  # no answers guessed from unmarked text
    return lambda text: parse(text, extraction_config=config, extraction_mode="first_match")
