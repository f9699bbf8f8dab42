"""Rows (TRL conventions) -> validated examples -> the objective's unit.

Formats: pairs (prompt, chosen, rejected [, score_chosen, score_rejected]), unpaired (prompt,
completion, label), groups (prompt, completions, rewards). Prompts and completions are strings or
chat message lists; rows may mix the two (each value is checked on its own). Every pair or group becomes
a scored group, which the objective turns into its units (core/objectives/, following the paper: KTO splits
a pair into one desirable and one undesirable example; GRPO treats a scored pair as a group of 2; groups
feed DPO/KTO via best vs worst).
"""
from __future__ import annotations

import json
import math

from humanline_cli.core import objectives
from humanline_cli.core.feedback import BinaryExample, ScoredGroup

# the units live with the objectives (core/feedback.py); importable from here too
from humanline_cli.core.feedback import GroupExample as GroupExample
from humanline_cli.core.feedback import PairExample as PairExample
from humanline_cli.errors import UserError

FORMATS = {
    "pairs": ("prompt", "chosen", "rejected"),
    "unpaired": ("prompt", "completion", "label"),
    "groups": ("prompt", "completions", "rewards"),
}


def detect_format(row: dict, where: str) -> str:
    for name, keys in FORMATS.items():
        if all(k in row for k in keys):
            return name
    raise UserError(f"{where}: fields {sorted(row)} match no known format "
                    f"(pairs: prompt/chosen/rejected, unpaired: prompt/completion/label, "
                    f"groups: prompt/completions/rewards)")


# the roles chat templates know
ROLES = ("system", "user", "assistant", "tool")


def text_value(value, field: str, where: str, role: str | None = None):
    """A string, or a list of {role, content} messages (ending with a `role` message if given)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    ):
        # a chat template renders an unknown role as it likes (or drops it), and a labeller reads the last user
        # message: a typo here would train on a prompt nobody wrote
        unknown = next((m["role"] for m in value if m["role"] not in ROLES), None)
        if unknown is not None:
            raise UserError(f"{where}: field '{field}' has a message with role {unknown!r} (roles: "
                            f"{', '.join(ROLES)})")
        if field == "prompt" and not any(m["role"] == "user" for m in value):
            raise UserError(f"{where}: field 'prompt' has no 'user' message")
        if role is not None and value[-1]["role"] != role:
            raise UserError(f"{where}: field '{field}' must end with a {role!r} message")
        return value
    raise UserError(f"{where}: field '{field}' must be a string or a list of {{role, content}} messages, "
                    f"got {_show(value)}")


def _show(value) -> str:
    """A short one-line description of a wrong value for an error message."""
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return f"{type(value).__name__} {text[:40] + '...' if len(text) > 40 else text}"


# |score| above this is a unit or parsing mistake, not a reward: group advantages subtract means and
# square deviations (1.7e308 overflows to inf and the advantages become NaN, far from this row)
MAX_SCORE = 1e6


def _score(value, field: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UserError(f"{where}: field '{field}' must be a finite number, got {value!r}")
    if abs(value) > MAX_SCORE:
        raise UserError(f"{where}: field '{field}' is {value!r}, outside the sane range [-{MAX_SCORE:g}, "
                        f"{MAX_SCORE:g}] (rescale the scores)")
    return float(value)


def parse_row(row: dict, fmt: str, where: str) -> ScoredGroup | BinaryExample:
    """Every paired/grouped row becomes a ScoredGroup; unpaired rows become BinaryExamples."""
    if detect_format(row, where) != fmt:
        raise UserError(f"{where}: row format differs from the first row's ({fmt})")
    prompt = text_value(row["prompt"], "prompt", where)
    match fmt:
        case "pairs":
            chosen = text_value(row["chosen"], "chosen", where, "assistant")
            rejected = text_value(row["rejected"], "rejected", where, "assistant")
            has = row.get("score_chosen") is not None and row.get("score_rejected") is not None
            sc = _score(row["score_chosen"], "score_chosen", where) if has else 1.0
            sr = _score(row["score_rejected"], "score_rejected", where) if has else 0.0
            return ScoredGroup(prompt, [chosen, rejected], [sc, sr])
        case "unpaired":
            if not isinstance(row["label"], bool):
                raise UserError(f"{where}: field 'label' must be true/false, got {row['label']!r}")
            return BinaryExample(prompt, text_value(row["completion"], "completion", where, "assistant"), row["label"])
        case "groups":
            comps, rewards = row["completions"], row["rewards"]
            if not isinstance(comps, list) or not isinstance(rewards, list) or len(comps) != len(rewards):
                raise UserError(f"{where}: 'completions' and 'rewards' must be lists of equal length")
            if not comps:
                raise UserError(f"{where}: empty group")
            return ScoredGroup(prompt, [text_value(c, "completions", where, "assistant") for c in comps],
                               [_score(r, "rewards", where) for r in rewards])
    raise AssertionError(fmt)


def units_from_group(objective: str, g: ScoredGroup, min_gap: float, pair: tuple | None = None) -> list:
    """One scored group -> the objective's units (core/objectives/: its `units`). `pair` (chosen, rejected) is
    set when the data names it. Shared by offline files and online rounds so both build identical training
    signal."""
    return objectives.get(objective).units(g, min_gap, pair)


def to_units(rows: list[dict], where, objective: str, min_gap: float = 0.0) -> list:
    """Validate rows and convert them to the objective's units (PairExample for dpo, BinaryExample for kto,
    GroupExample for grpo: core/objectives/).

    For pairs, the 'chosen' side is trusted as preferred even if scores tie (the dataset says so).
    """
    fmt = detect_format(rows[0], where(0))
    parsed = [parse_row(r, fmt, where(i)) for i, r in enumerate(rows)]
    if fmt == "unpaired":
        if not objectives.get(objective).unpaired_rows:
            raise UserError(f"{objective} needs paired or grouped data; {where(0)} is unpaired (prompt/completion/label)")
        return parsed
    units: list = []
    for g in parsed:
        pair = (g.completions[0], g.completions[1]) if fmt == "pairs" else None
        units += units_from_group(objective, g, min_gap, pair)
    if not units:
        raise UserError(f"no usable {objective} examples in {where(0).split(':')[0]} (all groups below data.min_gap?)")
    return units
