"""A full disk while an online run appends its samples.jsonl (synchronous and asynchronous rounds): one error
line naming the file and saying what failed.json got, exit 2, and failed.json as the robustness doc promises.
The disk is filled by an OSError(ENOSPC) injected into the real CLI process (any user can run it)."""
from __future__ import annotations

import json
import sys

import pytest

from tests.helpers.cli import FAST, TINY_WORLD

ONLINE = ["train", *TINY_WORLD, *FAST, "objective=grpo", "data=online", "data.prompts_per_round=8", "data.n=4",
          "data.max_new_tokens=6", "train.checkpoint_every=0", "train.save_model=false"]

# the real `humanline` entry point, with every append to a samples.jsonl failing as a full disk does
FULL_SAMPLES = """
import builtins, errno, os, sys
real_open = builtins.open
def full_open(file, mode="r", *a, **k):
    if str(file).endswith("samples.jsonl") and "a" in mode:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real_open(file, mode, *a, **k)
builtins.open = full_open
from humanline_cli.cli.main import main
sys.argv = ["humanline", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize("rounds", [[], ["data.async_lag=1", "data.async_worker=inline"]], ids=["sync", "async"])
def test_full_disk_at_samples_jsonl_names_the_file_and_writes_failed_json(cache_dir, tmp_path, rounds):
    import subprocess

    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-c", FULL_SAMPLES, *ONLINE, *rounds, f"hydra.run.dir={run}"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("humanline: error:")]
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(errors) == 1, r.stderr[-3000:]
    assert errors[0] == (f"humanline: error: run failed ({run}): cannot write {run / 'samples.jsonl'}: No space left "
                         f"on device; failed.json written")
    failed = json.loads((run / "failed.json").read_text())
    assert failed["status"] == "failed"
    assert failed["error"] == f"RunFailed: cannot write {run / 'samples.jsonl'}: No space left on device"
    assert not (run / "summary.json").exists()


def test_samples_writer_full_disk_is_one_line_naming_the_file(tmp_path, monkeypatch):
    """The writer alone: the OSError becomes RunFailed naming samples.jsonl (what the job reports)."""
    import builtins
    import errno
    import os
    from types import SimpleNamespace

    from humanline_cli.errors import RunFailed
    from humanline_cli.sources.online import OnlineSource

    path = tmp_path / "samples.jsonl"
    src = SimpleNamespace(samples_path=path, round=3)
    OnlineSource._write_samples(src, ["p"], ["c"], [2], [0.5], {})
    assert json.loads(path.read_text()) == {"round": 3, "prompt": "p", "completion": "c", "tokens": 2, "score": 0.5}
    real_open = builtins.open

    def full(file, mode="r", *a, **k):
        f = real_open(file, mode, *a, **k)
        f.write = lambda text: (_ for _ in ()).throw(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        return f

    monkeypatch.setattr(builtins, "open", full)
    with pytest.raises(RunFailed) as e:
        OnlineSource._write_samples(src, ["p"], ["c"], [2], [0.5], {})
    assert str(e.value) == f"cannot write {path}: No space left on device"
