"""The package's architecture, enforced: imports (top-level and deferred ones inside functions alike)
form no cycle between modules, and point down the layers only. A layer may import from layers below
it and from its own; never from above.

    lab            the study's own instruments (the cost model and its constants, GPU and memory checks, study
                   figures), each run as `python -m humanline_cli.lab.NAME`: it may import the product; nothing in
                   the product imports it
    cli, docs_gen  the commands: parse, validate once, dispatch; docs/config.md's key tables from the schema
    report, bench  read finished runs / time the training step against TRL
    train          build the parts of a run, the loop, checkpoints, run dirs, launch
    sources, eval  offline and online unit sources; the evaluator (generate + judge)
    world, rewards the bundled laptop world; verifiers, reward models, the LLM judge
    data, sampling files and collation; HF and vLLM samplers
    backend, config, schema, memory, models, machine, precision   devices and ranks, the typed spec and its schemas,
                   the memory estimate, loading, the machine a run starts on (or a device profile of one), the
                   CPU's measured precision
    core           the method: the objectives (each with its config, loss, units and batch), humanline, the
                   reference, log-probs, batches
    errors, atomic, mdtable   leaves (mdtable: the one pipe-table writer of the docs and the report)
"""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "humanline_cli"

LAYERS = {
    "errors": 0, "atomic": 0, "mdtable": 0,
    "core": 1,
    "backend": 2, "config": 2, "schema": 2, "memory": 2, "models": 2, "machine": 2, "precision": 2,
    "data": 3, "sampling": 3,
    "world": 4, "rewards": 4,
    "sources": 5, "eval": 5,
    "train": 6,
    "report": 7, "bench": 7,
    "cli": 8, "__main__": 8, "__init__": 8, "docs_gen": 8,
    "lab": 9,
}


def _module(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module(p): p for p in sorted(PKG.rglob("*.py"))}


def _imports(path: Path, mod: str, known: set[str]) -> set[str]:
    """Every project module `path` imports, wherever the import statement stands."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from pkg import name`: name is a module when one of that name exists
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != mod and name != "humanline_cli":
                out.add(name)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: _imports(p, m, known) for m, p in mods.items()}


def _layer(mod: str) -> int:
    top = mod.split(".")[1] if "." in mod else "__init__"
    assert top in LAYERS, f"{mod}: a new top-level module or folder needs a layer in LAYERS"
    return LAYERS[top]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_import_walker_sees_deferred_and_relative_imports(tmp_path):
    pkg = tmp_path / "humanline_cli"
    (pkg / "core").mkdir(parents=True)
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text("def f():\n    from . import b\n    from humanline_cli.train import job\n")
    known = {"humanline_cli.core", "humanline_cli.core.a", "humanline_cli.core.b", "humanline_cli.train.job"}
    assert _imports(pkg / "core" / "a.py", "humanline_cli.core.a", known) == {"humanline_cli.core.b",
                                                                             "humanline_cli.train.job"}
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_imports_point_down_the_layers():
    graph = _graph()
    upward = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if _layer(d) > _layer(m))
    assert upward == []


def test_nothing_outside_lab_imports_lab():
    """The lab studies the product from outside: a pip install runs it, the product never needs it."""
    inside = [f"{m} -> {d}" for m, deps in _graph().items() for d in deps
              if d.startswith("humanline_cli.lab") and not m.startswith("humanline_cli.lab")]
    assert inside == []
    assert {m for m in _modules() if m.startswith("humanline_cli.lab.")} >= {
        "humanline_cli.lab.predict", "humanline_cli.lab.constants", "humanline_cli.lab.gpu_check",
        "humanline_cli.lab.memory_check", "humanline_cli.lab.regime_map", "humanline_cli.lab.frontier"}


def test_no_two_modules_share_a_name():
    """One name, one module: `build.py` in three folders (or `base.py` in two) is a guess for the reader."""
    stems: dict[str, list[str]] = {}
    for mod in _modules():
        leaf = mod.rsplit(".", 1)[-1]
        if mod != "humanline_cli" and not (PKG / Path(*mod.split(".")[1:])).is_dir() and leaf != "__main__":
            stems.setdefault(leaf, []).append(mod)
    assert {k: v for k, v in stems.items() if len(v) > 1} == {}


def test_the_package_has_no_test_hook():
    """Faults are injected by the tests (tests/faults/), never read by the package."""
    hits = [f"{p.relative_to(PKG)}:{i}" for p in sorted(PKG.rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if "HUMANLINE_TEST_" in line]
    assert hits == []


def test_tests_share_code_through_helpers_only():
    """Tests mirror the package (tests/<folder>/ for humanline_cli/<folder>/, plus config/, e2e/, helpers/ and
    faults/), and a test file imports tests/helpers/, never another test module or conftest (fixtures come from
    conftest.py by name)."""
    tests = Path(__file__).resolve().parent
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders - {p.name for p in PKG.iterdir() if p.is_dir()} <= {"config", "e2e", "helpers", "faults"}
    bad = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                leaf = name.rsplit(".", 1)[-1]
                if leaf == "conftest" or leaf.startswith("test_") or name in ("numerics", "fake_cuda_vllm"):
                    bad.append(f"{path.relative_to(tests)}:{node.lineno} imports {name}")
    assert bad == []
