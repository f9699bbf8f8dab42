"""Where a run's code came from, read when the run starts: the git commit of the package's checkout, whether the
checkout had uncommitted changes (tracked edits or untracked files; ignored ones such as runs/ do not count), and
the start time. `started.json` in the run dir keeps the first attempt's record; a resumed run keeps it and its
summary.json says which commit the last attempt ran on, so "ran on commit X" can be checked against the time a
registration was committed."""
from __future__ import annotations

import contextlib
import json
import platform
import subprocess
from datetime import UTC, datetime
from pathlib import Path

from humanline_cli.atomic import write_json_atomic

FILE = "started.json"


def _git(*args: str) -> str | None:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def code_state() -> dict:
    """{"git_commit", "git_dirty", "started_at"} now; commit and dirty None outside a git checkout."""
    commit = (_git("rev-parse", "HEAD") or "").strip() or None
    status = _git("status", "--porcelain") if commit else None
    return {"git_commit": commit, "git_dirty": None if status is None else bool(status.strip()),
            "started_at": datetime.now(UTC).isoformat(timespec="seconds")}


def machine() -> dict:
    """What the run's numbers depend on beyond the code: the CPU model, the ATen CPU kernel set torch chose, the
    CUDA device (None on CPU) and torch's intra-op threads."""
    import torch

    cpu = None
    with contextlib.suppress(OSError):  # no /proc off Linux: platform's name instead
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), None)
    return {"cpu": cpu or platform.processor() or None, "cpu_kernels": torch.backends.cpu.get_cpu_capability(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "torch_threads": torch.get_num_threads()}


def record_start(run_dir: Path, began: dict, fresh: bool) -> dict:
    """The run's start record: `began` (code_state at this attempt's start), written to started.json when the
    run starts from step 0 or has none; a resumed run keeps its first attempt's."""
    path = Path(run_dir) / FILE
    if not fresh and path.is_file():
        try:
            return json.loads(path.read_text())
        except ValueError:
            pass  # a torn file from a crash: this attempt's record replaces it
    write_json_atomic(path, began)
    return began


def read_start(run_dir: Path) -> dict:
    """started.json's record, {} when the run has none (a rank other than 0, a run dir from before it existed)."""
    try:
        return json.loads((Path(run_dir) / FILE).read_text())
    except (OSError, ValueError):
        return {}
