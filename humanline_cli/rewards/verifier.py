"""Verifiable rewards: 1.0 if the completion's final answer equals the reference answer, else 0.0.

method=math uses the `math-verify` package (LaTeX / boxed answers, numeric equivalence);
method=exact compares stripped strings. Reference answers come from the prompt rows' `answer` field.
"""
from __future__ import annotations

from humanline_cli.errors import UserError


def verify_batch(completions: list[str], answers: list | None, method: str = "math") -> list[float]:
    if answers is None:
        raise UserError("reward kind=verifier needs an 'answer' field in the prompt rows")
    match method:
        case "exact":
            return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answers)]
        case "math":
            return math_verdicts(completions, answers)[0]
        case _:
            raise UserError(f"unknown verifier method {method!r} (math | exact)")


def math_verdicts(completions: list[str], answers: list) -> tuple[list[float], list[bool]]:
    """math-verify: (1.0 / 0.0 per completion, whether an answer could be extracted from it at all).
    A completion without an extractable answer (parse gives nothing) is wrong and counted as unparsed;
    an exception inside math-verify is wrong, never a crash."""
    try:
        from math_verify import parse, verify
    except ImportError:
        raise UserError("reward method=math needs math-verify: pip install -e '.[math]'") from None
    scores, parsed = [], []
    for c, a in zip(completions, answers):
        a = str(a)  # a bare answer, or a whole reference solution with \boxed{...}
        gold = parse(a if a.startswith("$") or "\\boxed" in a else "$" + a + "$")
        try:
            pred = parse(c) if c.strip() else []
            parsed.append(bool(pred))
            scores.append(float(bool(verify(gold, pred))) if pred else 0.0)
        except Exception:  # unparseable model output is simply wrong, never a crash
            parsed.append(False)
            scores.append(0.0)
    return scores, parsed
