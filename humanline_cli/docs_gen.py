"""docs/config.md's key tables, generated from the schema (humanline_cli/schema.py): every key with its default and
its help, as its dataclass field declares them (`schema.knob`), so the reference cannot drift from the code.

`python -m humanline_cli.docs_gen` rewrites the part of docs/config.md between the two markers; `--check` exits 1
when the committed file differs from what it would write (tests/config/test_config_docs.py compares the same).
A group gets one table: a key that only some options' schemas have says which, and where the options' defaults
differ (their schemas', or what their conf/<group>/<option>.yaml sets), the most common one comes first and each
other option's after it.
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
import sys
import typing
from pathlib import Path

from humanline_cli import schema as S
from humanline_cli.mdtable import md_table

DOC = Path(__file__).resolve().parent / "docs" / "config.md"
CONF = Path(__file__).resolve().parents[1] / "conf"
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


def option_files(group: str) -> dict[str, dict]:
    """option -> what conf/<group>/<option>.yaml sets (its defaults list left out), for every option of the group."""
    import yaml

    def set_keys(node):  # `???` merged over a schema's value leaves that value (OmegaConf's merge): not set
        return {k: set_keys(v) if isinstance(v, dict) else v for k, v in node.items() if v != "???"}

    out = {}
    for f in sorted((CONF / group).glob("*.yaml")):
        data = yaml.safe_load(f.read_text()) or {}
        out[f.stem] = set_keys({k: v for k, v in data.items() if k != "defaults"})
    return out


def cell(defaults: dict[str, object]) -> str:
    """A key's default per option: one value when all agree, "the option's name" when each option's is its name,
    else the most common value followed by each option that differs (`opt: value`)."""
    shown = {opt: fmt(d) for opt, d in defaults.items()}
    if len(defaults) > 1 and all(d == opt for opt, d in defaults.items()):
        return "the option's name"
    counts = list(shown.values())
    common = max(dict.fromkeys(counts), key=counts.count)
    if counts.count(common) == 1 and len(counts) > 1:
        return "; ".join(f"{opt}: {v}" for opt, v in shown.items())
    return "; ".join([common, *(f"{opt}: {v}" for opt, v in shown.items() if v != common)])


def rows(prefix: str, options: dict[str, type], values: dict[str, dict] | None = None) -> list[tuple[str, str, str]]:
    """(key, default, help) for every key of a group (its schema per option, by option name; `values`: what each
    option's file sets, over the schema's defaults), nested ones flattened."""
    values = values or {opt: {} for opt in options}
    names: list[str] = []
    for cls in dict.fromkeys(options.values()):
        names += [f.name for f in dataclasses.fields(cls) if f.name not in names and not f.metadata.get("hidden")]
    out = []
    for name in names:
        having = {opt: cls for opt, cls in options.items() if name in cls.__dataclass_fields__}
        key = f"{prefix}.{name}" if prefix else name
        first = next(iter(having.values()))
        inner = nested(first, name)
        if inner is not None:  # a node: its own help on a `key.*` row, then its keys (where an option has the node)
            present = {opt: cls for opt, cls in having.items() if values[opt].get(name) is not None
                       or default_of(cls.__dataclass_fields__[name]) is not None}
            below = {opt: values[opt].get(name) or {} for opt in present}
            out += [(f"`{key}.*`", "", help_of(first, name))] + rows(key, {opt: inner for opt in present}, below)
            continue
        defaults = {opt: values[opt].get(name, default_of(cls.__dataclass_fields__[name])) for opt, cls in having.items()}
        text = help_of(first, name)
        if len(having) < len(options):
            text = f"({', '.join(having)} only) {text}"
        out.append((f"`{key}`", cell(defaults), text))
    return out


def table(title: str, body: list[tuple[str, str, str]]) -> str:
    return "\n".join([f"#### {title}", "", *md_table(["key", "default", "meaning"], body)])


def tables() -> str:
    """Every key table, in the order the groups are composed; each group's keys at every option's value."""
    parts = []
    for group, schemas in S.GROUP_SCHEMAS.items():
        files = option_files(group)
        options = {opt: schemas[opt] if opt in schemas else next(iter(schemas.values())) for opt in files}
        title = f"`{group}.*` ({group}={'|'.join(options)})" if len(schemas) > 1 else f"`{group}.*`"
        parts.append(table(title, rows(group, options, files)))
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
