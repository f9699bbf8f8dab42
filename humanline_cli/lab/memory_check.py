"""`just memory-check` (python -m humanline_cli.lab.memory_check): memory.estimate against the measured peak RSS
of `--nproc` gloo ranks (or one process) loading a random-weight Llama with the trainer's own parts and running
DPO-shaped steps (docs/scaling.md). Measured = peak RSS (sampled every ms) minus the RSS before the weights load;
glibc's MALLOC_MMAP_THRESHOLD_ is fixed unless set, so RSS follows the live tensors. Writes --out; exit 1 when a
ratio is outside [1 - tol, 1 + tol] or sharded loading does not peak below the full path.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from humanline_cli.lab.step_bench import GB, build, dpo_steps
from humanline_cli.memory import rss_bytes


class PeakRSS:
    """Samples this process's RSS every `period` seconds in a thread; `mark()` starts a new phase."""

    def __init__(self, period: float = 0.001):
        self.period, self.peak, self._stop = period, rss_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.period)

    def mark(self) -> int:
        peak = max(self.peak, rss_bytes())
        self.peak = rss_bytes()
        return peak

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _loader(args, dist, fsdp: bool):
    import torch

    from humanline_cli.backend import shard_model, wrap_policy
    from humanline_cli.core.reference import build_reference
    from humanline_cli.models import load_policy

    prepare = ((lambda m: m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}))
               if args.gradient_checkpointing else None)

    def load(how: str):
        if fsdp and how == "sharded":
            from humanline_cli.train.sharded_load import load_policy_sharded, sharded_reference

            policy = load_policy_sharded(args.model, torch.device("cpu"), torch.float32, shard_model, prepare)
            built = sharded_reference(policy, torch.float32, torch.device("cpu"), shard_model)
            return policy, build_reference(policy, lora=False, moving=True, cache=False, built=built)
        policy = load_policy(args.model, torch.device("cpu"))
        if prepare is not None:
            prepare(policy)
        reference = build_reference(policy, lora=False, moving=True, cache=False, shard=shard_model if fsdp else None)
        return wrap_policy(policy, "fsdp" if fsdp else "single", dist, torch.device("cpu")), reference

    return load


def _write_report(args, config, dist, strategy: str, n: int, t: int, out: dict) -> None:
    from humanline_cli.memory import estimate

    kw = dict(seqs_per_micro=n, max_length=t, strategy=strategy, ranks=dist.world_size, activation_bytes=4,
              gradient_checkpointing=args.gradient_checkpointing)
    est = estimate(config, **kw, loading="full" if args.loading == "full" else "sharded")
    full = estimate(config, **kw, params=est.params, loading="full")
    if dist.enabled:
        import torch.distributed as tdist

        rows = [None] * dist.world_size
        tdist.all_gather_object(rows, out)
        tdist.destroy_process_group()
    else:
        rows = [out]
    if dist.rank == 0:
        report = {"model": {"params": est.params, "hidden": config.hidden_size, "layers": config.num_hidden_layers,
                            "vocab": config.vocab_size, "intermediate": config.intermediate_size},
                  "ranks": dist.world_size, "strategy": strategy, "seqs_per_micro": n, "tokens": t,
                  "gradient_checkpointing": args.gradient_checkpointing, "loading": args.loading,
                  "estimate_gib": {k: getattr(est, k) / GB for k in
                                   ("policy", "grads", "optimizer", "reference", "activations", "transient",
                                    "loading", "training", "total")} | {"loading_full": full.loading / GB},
                  "measured": rows}
        Path(args.json).write_text(json.dumps(report, indent=1))


def rank_main(args) -> dict:
    import gc

    import torch
    from transformers import AutoConfig

    from humanline_cli.backend import init_distributed
    from humanline_cli.core.batches import Seqs

    torch.set_num_threads(1)
    dist = init_distributed("cpu", 600)
    strategy = "fsdp" if dist.enabled else "single"
    config = AutoConfig.from_pretrained(args.model)
    torch.manual_seed(1234 + dist.rank)
    n, t = args.seqs, args.tokens
    ids = torch.randint(0, config.vocab_size, (n, t))
    seqs = Seqs(ids, torch.ones_like(ids), torch.ones_like(ids, dtype=torch.bool))
    load = _loader(args, dist, strategy == "fsdp")

    meter = PeakRSS()

    def loaded(how: str):  # (model, reference, the loading's peak over the RSS before it)
        gc.collect()
        meter.mark()
        base = rss_bytes()
        model, reference = load(how)
        gc.collect()
        return model, reference, meter.mark() - base, base

    loading_full = None
    if args.loading == "both":  # the full path first, measured and freed, then the sharded one that trains
        *_, loading_full, _ = loaded("full")
    model, reference, loading, base = loaded("full" if args.loading == "full" else "sharded")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    steps = [round(s, 2) for s in dpo_steps(model, reference, opt, seqs, args.steps, micro=args.micro, dist=dist)[0]]
    training = meter.mark() - base
    meter.stop()
    out = {"rank": dist.rank, "loading_gib": loading / GB,
           "loading_full_gib": loading_full / GB if loading_full is not None else None, "training_gib": training / GB,
           "peak_gib": max(loading, training) / GB, "step_s": steps}
    _write_report(args, config, dist, strategy, n, t, out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="humanline memory-check", description=__doc__.split("\n\n")[0])
    for flag, default, what in (("hidden", 512, None), ("layers", 8, None), ("vocab", 32000, None), ("inter", 1408, None),
                                ("heads", 8, None), ("kv-heads", 8, None), ("seqs", 4, "sequences per micro-batch"),
                                ("tokens", 256, "tokens per sequence"), ("steps", 2, None),
                                ("micro", 2, "micro-batches per step"), ("nproc", 2, "gloo ranks (FSDP2); 1 = one process")):
        p.add_argument(f"--{flag}", type=int, default=default, help=what)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--loading", choices=("full", "sharded", "both"), default="both",
                   help="full: every rank loads the whole model, then shards; sharded: meta-device build, each rank "
                        "reads its own shards; both: full measured, freed, then sharded (which trains)")
    p.add_argument("--tol", type=float, default=0.25)
    p.add_argument("--out", default="runs/memory_check/memory_check.json")
    for internal in ("--rank-of", "--model", "--json"):  # a rank's own arguments
        p.add_argument(internal, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_of is not None:
        rank_main(args)
        return 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="humanline-memcheck-") as tmp:
        model = Path(tmp) / "model"
        from transformers import LlamaConfig

        build(LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.inter,
                          num_hidden_layers=args.layers, num_attention_heads=args.heads,
                          num_key_value_heads=args.kv_heads, tie_word_embeddings=False, max_position_embeddings=4096),
              "cpu").save_pretrained(model, safe_serialization=True)
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            port = free.getsockname()[1]
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(args.nproc),
                   OMP_NUM_THREADS="1")
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
        json_path = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "humanline_cli.lab.memory_check", "--model", str(model), "--json",
               str(json_path), *(argv if argv is not None else sys.argv[1:])]
        procs = [subprocess.Popen([*cmd, "--rank-of", str(r)],
                                  env=dict(env, RANK=str(r), LOCAL_RANK=str(r)) if args.nproc > 1 else
                                  {k: v for k, v in env.items() if k != "WORLD_SIZE"})
                 for r in range(args.nproc)]
        codes = [proc.wait() for proc in procs]
        if any(codes):
            print(f"humanline: error: memory-check: a rank failed (exit codes {codes})", file=sys.stderr)
            return 1
        report = json.loads(json_path.read_text())
    est = report["estimate_gib"]
    failures = []
    for row in report["measured"]:
        row["ratio"] = row["peak_gib"] / est["total"]
        if abs(row["ratio"] - 1) > args.tol:
            failures.append(f"rank {row['rank']}: measured {row['peak_gib']:.3f} GiB vs estimate "
                            f"{est['total']:.3f} GiB (ratio {row['ratio']:.2f}, tolerance {args.tol:.0%})")
        if row["loading_full_gib"] is not None and row["loading_gib"] >= row["loading_full_gib"]:
            failures.append(f"rank {row['rank']}: sharded loading peaked at {row['loading_gib']:.3f} GiB, not below "
                            f"the full path's {row['loading_full_gib']:.3f} GiB")
    report["tol"], report["ok"], report["failures"] = args.tol, not failures, failures
    out.write_text(json.dumps(report, indent=1))
    m = report["model"]
    print(f"memory-check: Llama {m['params'] / 1e6:.1f}M params, {report['ranks']} rank(s) {report['strategy']}, "
          f"{report['seqs_per_micro']} x {report['tokens']} tokens per micro-batch")
    parts = " + ".join(f"{k} {est[k]:.3f}" for k in ("policy", "grads", "optimizer", "reference", "activations",
                                                     "transient"))
    full = f" (the full path: {est['loading_full']:.3f})" if report["loading"] == "both" else ""
    print(f"  estimate per rank: loading {est['loading']:.3f} GiB{full}, training {est['training']:.3f} GiB "
          f"({parts}); peak {est['total']:.3f} GiB")
    for row in report["measured"]:
        full = f" (the full path: {row['loading_full_gib']:.3f})" if row["loading_full_gib"] is not None else ""
        print(f"  measured rank {row['rank']}: loading {row['loading_gib']:.3f} GiB{full}, training "
              f"{row['training_gib']:.3f} GiB; peak {row['peak_gib']:.3f} GiB = {row['ratio']:.2f} x estimate "
              f"(steps {row['step_s']} s)")
    print(f"  {'ok' if not failures else 'FAILED'} (tolerance {args.tol:.0%}); {out}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
