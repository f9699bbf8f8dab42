"""`just gpu-check` (python -m humanline_cli.bench.gpu_check [--out DIR]): the checks only a CUDA machine can
run, in a few minutes on one GPU, written to one JSON file; exit 1 if any check failed, 2 (one line)
without CUDA.

1. bf16 autocast training for dpo, kto, grpo, each plain and with humanline, on the bundled world.
2. vLLM (the GPU wheel: pip install -e '.[vllm]') against HF after an in-place weight push: the
   largest per-token log-prob difference of vLLM's greedy samples.
3. Sampling throughput, HF generate vs vLLM, on the same prompts (tokens/s).
4. FSDP2 and DDP over every visible GPU (when there are 2 or more), and a LoRA humanline run.
5. A model of a real shape (Qwen2.5-1.5B's config, random weights, no hub), bf16 autocast, gradient
   checkpointing: per objective's batch shape, with and without humanline, step time, tokens/s, MFU and
   torch.cuda.max_memory_allocated against memory.estimate (bench/step_bench.py; fails outside --tol).
Every training check is a real `humanline train` in a subprocess; each row records its command.
`--device cpu` runs only check 5, on the tiny shape (what the tests run; never a substitute for a GPU).
NOT YET RUN ON A GPU: no GPU was lent while this was written; the bounds below are first guesses.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

VLLM_MEAN_BOUND = 0.05  # accepted mean |log p_vLLM - log p_HF| per token, both bf16
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


def _vllm_checks(out: Path) -> list[dict]:
    """vLLM vs HF after a weight push, and sampling tokens/s of both, on the bundled world's policy."""
    import torch

    rows = []
    try:
        from hydra import compose, initialize_config_module

        from humanline_cli.config import resolve
        from humanline_cli.core.interfaces import SamplingParams
        from humanline_cli.core.logprobs import token_logps
        from humanline_cli.models import load_policy, load_tokenizer
        from humanline_cli.sampling.hf import HFSampler
        from humanline_cli.sampling.vllm import VLLMSampler
        from humanline_cli.train.build import make_encoder, model_paths, prepare_model, prepare_world

        with initialize_config_module(config_module="conf", version_base="1.3"):
            spec = resolve(compose("train", overrides=["backend=cuda"]))
        prepare_world(spec)  # the bundled world, built first if it is not cached
        prepare_model(spec)
        model_path, tok_path = model_paths(spec)
        tok = load_tokenizer(tok_path)
        enc = make_encoder(spec, tok)
        from humanline_cli.data.files import load_rows
        from humanline_cli.train.build import resolve_path

        rows_, _ = load_rows(resolve_path(spec.task_cfg.prompts.eval, spec), "train", 256)
        prompts = [enc.prompt_ids(r["prompt"]) for r in rows_]
        policy = load_policy(model_path, torch.device("cuda"))
        with torch.no_grad():  # move the weights away from the checkpoint so the push matters
            g = torch.Generator(device="cuda").manual_seed(0)
            for p in policy.parameters():
                p.add_(1e-2 * torch.randn(p.shape, generator=g, device="cuda"))
        vllm = VLLMSampler(model_path, tok, seed=0, gpu_memory_utilization=0.3, max_model_len=spec.train.max_length,
                           dtype="bfloat16")  # as real runs sample
        vllm.push_weights(policy)
        greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=16)
        outs = vllm.generate(prompts[:64], greedy)
        from humanline_cli.core.batches import Seqs
        from humanline_cli.data.collate import make_seqs

        seqs = make_seqs(prompts[:64], outs.token_ids, tok.pad_token_id)
        seqs = Seqs(seqs.input_ids.cuda(), seqs.attention_mask.cuda(), seqs.loss_mask.cuda())
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            hf = token_logps(policy.eval(), seqs)
        diffs = []
        for i, lps in enumerate(outs.logps):
            start = int(seqs.loss_mask[i].nonzero()[0]) - 1
            for k, lp in enumerate(lps):
                diffs.append(abs(lp - float(hf[i, start + k])))
        max_diff = max(diffs) if diffs else float("nan")
        mean_diff = sum(diffs) / len(diffs) if diffs else float("nan")
        # bf16 on both sides, different kernels: per-token log-probs agree to bf16 rounding (8 mantissa bits,
        # ~0.4% relative); a stale push (old weights) differs by the 1e-2 perturbation's effect, far above
        rows.append({"check": "vllm_vs_hf_logprobs_after_push_bf16", "ok": mean_diff <= VLLM_MEAN_BOUND,
                     "mean_abs_diff": mean_diff, "max_abs_diff": max_diff, "bound_mean": VLLM_MEAN_BOUND,
                     "tokens": len(diffs)})
        sample = SamplingParams(n=8, temperature=1.0, max_new_tokens=16, seed=1)
        speed = {}
        for name, sampler in (("hf", HFSampler(policy, tok, 2048)), ("vllm", vllm)):
            torch.cuda.synchronize()
            t = time.perf_counter()
            c = sampler.generate(prompts, sample)
            torch.cuda.synchronize()
            speed[name] = c.n_tokens / (time.perf_counter() - t)
        rows.append({"check": "sampling_tokens_per_s", "ok": True, **{k: round(v) for k, v in speed.items()},
                     "vllm_over_hf": speed["vllm"] / speed["hf"], "prompts": len(prompts), "n": 8})
        vllm.close()
    except Exception as e:  # a check that cannot run is a failed check, with its reason
        first = str(e).splitlines()[0] if str(e) else ""
        rows.append({"check": "vllm", "ok": False, "error": f"{type(e).__name__}: {first}"})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="humanline gpu-check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/gpu_check"))
    p.add_argument("--device", default="cuda", help="cuda (every check) or cpu (the step checks on --shape tiny)")
    p.add_argument("--shape", default=None, help="step-check model shape: qwen2.5-1.5b (cuda default) or tiny")
    p.add_argument("--tokens", type=int, default=None, help="tokens per sequence in the step checks")
    p.add_argument("--tol", type=float, default=0.25, help="peak memory vs the estimate, relative")
    p.add_argument("--lr", type=float, default=1e-6, help="AdamW lr of the step checks")
    args = p.parse_args(argv)
    import torch

    from humanline_cli.bench.step_bench import SHAPES, run

    cpu = args.device == "cpu"
    if not cpu and not torch.cuda.is_available():
        print("humanline: error: gpu-check needs a CUDA device (torch.cuda.is_available() is False on this machine)",
              file=sys.stderr)
        return 2
    shape = args.shape or ("tiny" if cpu else "qwen2.5-1.5b")
    if shape not in SHAPES:
        print(f"humanline: error: gpu-check --shape {shape!r}: one of {', '.join(SHAPES)}", file=sys.stderr)
        return 2
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    n_gpu = 0 if cpu else torch.cuda.device_count()
    results = {"device": "cpu" if cpu else torch.cuda.get_device_name(0), "gpus": n_gpu, "torch": torch.__version__,
               "checks": []}
    checks = results["checks"]
    try:
        checks.extend(run(shape, "cpu" if cpu else "cuda", tokens=args.tokens or (64 if cpu else 1024),
                          micro=2 if cpu else 4, n=4 if cpu else 8, tol=args.tol, lr=args.lr))
    except Exception as e:  # a check that cannot run is a failed check, with its reason
        first = str(e).splitlines()[0] if str(e) else ""
        checks.append({"check": "step", "ok": False, "error": f"{type(e).__name__}: {first}"})
    if cpu:
        return _finish(results, out)
    for objective in ("dpo", "kto", "grpo"):
        for hl in ("false", "true"):
            checks.append(_train(out, f"bf16_{objective}_hl-{hl}", ["backend=cuda", f"objective={objective}",
                                                                   f"humanline={hl}"]))
    checks.append(_train(out, "bf16_lora_humanline", ["backend=cuda", "objective=dpo", "humanline=true",
                                                      "model.lora.r=8"]))
    checks.append(_train(out, "bf16_online_vllm", ["backend=cuda", "objective=grpo", "data=online", "sampler=vllm",
                                                   "data.prompts_per_round=64"]))
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
    checks.extend(_vllm_checks(out))
    return _finish(results, out)


def _finish(results: dict, out: Path) -> int:
    checks = results["checks"]
    results["ok"] = bool(checks) and all(c["ok"] for c in checks)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2) + "\n")
    for c in checks:
        print(f"{'ok  ' if c['ok'] else 'FAIL'} {c['check']}: " + ", ".join(
            f"{k}={v}" for k, v in c.items() if k not in ("check", "ok", "command", "wall_clock_s")))
    print(f"wrote {out / 'gpu_check.json'}")
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "offline")
    sys.exit(main())
