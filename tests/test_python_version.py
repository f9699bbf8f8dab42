"""`requires-python` is a promise pip enforces: an interpreter below it is refused at install with one clear line,
and one at or above it imports every module. So the package (and its tests) use no syntax and no standard-library
name newer than the floor, and ruff lints for that same floor.

The floor is 3.11: enum.StrEnum (every choice in schema.py) arrived in 3.11, and vLLM 0.32 (the `vllm` extra, the
online sampler on a GPU) itself requires 3.11, so a 3.10 install could never sample online anyway."""
from __future__ import annotations

import ast
import re
import sys
import tokenize
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# standard-library names by the version that added them (those a project like this one might reach for)
NEW_NAMES = {
    (3, 11): {"tomllib": None, "wsgiref.types": None,
              "enum": {"StrEnum", "ReprEnum", "verify", "EnumCheck", "member", "nonmember", "global_enum"},
              "typing": {"Self", "LiteralString", "Never", "assert_never", "assert_type", "reveal_type", "Required",
                         "NotRequired", "TypeVarTuple", "Unpack", "dataclass_transform"},
              "datetime": {"UTC"}, "asyncio": {"TaskGroup", "timeout", "timeout_at", "Runner"},
              "contextlib": {"chdir"}, "operator": {"call"}, "hashlib": {"file_digest"}},
    (3, 12): {"itertools": {"batched"}, "typing": {"override", "TypeAliasType"}},
    (3, 13): {"typing": {"ReadOnly", "TypeIs", "NoDefault"}, "warnings": {"deprecated"}, "copy": {"replace"}},
}
NEW_BUILTINS = {"ExceptionGroup": (3, 11), "BaseExceptionGroup": (3, 11)}


def _name_version(module: str, name: str | None) -> tuple[int, int] | None:
    for version, names in NEW_NAMES.items():
        if module in names and (names[module] is None or name in names[module]):
            return version
    return None


def _fstring_nests_its_own_quote(source: str) -> bool:
    """PEP 701 (3.12) lets an f-string hold a string in its own quote; 3.11 cannot parse that. Only a 3.12+
    tokenizer shows f-strings as parts (FSTRING_START), and a 3.11 one never needs to: its parser refuses them."""
    start = getattr(tokenize, "FSTRING_START", None)
    if start is None:
        return False
    quotes: list[str] = []
    for tok in tokenize.generate_tokens(iter(source.splitlines(keepends=True)).__next__):
        if tok.type == start:
            if quotes and quotes[-1] in tok.string.lstrip("rRfFbB"):
                return True
            quotes.append(tok.string.lstrip("rRfFbB"))
        elif tok.type == tokenize.FSTRING_END:
            quotes.pop()
        elif tok.type == tokenize.STRING and quotes and quotes[-1] in tok.string.lstrip("rRbBuU")[:3]:
            return True
    return False


def needs(source: str) -> dict[str, tuple[int, int]]:
    """Each use in `source` newer than 3.10, with the version it needs."""
    out: dict[str, tuple[int, int]] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for a in node.names:
                if v := _name_version(a.name, None):
                    out[f"import {a.name}"] = v
        elif isinstance(node, ast.ImportFrom) and not node.level:
            for a in node.names:
                if v := _name_version(node.module or "", a.name) or _name_version(f"{node.module}.{a.name}", None):
                    out[f"from {node.module} import {a.name}"] = v
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if v := _name_version(node.value.id, node.attr):
                out[f"{node.value.id}.{node.attr}"] = v
        elif isinstance(node, ast.Name) and node.id in NEW_BUILTINS:
            out[node.id] = NEW_BUILTINS[node.id]
        elif type(node).__name__ == "TryStar":
            out["except*"] = (3, 11)
        elif type(node).__name__ == "TypeAlias" or getattr(node, "type_params", None):
            out["type parameters / the type statement"] = (3, 12)
    if _fstring_nests_its_own_quote(source):
        out["an f-string nesting its own quote"] = (3, 12)
    return out


def _floor() -> tuple[int, int]:
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    m = re.fullmatch(r">=\s*3\.(\d+)", spec.strip())
    assert m, f"requires-python {spec!r}: expected '>=3.N'"
    return 3, int(m.group(1))


def test_the_scanner_sees_each_kind_of_newer_use():
    src = ("from enum import StrEnum\nimport tomllib\nimport datetime, itertools\nx = datetime.UTC\n"
           "y = itertools.batched\ntry:\n    pass\nexcept* ValueError:\n    raise ExceptionGroup('a', [])\n")
    assert needs(src) == {"from enum import StrEnum": (3, 11), "import tomllib": (3, 11), "datetime.UTC": (3, 11),
                          "itertools.batched": (3, 12), "except*": (3, 11), "ExceptionGroup": (3, 11)}
    assert needs("from enum import Enum\nfrom typing import Optional\nimport datetime\nd = datetime.timezone.utc\n") == {}
    if sys.version_info >= (3, 12):  # only a 3.12+ parser reads these to report them
        assert needs("type A = int\n") == {"type parameters / the type statement": (3, 12)}
        assert needs("x = f'{\"a\"}' + f\"{'b'}\"\n") == {}
        assert needs("d = {}\nx = f'{d['k']}'\n") == {"an f-string nesting its own quote": (3, 12)}


def test_requires_python_covers_every_module():
    """Every module of the package and its tests imports under the floor pip enforces."""
    floor = _floor()
    too_new = []
    for path in sorted([*(ROOT / "humanline_cli").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]):
        source = path.read_text()
        ast.parse(source, feature_version=floor)  # syntax the floor's parser lacks (a SyntaxError names the line)
        too_new += [f"{path.relative_to(ROOT)}: {use} needs {v[0]}.{v[1]}" for use, v in needs(source).items()
                    if v > floor]
    assert too_new == [], f"requires-python is >={floor[0]}.{floor[1]}"


def test_the_floor_is_what_enum_strenum_needs_and_ruff_lints_for_it():
    floor = _floor()
    assert floor == (3, 11)  # StrEnum (3.11) throughout schema.py; vLLM 0.32 requires 3.11 too
    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["target-version"]
    assert target == f"py{floor[0]}{floor[1]}"
