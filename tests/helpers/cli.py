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


# one torch thread: the suite runs two workers on two cores, and a run's two threads beside the other worker's
# would oversubscribe them
SMOLLM2 = ["model=smollm2", "task=chat_arithmetic", f"world_cache={MODEL_CACHE}", "threads=1", "train.log_every=1",
           *(f"task.generator.{k}={SMOLLM2_TASK[k]}" for k in ("digits", "op", "n_train", "n_eval")),
           "train.max_length=96", "train.max_prompt_length=48", "eval.n_prompts=4", "eval.max_new_tokens=8",
           "eval.batch_size=4", "data.max_new_tokens=12", "train.lr=1e-5"]


# Variables read when an interpreter, a native library or a preloaded module starts (a sitecustomize on PYTHONPATH,
# the kernel set, thread pools, huggingface_hub's cache and offline flags, home-relative cache paths): a run given
# one of these starts a fresh interpreter, as a user's would
STARTUP_ENV = ("PYTHON", "ATEN_", "OMP_", "MKL_", "KMP_", "LD_", "OPENBLAS_", "MALLOC_", "HF_", "HUGGINGFACE_",
               "TRANSFORMERS_", "TORCH", "CUDA_", "HOME", "XDG_")


def run_cli(args: list[str], cwd: Path, env_extra: dict | None = None, timeout: int = 600):
    """Run the real `humanline` entry point in its own process, as `python -m humanline_cli ARGS` in `cwd`; returns
    a CompletedProcess (exit code, stdout, stderr). The process is forked from a server that has already imported
    torch, transformers, Hydra and the package (multiprocessing's forkserver, one per test worker): a run then starts
    in well under a second instead of the ~6 s its imports take, which most of a short test run is. Everything else
    is a fresh process's: its own pid, cwd, environment, argv, signal handlers and exit code."""
    env = {**os.environ, **(env_extra or {})}
    cmd = [sys.executable, "-m", "humanline_cli", *args]
    if any(k.startswith(STARTUP_ENV) for k in (env_extra or {})):
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return _forked(cmd, args, cwd, env, timeout)


# what a run imports before it reads its config: the forkserver imports these once
PRELOAD = ["torch", "transformers", "hydra", "omegaconf", "wandb", "datasets", "peft", "humanline_cli.cli.main",
           "humanline_cli.config", "humanline_cli.train.job", "humanline_cli.train.build", "humanline_cli.models",
           "humanline_cli.world.cache", "humanline_cli.sampling.hf", "humanline_cli.world.offline_data",
           "humanline_cli.report.aggregate", "humanline_cli.cli.eval", "humanline_cli.cli.sample",
           "humanline_cli.bench.project"]


def _forked(cmd: list[str], args: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    import multiprocessing
    import tempfile

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory(prefix="humanline-cli-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        proc = ctx.Process(target=_cli_process, args=(list(args), str(cwd), env, str(out), str(err)))
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(cmd, timeout, output=_read(out), stderr=_read(err))
        return subprocess.CompletedProcess(cmd, proc.exitcode, _read(out), _read(err))


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _cli_process(args: list[str], cwd: str, env: dict, out: str, err: str) -> None:
    """The forked run: the environment, cwd, argv and standard streams `python -m humanline_cli` would have, then
    the entry point; its exit status is the interpreter's (SystemExit's code, 1 after an uncaught exception)."""
    import atexit
    import traceback

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    code = 0
    try:
        import humanline_cli
        from humanline_cli.cli.main import main

        sys.argv = [str(Path(humanline_cli.__file__).with_name("__main__.py")), *args]
        main()
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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


def run_in_process(run_dir: Path, tmp_path: Path, overrides: list[str]) -> list[dict]:
    """job.run_rank (what `humanline train` runs per job) in this process on the composed train config: the run
    completes, and its metrics.jsonl rows come back."""
    import json

    from hydra import compose, initialize_config_module

    from humanline_cli.cli.overrides import normalize_overrides
    from humanline_cli.config import resolve
    from humanline_cli.train.job import Context, run_rank

    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose("train", overrides=normalize_overrides(overrides))
    assert run_rank(resolve(cfg), Context(run_dir, tmp_path))["status"] == "complete"
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
