"""docs/scaling.md's "A lent GPU, used at once" script, kept runnable though no GPU is here: every module, test
file, marker and gpu-check option it names exists, its stage timeouts fit one 10-minute call, and its last step
(the one JSON) runs on the outputs of a lease whose last stage was stopped by its timeout. Also gpu-check's rows
written as they come, which that stopped stage relies on."""
from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "humanline_cli" / "docs" / "scaling.md"
TITLE = "## A lent GPU, used at once"


def _script() -> str:
    text = DOC.read_text()
    assert text.count(TITLE) == 1
    section = text[text.index(TITLE):]
    assert not re.search(r"^## ", section[len(TITLE):], flags=re.M), "the lease section is the last one"
    (block,) = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    return block


def _stages(script: str) -> list[tuple[str, int, list[str]]]:
    """(name, timeout s, command words) of each `S name timeout command...` line."""
    return [(w[1], int(w[2]), w[3:]) for w in (shlex.split(line) for line in script.splitlines())
            if w and w[0] == "S"]


def _python_step(script: str) -> str:
    (body,) = re.findall(r"python3 - \$O <<'E'\n(.*?)\nE\n", script, flags=re.S)
    return body


def test_everything_the_script_names_exists():
    from humanline_cli.lab import gpu_check

    stages = _stages(_script())
    assert [n for n, _, _ in stages] == ["step", "tests", "train"]
    assert sum(t for _, t, _ in stages) <= 540  # one device call is at most 600 s: the install and the JSON after
    for name, _, words in stages:
        assert words[:2] == ["python3", "-m"], words
        module = words[2]
        assert module == "pytest" or importlib.util.find_spec(module) is not None, module
        if module == "humanline_cli.lab.gpu_check":
            args = gpu_check._parser().parse_args([w.replace("$O", "/tmp/o") for w in words[3:]])
            assert gpu_check._asked(args, cpu=False) == {name}  # a valid group: the stage's own
        if module == "pytest":
            assert (ROOT / words[words.index("gpu") + 1]).is_file()
            markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
            assert any(m.startswith("gpu:") for m in markers)
    assert ".whl/*.whl" in _script() and "HUMANLINE_CACHE=$PWD/.wcache" in _script()


def test_its_json_step_reads_a_lease_whose_last_stage_timed_out(tmp_path):
    o = tmp_path / "out"
    (o / "step").mkdir(parents=True)
    (o / "train").mkdir()
    (o / "stages").write_text("step 0 151\ntests 1 88\ntrain 124 240\n")
    (o / "step" / "gpu_check.json").write_text(json.dumps({"ok": True, "checks": [{"check": "step_dpo_hl-false",
                                                                                     "ok": True}]}))
    (o / "train" / "gpu_check.json").write_text(json.dumps({"partial": True, "checks": [{"check": "bf16_dpo_hl-false",
                                                                                         "ok": True}]}))
    (o / "tests.xml").write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="3">'
        '<testcase classname="tests.test_cuda" name="test_a_bf16_step" time="41.5"/>'
        '<testcase classname="tests.test_cuda" name="test_nccl" time="0.01">'
        '<failure message="AssertionError: needs 2 GPUs, this machine has 1">trace</failure></testcase>'
        '<testcase classname="tests.test_cuda" name="test_push" time="0.2"><error message="boom">x</error></testcase>'
        '</testsuite></testsuites>')
    (o / "log").write_text("x" * 5000 + "the end")
    r = subprocess.run([sys.executable, "-", str(o)], input=_python_step(_script()), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    lease = json.loads((o / "lease.json").read_text())
    assert lease["stages"] == {"step": {"rc": 0, "seconds": 151, "timed_out": False},
                               "tests": {"rc": 1, "seconds": 88, "timed_out": False},
                               "train": {"rc": 124, "seconds": 240, "timed_out": True}}
    assert lease["tests"] == [
        {"test": "test_a_bf16_step", "seconds": 41.5, "outcome": "passed", "message": ""},
        {"test": "test_nccl", "seconds": 0.01, "outcome": "failure",
         "message": "AssertionError: needs 2 GPUs, this machine has 1"},
        {"test": "test_push", "seconds": 0.2, "outcome": "error", "message": "boom"}]
    assert lease["gpu_check"]["train"]["partial"] is True and lease["gpu_check"]["step"]["ok"] is True
    assert lease["nvidia_smi"] == "" and lease["log_tail"].endswith("the end") and len(lease["log_tail"]) == 4000


def test_gpu_check_writes_each_row_as_it_comes(tmp_path, monkeypatch):
    """A stage stopped by its timeout keeps its finished rows: each `humanline train` row is in the JSON before the
    next starts (torch.cuda and the runs faked: no GPU here)."""
    import torch

    from humanline_cli.lab import gpu_check

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "fake")
    monkeypatch.setattr(gpu_check, "missing", lambda module: module == "vllm")
    on_disk = []

    def train(out, name, args, timeout=600):
        path = tmp_path / "gpu_check.json"
        on_disk.append(len(json.loads(path.read_text())["checks"]) if path.exists() else 0)
        return {"check": name, "ok": True}

    monkeypatch.setattr(gpu_check, "_train", train)
    monkeypatch.setattr(gpu_check, "_finish", lambda results, out: 0)  # as if stopped before the summary
    assert gpu_check.main(["--out", str(tmp_path), "--only", "train"]) == 0
    assert on_disk == list(range(len(on_disk))) and len(on_disk) == 9  # 4 objectives x 2, then LoRA
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["partial"] is True and len(saved["checks"]) == 11  # + the vLLM row and the one-GPU DDP/FSDP row
