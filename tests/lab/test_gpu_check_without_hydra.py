"""`just gpu-check` on a GPU machine with torch and transformers but no Hydra, omegaconf, datasets, wandb or
vLLM: its torch-only rows (the step checks) run, the rows that need `humanline train` or vLLM say they
were skipped and why, and the check exits 1 (a row asked for did not run) unless `--only step` leaves them
out. A subprocess blocks those imports (sys.modules[name] = None makes any import of them fail) and runs the
step rows on CPU, then the CUDA path with torch.cuda faked (no GPU here)."""
from __future__ import annotations

import json
import subprocess
import sys

from humanline_cli.core.objectives import OBJECTIVES

SCRIPT = r"""
import json, sys
BLOCKED = ("hydra", "omegaconf", "datasets", "wandb", "vllm")
for name in BLOCKED:
    sys.modules[name] = None
from humanline_cli.lab import gpu_check, step_bench
assert all(gpu_check.missing(name) for name in BLOCKED) and not gpu_check.missing("torch")
out = sys.argv[1]
code = gpu_check.main(["--device", "cpu", "--out", out + "/cpu", "--tokens", "16"])
import torch
torch.cuda.is_available = lambda: True  # the CUDA path's rows past the step checks, on a CPU machine
torch.cuda.device_count = lambda: 1
torch.cuda.get_device_name = lambda i=0: "fake"
step_bench.run = lambda *a, **k: [{"check": "step_stub", "ok": True}]
gpu_check.run = step_bench.run
code_cuda = gpu_check.main(["--out", out + "/cuda"])
code_only = gpu_check.main(["--out", out + "/only", "--only", "step"])
code_bad = gpu_check.main(["--out", out + "/bad", "--only", "step,sft"])
print(json.dumps({"cpu": code, "cuda": code_cuda, "only": code_only, "bad": code_bad,
                  "imported": sorted(n for n in BLOCKED if sys.modules.get(n) is not None)}))
"""


def test_gpu_check_runs_its_torch_rows_without_hydra_or_vllm(tmp_path):
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res == {"cpu": 0, "cuda": 1, "only": 0, "bad": 2, "imported": []}, r.stdout[-3000:]
    steps = f"{2 * len(OBJECTIVES)} of {2 * len(OBJECTIVES)} rows ran, 0 skipped"  # each objective, humanline off/on
    assert f"{steps}\n" in r.stdout
    assert ("1 of 3 rows ran, 2 skipped; asked for but not run: vllm, training_runs (install what each row names, "
            "or leave its group out with --only)\n") in r.stdout
    assert "1 of 1 rows ran, 0 skipped\n" in r.stdout
    assert "humanline: error: gpu-check --only 'step,sft': a comma-separated subset of step,vllm,train\n" in r.stderr
    cpu = json.loads((tmp_path / "cpu" / "gpu_check.json").read_text())
    assert sorted(c["check"] for c in cpu["checks"]) == sorted(
        f"step_{o}_hl-{h}" for o in OBJECTIVES for h in ("false", "true"))
    assert all(c["ok"] and c["tokens_per_s"] > 0 and c["loss"] > 0 for c in cpu["checks"])
    assert cpu["summary"] == steps and cpu["ok"]
    cuda = json.loads((tmp_path / "cuda" / "gpu_check.json").read_text())
    assert (cuda["summary"], cuda["ok"]) == ("1 of 3 rows ran, 2 skipped", False)
    assert cuda["checks"] == [
        {"check": "step_stub", "ok": True},
        {"check": "vllm", "ok": False, "skipped": "vllm not installed"},
        {"check": "training_runs", "ok": False,
         "skipped": "hydra not installed (bf16 runs, LoRA, DDP/FSDP and vLLM rows run `humanline train`)"}]
    only = json.loads((tmp_path / "only" / "gpu_check.json").read_text())
    assert (only["checks"], only["summary"], only["ok"]) == ([{"check": "step_stub", "ok": True}],
                                                            "1 of 1 rows ran, 0 skipped", True)
