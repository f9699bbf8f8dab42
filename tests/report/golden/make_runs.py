"""Writes the golden run dirs (tests/report/golden/study, tests/report/golden/regimes) that test_golden.py reads.

The dirs are committed: this script only documents how they were made and remakes them on purpose
(`python -m tests.report.golden.make_runs`). Every number comes from a seeded random.Random, so a rerun gives
the same bytes. The study holds what `humanline report` reads: grpo offline / online / humanline-offline with
learning curves, per-prompt eval samples and generation tokens (3 seeds); dpo with one seed (the gap decided by
the prompt bootstrap); stale and asynchronous rounds with humanline on them; kto at two learning rates; a failed
run, an incomplete one and a copied one. The regimes dir is a sweep over named regimes (regime_meta)."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import yaml

from tests.helpers.runs import config

HERE = Path(__file__).resolve().parent
CONSTANTS = {"target": "this", "estimated": False, "model": "tiny", "params": 1000, "bytes_per_param": 4,
             "source": "hand", "constants": {
                 "call_fixed_s": 0.5, "sample_tokens_per_s": 10.0, "decode_step_s": 0.1, "concurrency": 4,
                 "push_fixed_s": 0.0, "push_bytes_per_s": 1e12, "label_s_per_seq": 0.01,
                 "train_flops_per_s": 8000.0, "step_fixed_s": 1.0, "sync_fixed_s": 0.2, "sync_bytes_per_s": 1e12,
                 "other_step_s": 0.25, "gpus": 1}}
STEPS, PROMPTS = 8, 12


def _jsonl(path: Path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_run(root: Path, name: str, cfg: dict, rng: random.Random, *, final: float, wall: float, online: bool,
              humanline: bool, regime: str | None = None, rounds: int = 4, status: str = "complete") -> Path:
    d = root / name
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    over = [f"objective={cfg['objective']['name']}", f"seed={cfg['seed']}"] + ([f"regime={regime}"] if regime else [])
    (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(over))
    start, mid = 0.5, 0.5 + (final - 0.5) * rng.uniform(0.4, 0.7)
    sample = round(wall * 0.4, 3) if online else 0.0
    train = round(wall * 0.4, 3)
    rows = []
    for step in range(1, STEPS + 1):
        done = step / STEPS
        row = {"step": step, "loss": round(1 / step, 4), "tokens_processed": 100 + rng.randrange(20),
               "wall_s": round(2.0 + wall * 0.9 * done, 3), "time/setup": 2.0, "time/train": round(train * done, 3),
               "time/sample": round(sample * done, 3)}
        if online:
            row["drift/kl"] = round(rng.uniform(0.0, 0.02), 5)
            row["drift/logratio_mean"] = round(rng.uniform(-0.05, 0.05), 5)
        if humanline:
            row["humanline/unclamped_fraction"] = round(0.95 - 0.05 * done, 3)
        rows.append(row)
    rows.append({"step": STEPS // 2, "eval/greedy/accuracy": round(mid, 4), "eval/accuracy": round(mid - 0.02, 4),
                 "eval/win_rate": 0.55})
    if status == "incomplete":
        _jsonl(d / "metrics.jsonl", rows[:3])
        return d
    _jsonl(d / "metrics.jsonl", rows)
    _jsonl(d / "logratios.jsonl", [{"step": s, "lo": -3.0, "hi": 3.0,
                                    "counts": [1] + [rng.randrange(1, 30) for _ in range(20)] + [2]}
                                   for s in (STEPS // 2, STEPS)])
    if status == "failed":
        (d / "failed.json").write_text(json.dumps({"status": "failed", "error": "RuntimeError: out of memory"}))
        return d
    if online:
        per_round = 4
        _jsonl(d / "samples.jsonl", [{"round": r, "completion": "x", "tokens": rng.randrange(1, 9)}
                                     for r in range(1, rounds + 1) for _ in range(per_round)])
    for mode, name in (("greedy", "eval_samples_greedy.jsonl"), ("sampled", "eval_samples.jsonl")):
        p = final if mode == "greedy" else final - 0.03
        _jsonl(d / name, [{"prompt": f"p{i}", "policy_score": float(rng.random() < p)} for i in range(PROMPTS)])
    win = round(0.5 + (final - 0.5) * 0.8, 4)
    summary = {"status": "complete", "objective": cfg["objective"]["name"], "data": cfg["data"]["regime"],
               "humanline": humanline, "task": "arithmetic", "model": "tiny", "seed": cfg["seed"], "steps": STEPS,
               "batch_size": 4,
               "eval": {"win_rate": win, "win_rate_ci": [win - 0.06, win + 0.06], "accuracy": round(final - 0.03, 4),
                        "start_accuracy": 0.48, "reward_mean": round(final - 0.03, 4), "start_reward_mean": 0.48,
                        "greedy": {"accuracy": final, "start_accuracy": start}},
               "wall_clock_s": {"setup": 2.0, "sample": sample, "label": round(sample / 10, 3), "train": train,
                                "sync": 0.1 if humanline or online else 0.0, "push": 0.05 if online else 0.0,
                                "eval": 1.0, "save": 0.2, "total": wall},
               "final_train_metrics": {"online/round": rounds} if online else {"loss": 0.1}}
    (d / "summary.json").write_text(json.dumps(summary))
    return d


def study(root: Path) -> None:
    rng = random.Random(46)
    finals = {"offline": (0.60, 0.64, 0.62), "online": (0.80, 0.86, 0.84), "humanline": (0.72, 0.80, 0.74),
              "stale": (0.66, 0.70, 0.69), "humanline-stale": (0.74, 0.78, 0.77), "async": (0.78, 0.80, 0.83),
              "humanline-online": (0.82, 0.85, 0.86), "humanline-async": (0.81, 0.83, 0.86)}
    walls = {"offline": 10.0, "online": 40.0, "humanline": 11.0, "stale": 20.0, "humanline-stale": 21.0,
             "async": 30.0, "humanline-online": 41.0, "humanline-async": 31.0}
    for fam, values in finals.items():
        for seed, final in enumerate(values):
            hl = fam.startswith("humanline")
            base = fam.removeprefix("humanline-") if fam != "humanline" else "offline"
            online = base != "offline"
            over = {"data__generate_every": 4} if base == "stale" else {}
            over |= {"data__async_lag": 1} if base == "async" else {}
            cfg = config(obj="grpo", regime="online" if online else "offline", humanline=True if hl else None,
                         seed=seed, model__name="tiny", **over)
            write_run(root, f"grpo/{fam}_{seed}", cfg, rng, final=final, wall=walls[fam] + seed, online=online,
                      humanline=hl, rounds=1 if base == "stale" else 4)
    for fam, final, wall in (("offline", 0.55, 8.0), ("online", 0.75, 30.0), ("humanline", 0.70, 9.0)):
        cfg = config(obj="dpo", regime="online" if fam == "online" else "offline",
                     humanline=True if fam == "humanline" else None, seed=0)
        write_run(root, f"dpo/{fam}_0", cfg, rng, final=final, wall=wall, online=fam == "online",
                  humanline=fam == "humanline")
    for lr, finals_ in ((1e-5, (0.58, 0.61)), (3e-5, (0.63, 0.65))):
        for seed, final in enumerate(finals_):
            cfg = config(obj="kto", seed=seed, train__lr=lr)
            write_run(root, f"kto/lr{lr:g}_{seed}", cfg, rng, final=final, wall=12.0, online=False, humanline=False)
    write_run(root, "kto/failed", config(obj="kto", seed=7), rng, final=0.5, wall=5.0, online=False, humanline=False,
              status="failed")
    write_run(root, "kto/incomplete", config(obj="kto", seed=8), rng, final=0.5, wall=5.0, online=False,
              humanline=False, status="incomplete")
    shutil.copytree(root / "grpo/offline_0", root / "grpo/offline_0_copy")
    (root / "constants.json").write_text(json.dumps(CONSTANTS))


def regimes(root: Path) -> None:
    rng = random.Random(7)
    metas = {"offline": {"name": "offline", "family": "offline"}, "online": {"name": "online", "family": "online"},
             "hl": {"name": "hl", "family": "humanline", "baseline": "offline", "target": "online"}}
    finals = {"offline": (0.60, 0.63), "online": (0.84, 0.90), "hl": (0.75, 0.79)}
    for name, values in finals.items():
        for seed, final in enumerate(values):
            online = name == "online"
            cfg = config(obj="grpo", regime="online" if online else "offline",
                         humanline=True if name == "hl" else None, seed=seed)
            cfg["regime_meta"] = metas[name]
            write_run(root, f"{name}_{seed}", cfg, rng, final=final, wall=40.0 if online else 10.0 + seed,
                      online=online, humanline=name == "hl", regime=name)
    (root / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {"sweeper": {"params": {"regime": "offline,online,hl"}}}}))


if __name__ == "__main__":
    for name, make in (("study", study), ("regimes", regimes)):
        shutil.rmtree(HERE / name, ignore_errors=True)
        make(HERE / name)
