"""Running the real `humanline` entry point from tests: the tiny world's overrides, the short runs' settings, a
subprocess runner, and the model=smollm2 settings."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# A world small enough to build in seconds; tests override the task's world with these.
TINY_WORLD = ["task.world.sft.steps=40", "task.world.n_train_prompts=256", "task.world.n_eval_prompts=32"]


FAST = ["train.steps=3", "train.batch_size=8", "train.log_every=1", "eval.n_prompts=16", "train.weight_decay=0.0",
        "train.lr=1e-3", "threads=1"]


# model=smollm2 is converted once per MACHINE (minutes), into the cache a user's runs use, not the session's temporary
# one: read before any fixture points HUMANLINE_CACHE elsewhere
MODEL_CACHE = Path(os.environ.get("HUMANLINE_CACHE") or Path.home() / ".cache" / "humanline")


# the smollm2 tests' runs: few steps, short sequences, the converted model from MODEL_CACHE. One-digit sums: the
# model answers most of them within 12 tokens ("4 + 3 = 7"), so a group of samples holds right and wrong replies
# a run of this model takes ~30 s on 2 quiet cores; a machine shared with a dozen jobs slows it 20-fold
TIMEOUT = 1800


SMOLLM2_TASK = {"kind": "chat_arithmetic", "digits": 1, "op": "add", "n_train": 40, "n_eval": 10, "seed": 0}


SMOLLM2 = ["model=smollm2", "task=chat_arithmetic", f"world_cache={MODEL_CACHE}", "threads=2", "train.log_every=1",
           *(f"task.generator.{k}={SMOLLM2_TASK[k]}" for k in ("digits", "op", "n_train", "n_eval")),
           "train.max_length=96", "train.max_prompt_length=48", "eval.n_prompts=4", "eval.max_new_tokens=8",
           "eval.batch_size=4", "data.max_new_tokens=12", "train.lr=1e-5"]


def run_cli(args: list[str], cwd: Path, env_extra: dict | None = None, timeout: int = 600):
    """Run the real `humanline` entry point in a subprocess; returns CompletedProcess."""
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "humanline_cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------ through the real CLI
BASE = [*TINY_WORLD, "task=preference", "train.batch_size=8", "train.log_every=1", "eval.n_prompts=16",
        "train.weight_decay=0.0", "train.lr=1e-3", "threads=1", "wandb.mode=disabled"]


ONLINE = ["data=online", "data.prompts_per_round=8", "data.n=4", "data.max_new_tokens=6", "train.batch_size=4"]


def spawn_cli(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ}
    return subprocess.Popen([sys.executable, "-m", "humanline_cli", *args], cwd=log.parent, env=env,
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"))


def tiny_world_cfg() -> dict:
    """The world TINY_WORLD names (task=arithmetic's knobs + the tiny overrides)."""
    return {"kind": "arithmetic", "n_train_prompts": 256, "n_eval_prompts": 32, "sft": {"steps": 40}}
