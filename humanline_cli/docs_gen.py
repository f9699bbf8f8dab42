"""docs/config.md's key tables, generated from the schema (humanline_cli/schema.py): every key with its default and
its help, as its dataclass field declares them (`schema.knob`), so the reference cannot drift from the code.

`python -m humanline_cli.docs_gen` rewrites the part of docs/config.md between the two markers; `--check` exits 1
when the committed file differs from what it would write (tests/config/test_config_docs.py compares the same).
A group with several option schemas (objective, sampler) gets one table: a key that only some options have says
which, and a default that differs per option is given per option.
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
import sys
import typing
from pathlib import Path

from humanline_cli import schema as S

DOC = Path(__file__).resolve().parent / "docs" / "config.md"
BEGIN = "<!-- key tables: generated from humanline_cli/schema.py by `python -m humanline_cli.docs_gen`; do not edit -->"
END = "<!-- end of the generated key tables -->"
# the root's own sections, after the groups (GROUP_SCHEMAS); the root's remaining plain keys come last
ROOT_SECTIONS = ("hl", "train", "eval", "wandb", "regime_meta")


def help_of(cls: type, name: str) -> str:
    """A field's help: its own declaration's, else the nearest base class's (an option schema that only changes
    a default, such as GRPOConfig.beta, keeps the base's help)."""
    for klass in cls.__mro__:
        f = getattr(klass, "__dataclass_fields__", {}).get(name)
        if f is not None and f.metadata.get("help"):
            return f.metadata["help"]
    return ""


def nested(cls: type, name: str) -> type | None:
    """The dataclass a field holds (Optional[...] unwrapped), else None."""
    hint = typing.get_type_hints(cls)[name]
    for t in (hint, *typing.get_args(hint)):
        if dataclasses.is_dataclass(t):
            return t
    return None


def default_of(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def fmt(value) -> str:
    """A default as YAML spells it (what a user types on the command line)."""
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, (dict, list)) and not value:
        return "`{}`" if isinstance(value, dict) else "`[]`"
    return f"`{value}`" if value != "" else '`""`'  # two backticks alone would pair with the next cell's


def rows(prefix: str, options: dict[str, type]) -> list[tuple[str, str, str]]:
    """(key, default, help) for every key of a group (its option schemas, by option name), nested ones flattened."""
    names: list[str] = []
    for cls in options.values():
        names += [f.name for f in dataclasses.fields(cls) if f.name not in names and not f.metadata.get("hidden")]
    out = []
    for name in names:
        having = {opt: cls for opt, cls in options.items() if name in cls.__dataclass_fields__}
        key = f"{prefix}.{name}" if prefix else name
        first = next(iter(having.values()))
        inner = nested(first, name)
        if inner is not None:  # a node: its own help on a `key.*` row, then its keys
            out += [(f"`{key}.*`", "", help_of(first, name))] + rows(key, {"": inner})
            continue
        defaults = {opt: default_of(cls.__dataclass_fields__[name]) for opt, cls in having.items()}
        if len(options) > 1 and all(d == opt for opt, d in defaults.items()):
            default = "the option's name"
        elif len(set(map(fmt, defaults.values()))) == 1:
            default = fmt(next(iter(defaults.values())))
        else:
            default = "; ".join(f"{opt}: {fmt(d)}" for opt, d in defaults.items())
        text = help_of(first, name)
        if len(having) < len(options):
            text = f"({', '.join(having)} only) {text}"
        out.append((f"`{key}`", default, text))
    return out


def table(title: str, body: list[tuple[str, str, str]]) -> str:
    lines = [f"#### {title}", "", "| key | default | meaning |", "|---|---|---|"]
    lines += [f"| {k} | {d} | {h.replace('|', chr(92) + '|')} |" for k, d, h in body]
    return "\n".join(lines)


def tables() -> str:
    """Every key table, in the order the groups are composed."""
    parts = []
    for group, options in S.GROUP_SCHEMAS.items():
        unique = {opt: cls for opt, cls in options.items() if cls not in list(options.values())[:list(options).index(opt)]}
        title = f"`{group}.*` ({group}={'|'.join(options)})" if len(options) > 1 else f"`{group}.*`"
        parts.append(table(title, rows(group, unique if len(unique) > 1 else {"": next(iter(unique.values()))})))
    root = S.RootConfig
    for key in ROOT_SECTIONS:
        parts.append(table(f"`{key}.*`", rows(key, {"": nested(root, key)})))
    plain = [f.name for f in dataclasses.fields(root) if f.name not in S.GROUP_SCHEMAS and f.name not in ROOT_SECTIONS]
    keys = {f.name: f for f in dataclasses.fields(root)}
    parts.append(table("other keys (the root's own)",
                       [(f"`{n}`", fmt(default_of(keys[n])), help_of(root, n)) for n in plain]))
    return "\n\n".join(parts)


def render(text: str) -> str:
    """`text` (docs/config.md) with the part between the markers replaced by the generated tables."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return f"{text[:start]}\n\n{tables()}\n\n{text[end:]}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m humanline_cli.docs_gen", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if docs/config.md differs from the generated one")
    args = p.parse_args(argv)
    text = DOC.read_text()
    new = render(text)
    if args.check:
        if new != text:
            print(f"{DOC} is out of date: run python -m humanline_cli.docs_gen", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
