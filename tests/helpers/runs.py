"""Run directories written by hand (the report's inputs) and read back (metrics rows, samples, every output)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import yaml
from safetensors.torch import load_file


def read_rows(path: Path) -> list[dict]:
    drop = ("wall_s", "tokens_per_s")
    return [{k: v for k, v in json.loads(line).items() if k not in drop and not k.startswith("time/")}
            for line in path.read_text().splitlines()]


def run_outputs(run: Path) -> dict:
    out = {name: read_rows(run / name) for name in ("metrics.jsonl", "logratios.jsonl") if (run / name).exists()}
    for name in ("eval_samples.jsonl", "samples.jsonl"):
        if (run / name).exists():
            out[name] = (run / name).read_text()
    out["eval"] = json.loads((run / "summary.json").read_text())["eval"]
    out["model"] = {k: v.tolist() for k, v in load_file(run / "model" / "model.safetensors").items()}
    return out


def read_samples(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]


def config(obj="dpo", regime="offline", humanline=None, seed=0, **over) -> dict:
    """A config shaped like Hydra's saved .hydra/config.yaml (unresolved interpolations, lists, nested dicts)."""
    data = ({"regime": "offline", "path": "${task.offline.path}", "split": "${task.offline.split}", "limit": None,
             "min_gap": 0.0, "shuffle": True} if regime == "offline" else
            {"regime": "online", "prompts": "${task.prompts.train}", "n": 8, "temperature": 1.0, "min_gap": 0.01})
    objective = {"name": obj, "beta": 0.1, "batch_size": 64 if obj == "kto" else 32}
    cfg = {"objective": objective, "data": data,
           "task": {"name": "arithmetic", "world": {"kind": "arithmetic", "seed": 0, "sizes": [4096, 256]},
                    "prompts": {"train": "world://prompts_train.jsonl"},
                    "offline": {"path": "world://offline_pairs.jsonl", "split": "train"}},
           "model": {"name": "tiny", "name_or_path": "world://policy", "tokenizer": None},
           "sampler": {"name": "hf", "batch_size": 256}, "reward": {"kind": "task"},
           "seed": seed, "resume": True, "threads": None, "experiment_name": "grid",
           "world_cache": "${oc.env:HOME}/.cache/humanline", "out_dir": "${hydra:runtime.output_dir}",
           "hl": {"clamp": True, "sync": True, "log_eps_P": -1.0, "log_eps_R": 1.5, "sync_every": 1},
           "train": {"steps": 200, "batch_size": "${objective.batch_size}", "lr": 1.0e-5, "betas": [0.9, 0.999]},
           "eval": {"n_prompts": 256}, "wandb": {"mode": "${oc.env:WANDB_MODE,offline}", "tags": []}}
    if humanline is not None:
        cfg["humanline"] = humanline
    for dotted, value in over.items():
        *parents, leaf = dotted.split("__")
        node = cfg
        for p in parents:
            node = node[p]
        node[leaf] = value
    return cfg


def run_dir(root: Path, name: str, cfg: dict | None, *, win: float, wall: float, acc: float = 0.7,
            obj=None, regime=None, humanline=None, seed=None) -> Path:
    d = root / name
    d.mkdir(parents=True)
    if cfg is not None:
        (d / ".hydra").mkdir()
        (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump(copy.deepcopy(cfg), sort_keys=False))
        obj, regime, seed = cfg["objective"]["name"], cfg["data"]["regime"], cfg["seed"]
        humanline = cfg.get("humanline") is True
    summary = {"status": "complete", "objective": obj, "data": regime, "humanline": bool(humanline),
               "task": "arithmetic", "seed": seed,
               "eval": {"win_rate": win, "win_rate_ci": [win - 0.05, win + 0.05], "accuracy": acc, "reward_mean": acc},
               "wall_clock_s": {"total": wall, "sample": 0.0, "label": 0.0, "train": wall - 1.0}}
    (d / "summary.json").write_text(json.dumps(summary))
    return d


def saved_config(obj, data, task, seed, humanline):
    lines = [f"objective:\n  name: {obj}\n  beta: 0.1", f"data:\n  regime: {data}\n  path: ${{task.offline.path}}",
             f"task:\n  name: {task}\n  verifiable: true", f"seed: {seed}"]
    if humanline:
        lines.append("humanline: true")
    return "\n".join(lines) + "\n"


def make_run(root: Path, name: str, obj: str, data: str, hl: bool, seed: int, *, task="arithmetic", win=None,
             ci=None, acc=None, reward=0.5, wall=None, sample=0.0, status="complete", error=None, steps=(10, 20, 30, 40)):
    d = root / name
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "config.yaml").write_text(saved_config(obj, data, task, seed, hl))
    rows = []
    for i, s in enumerate(steps):
        row = {"step": s, "loss": 1.0 / (i + 1), "lr": 1e-4, "grad_norm": 1.0, "tokens_per_s": 1000.0, "wall_s": s * 0.1}
        if hl:
            row["humanline/unclamped_fraction"] = 0.9 - 0.1 * i
        rows.append(row)
    if status == "complete" and wall:
        rows.append({"step": steps[-1], "eval/win_rate": 0.55, "eval/accuracy": None if acc is None else acc - 0.05,
                     "eval/reward_mean": reward - 0.05, "wall_s": wall / 2})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    counts = [[1] + [0] * 60 + [1] for _ in steps]
    for c in counts[-1:]:  # only the last 25% of 4 steps (= 1 step) counts
        c[25] = 100 if hl else 10
    (d / "logratios.jsonl").write_text("".join(json.dumps({"step": s, "lo": -3.0, "hi": 3.0, "counts": c}) + "\n"
                                                for s, c in zip(steps, counts)))
    if status == "complete":
        ci = ci or [max(0.0, win - 0.05), min(1.0, win + 0.05)]
        summary = {"status": "complete", "objective": obj, "data": data, "humanline": hl, "task": task, "model": "tiny",
                   "seed": seed, "steps": steps[-1], "batch_size": 64, "batch_unit": "examples",
                   "eval": {"n_prompts": 256, "win_rate": win, "win_rate_ci": ci, "reward_mean": reward,
                            "start_reward_mean": 0.3, "accuracy": acc, "start_accuracy": None if acc is None else 0.5,
                            "judge": f"world/{task}/judge", "temperature": 0.7},
                   "wall_clock_s": {"setup": 1.0, "sample": sample, "label": sample / 2, "train": wall - 5.0,
                                    "sync": 0.0, "push": 0.0, "eval": 2.0, "save": 0.1, "total": wall},
                   "tokens_per_s": {"train": 1000.0, "sample": None}, "final_train_metrics": {}}
        (d / "summary.json").write_text(json.dumps(summary))
    elif status == "failed":
        (d / "failed.json").write_text(json.dumps({"status": "failed", "error": error, "wall_clock_s": {"total": 3.0}}))
    return d
