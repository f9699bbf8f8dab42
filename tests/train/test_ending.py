"""One path for an ending run, enforced on the package's source: failed.json has one writer
(failures.write_failed), SIGINT is set to ignored in one place (errors.ignore_ctrl_c), and context managers
(StopSignal among them) are entered with `with`, never by calling __enter__ by hand outside another context
manager's own __enter__."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "humanline_cli"
WRITERS = {"write_json_atomic", "write_text_atomic", "write_text", "write_bytes", "open"}


def _name(node: ast.AST) -> str:
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def _functions(tree: ast.AST):
    """(enclosing function name, node) for every node ('' at module level)."""
    def walk(node, where):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else where
            yield inner, child
            yield from walk(child, inner)
    yield from walk(tree, "")


def failed_json_writes(source: str) -> list[str]:
    """Calls that write a path naming failed.json (the literal or failures.FAILED_JSON)."""
    found = []
    for _, node in _functions(ast.parse(source)):
        if isinstance(node, ast.Call) and _name(node.func) in WRITERS:
            names = {n.value for n in ast.walk(node) if isinstance(n, ast.Constant)} | {
                _name(n) for n in ast.walk(node)}
            if "failed.json" in names or "FAILED_JSON" in names:
                found.append(ast.unparse(node))
    return found


def sigint_ignored(source: str) -> list[str]:
    """Functions that set SIGINT's handler to SIG_IGN."""
    return [where for where, node in _functions(ast.parse(source)) if isinstance(node, ast.Call)
            and _name(node.func) == "signal" and [_name(a) for a in node.args] == ["SIGINT", "SIG_IGN"]]


def entered_by_hand(source: str) -> list[str]:
    """`x.__enter__()` outside a context manager's own __enter__ (which may delegate to another)."""
    return [ast.unparse(node) for where, node in _functions(ast.parse(source)) if isinstance(node, ast.Call)
            and _name(node.func) == "__enter__" and where != "__enter__"]


def _package() -> dict[str, str]:
    return {str(p.relative_to(PKG)): p.read_text() for p in sorted(PKG.rglob("*.py"))}


def test_the_finders_find_what_they_look_for():
    src = ("def f(run_dir, rec):\n    write_json_atomic(Path(run_dir) / 'failed.json', rec)\n"
           "    signal.signal(signal.SIGINT, signal.SIG_IGN)\n    stop = StopSignal().__enter__()\n"
           "class C:\n    def __enter__(self):\n        self.bar.__enter__()\n")
    assert failed_json_writes(src) == ["write_json_atomic(Path(run_dir) / 'failed.json', rec)"]
    assert sigint_ignored(src) == ["f"]
    assert entered_by_hand(src) == ["StopSignal().__enter__()"]
    assert failed_json_writes("json.loads((run_dir / 'failed.json').read_text())") == []  # a read


def test_failed_json_has_one_writer():
    writes = {f: w for f, src in _package().items() if (w := failed_json_writes(src))}
    assert writes == {}  # failures.write_failed writes `path`, built from FAILED_JSON outside the call
    from humanline_cli.train import failures

    assert "FAILED_JSON" in ast.unparse(next(n for n in ast.walk(ast.parse(_package()["train/failures.py"]))
                                             if isinstance(n, ast.FunctionDef) and n.name == "write_failed"))
    assert failures.FAILED_JSON == "failed.json"


def test_sigint_is_ignored_in_one_place():
    places = {f: w for f, src in _package().items() if (w := sigint_ignored(src))}
    assert places == {"errors.py": ["ignore_ctrl_c"]}


def test_no_context_manager_is_entered_by_hand():
    assert {f: w for f, src in _package().items() if (w := entered_by_hand(src))} == {}


def test_write_failed_writes_the_record_into_an_existing_run_dir_only(tmp_path):
    import json

    from humanline_cli.train.failures import write_failed

    record = {"status": "failed", "error": "RunFailed: loss is NaN", "wall_clock_s": {"train": 1.5}}
    assert write_failed(tmp_path, record) is None
    assert json.loads((tmp_path / "failed.json").read_text()) == record
    assert write_failed(tmp_path / "never_made", record) is None  # the job failed before making its dir
    assert not (tmp_path / "never_made").exists()
