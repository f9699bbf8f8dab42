"""A registered study's sweep run in parts, one process per core, so that a stop anywhere loses at most the runs in
flight and a lost `runs/` folder loses nothing that was kept.

A study's experiment file sweeps `seed` and `regime` (run dirs `<regime>_seed<seed>`). This tool takes one share of
its seeds (`--part K --of N`: seeds K, K+N, K+2N, ... in the file's order) and, one seed at a time, runs that seed's
regimes that are not complete yet in one `humanline train -m` (pinned to `--cpu` with taskset, niced). A run counts
as complete where its run dir's summary.json says so or where the study's kept CSV (`--kept`, the
`humanline report --export-csv` file committed beside results.md) has it as complete, so a machine that starts
without the run dirs never reruns a kept run; in both, only a run started on a clean checkout counts, as in the
study's own check (`lab/study_check`). A complete run dir that started on a dirty checkout is moved to
`<run dirs>_set_aside/` before its rerun, never deleted. A multirun goes on to its next job when one is refused at setup (the
memory check refuses a run while the other core's run holds its peak), so each seed is retried, after a pause, until
all its runs are complete or the tries are spent; then the next seed.

    git worktree add ../study 2ca0728      # the registered code, a clean checkout
    python -m humanline_cli.lab.study_parts smollm2_fair_study --code ../study --part 0 --of 2 --cpu 0 \\
        --kept humanline_cli/docs/studies/smollm2_fair_study.csv
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from importlib.resources import files
from pathlib import Path

from humanline_cli.errors import UserError
from humanline_cli.report.study_csv import read_table

SUBDIR = "${hydra:runtime.choices.regime}_seed${seed}"


def sweep_grid(experiment: str) -> tuple[list[int], list[str]]:
    """The experiment file's swept seeds and regimes, in its order (comma lists only)."""
    from omegaconf import OmegaConf

    path = files("conf").joinpath("experiment", f"{experiment}.yaml")
    if not path.is_file():
        raise UserError(f"experiment {experiment!r}: no conf/experiment/{experiment}.yaml")
    hydra = OmegaConf.to_container(OmegaConf.load(str(path)), resolve=False).get("hydra") or {}
    params = (hydra.get("sweeper") or {}).get("params") or {}
    if (hydra.get("sweep") or {}).get("subdir") != SUBDIR or not {"seed", "regime"} <= params.keys():
        raise UserError(f"experiment {experiment!r} does not sweep seed and regime into run dirs {SUBDIR}")
    try:
        seeds = [int(s) for s in str(params["seed"]).split(",")]
    except ValueError:
        raise UserError(f"experiment {experiment!r}: seeds {params['seed']!r} are not a comma list of integers") from None
    return seeds, [r.strip() for r in str(params["regime"]).split(",")]


def _finished(runs_dir: Path) -> dict[str, bool]:
    """The run dirs whose summary.json says complete, each with whether it started on a clean checkout."""
    out = {}
    for summary in runs_dir.glob("*/summary.json"):
        try:
            s = json.loads(summary.read_text())
        except (OSError, ValueError):  # a summary being written or cut short is not complete
            continue
        if isinstance(s, dict) and s.get("status") == "complete":
            out[summary.parent.name] = s.get("git_dirty") is False
    return out


def complete_runs(runs_dir: Path, kept: Path | None) -> set[str]:
    """Names of the runs that count as done: complete and started on a clean checkout, in a run dir or in the kept
    CSV (a run started on uncommitted code would not count in the study, so it runs again)."""
    done = {name for name, clean in _finished(runs_dir).items() if clean}
    if kept is not None:
        table = read_table(kept, ("run", "status", "git_dirty"), name="--kept")
        done |= set(table.run[(table.status == "complete") & (table.git_dirty.astype(str).str.lower() == "false")])
    return done


def set_aside(runs_dir: Path, names: Iterable[str]) -> list[str]:
    """Move the run dirs among `names` that are complete but started on a dirty checkout to
    `<runs_dir>_set_aside/`, so their rerun starts afresh and they stay readable; the names moved."""
    finished, moved = _finished(runs_dir), []
    for name in names:
        if finished.get(name) is False:
            away = runs_dir.parent / f"{runs_dir.name}_set_aside" / f"{name}_{time.strftime('%Y%m%dT%H%M%S')}"
            away.parent.mkdir(parents=True, exist_ok=True)
            (runs_dir / name).rename(away)
            moved.append(name)
    return moved


def drop_checkpoints(runs_dir: Path) -> int:
    """Delete the mid-run checkpoints of the complete runs under `runs_dir` (a finished run never resumes, and a
    SmolLM2 run's checkpoint is gigabytes); the number of runs whose checkpoints went."""
    n = 0
    for name in _finished(runs_dir):
        if (runs_dir / name / "checkpoints").is_dir():
            shutil.rmtree(runs_dir / name / "checkpoints", ignore_errors=True)
            n += 1
    return n


def run_dropping(argv: list[str], runs_dir: Path, every: float = 60.0) -> int:
    """Run `argv`, dropping the checkpoints of runs as they complete (every `every` seconds and at the end), so a
    seed's multirun holds at most its run in flight's; its exit code."""
    proc = subprocess.Popen(argv)
    while True:
        try:
            code = proc.wait(timeout=every)
            break
        except subprocess.TimeoutExpired:
            drop_checkpoints(runs_dir)
    drop_checkpoints(runs_dir)
    return code


def share(seeds: list[int], part: int, of: int) -> list[int]:
    """Part `part` of `of` of the seeds: every `of`-th seed from the `part`-th on."""
    return seeds[part::of]


def missing(seed: int, regimes: Iterable[str], done: set[str]) -> list[str]:
    return [r for r in regimes if f"{r}_seed{seed}" not in done]


def command(experiment: str, seed: int, regimes: list[str], cpu: int | None, nice: int,
            code: Path | None = None) -> list[str]:
    """The seed's multirun; with `code`, that checkout's humanline_cli and conf/ run it: PYTHONPATH names it and -P
    keeps `python -m` from putting the working directory (another checkout, where runs/ is) ahead of it."""
    pin = ["taskset", "-c", str(cpu)] if cpu is not None else []
    env = ["env", f"PYTHONPATH={code.resolve()}"] if code is not None else []
    python = [sys.executable, "-P"] if code is not None else [sys.executable]
    return [*pin, "nice", "-n", str(nice), *env, *python, "-m", "humanline_cli", "train", "-m",
            f"experiment={experiment}", f"seed={seed}", f"regime={','.join(regimes)}"]


def check_code(code: Path) -> None:
    """A UserError unless a run started by `command` imports humanline_cli and conf from `code` and `code` has no
    uncommitted changes (a run records the commit and the dirty flag of the checkout it imports)."""
    probe = subprocess.run([sys.executable, "-P", "-c", "import conf, humanline_cli; print(humanline_cli.__file__); "
                            "print(conf.__file__)"], env={**os.environ, "PYTHONPATH": str(code.resolve())},
                           capture_output=True, text=True)
    where = [Path(line).resolve() for line in probe.stdout.split()]
    if probe.returncode != 0 or len(where) != 2 or not all(w.is_relative_to(code.resolve()) for w in where):
        raise UserError(f"--code {code}: a run would not import its humanline_cli and conf "
                        f"({', '.join(map(str, where)) or (probe.stderr.strip().splitlines() or ['no output'])[-1]})")
    status = subprocess.run(["git", "-C", str(code), "status", "--porcelain"], capture_output=True, text=True)
    if status.returncode != 0:
        raise UserError(f"--code {code}: not a git checkout, so a run could not record its commit")
    if status.stdout.strip():
        raise UserError(f"--code {code}: uncommitted changes; a run started on them would not count")


def run_share(experiment: str, seeds: list[int], regimes: list[str], runs_dir: Path, kept: Path | None, *,
              cpu: int | None = None, nice: int = 10, code: Path | None = None, tries: int = 10, pause: float = 120.0,
              drop: bool = False,
              run: Callable[[list[str]], object] = subprocess.run, say: Callable[[str], None] = print) -> list[str]:
    """Run the share seed by seed; the runs still missing after every seed's tries (empty when all finished)."""
    left = []
    for seed in seeds:
        for attempt in range(1, tries + 1):
            todo = missing(seed, regimes, complete_runs(runs_dir, kept))
            if not todo:
                break
            for name in set_aside(runs_dir, [f"{r}_seed{seed}" for r in todo]):
                say(f"{time.strftime('%H:%M:%S')} {name}: complete but started on a dirty checkout; moved to "
                    f"{runs_dir.name}_set_aside/ and run again")
            say(f"{time.strftime('%H:%M:%S')} seed {seed}, try {attempt} of {tries}: {', '.join(todo)}")
            if drop:
                run_dropping(command(experiment, seed, todo, cpu, nice, code), runs_dir)
            else:
                run(command(experiment, seed, todo, cpu, nice, code))
            if missing(seed, regimes, complete_runs(runs_dir, kept)) and attempt < tries:
                time.sleep(pause)
        todo = missing(seed, regimes, complete_runs(runs_dir, kept))
        say(f"{time.strftime('%H:%M:%S')} seed {seed}: " + ("complete" if not todo else f"{len(todo)} runs not "
                                                              f"complete after {tries} tries: {', '.join(todo)}"))
        left += [f"{r}_seed{seed}" for r in todo]
    return left


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m humanline_cli.lab.study_parts", description=__doc__.split("\n\n")[0])
    p.add_argument("experiment", help="the study's experiment file under conf/experiment/")
    p.add_argument("--part", type=int, default=0, help="which share of the seeds, from 0 (default 0)")
    p.add_argument("--of", type=int, default=1, help="how many shares the seeds are split into (default 1)")
    p.add_argument("--cpu", type=int, default=None, help="pin this share's runs to this CPU (taskset)")
    p.add_argument("--code", type=Path, default=None, metavar="DIR",
                   help="run the trains on this checkout's code (the registered commit, e.g. a git worktree of it); "
                        "default: this interpreter's humanline_cli")
    p.add_argument("--kept", type=Path, default=None, help="the study's kept CSV: its complete runs are not rerun")
    p.add_argument("--runs", type=Path, default=None, help="the study's run dirs (default runs/experiments/EXPERIMENT)")
    p.add_argument("--tries", type=int, default=10, help="runs of a seed's multirun before going on (default 10)")
    p.add_argument("--pause", type=float, default=120.0, help="seconds between a seed's tries (default 120)")
    p.add_argument("--drop-checkpoints", action="store_true",
                   help="delete the checkpoints of runs as they complete (a finished run is never resumed)")
    p.add_argument("--nice", type=int, default=10, help="the runs' niceness (default 10)")
    a = p.parse_args(argv)
    try:
        if not 0 <= a.part < a.of:
            raise UserError(f"--part {a.part} --of {a.of}: the part must be in [0, {a.of})")
        if a.tries < 1:
            raise UserError(f"--tries {a.tries}: at least 1")
        if a.cpu is not None and shutil.which("taskset") is None:
            raise UserError("--cpu needs taskset (util-linux), which is not on PATH")
        if a.code is not None and not ((a.code / "humanline_cli" / "__init__.py").is_file()
                                       and (a.code / "conf").is_dir()):
            raise UserError(f"--code {a.code}: not a humanline checkout (no humanline_cli/ and conf/ there)")
        if a.code is not None:
            check_code(a.code)
        if a.kept is not None and not a.kept.is_file():
            raise UserError(f"--kept {a.kept}: no such file")
        seeds, regimes = sweep_grid(a.experiment)
        runs_dir = a.runs or Path("runs/experiments") / a.experiment
        complete_runs(runs_dir, a.kept)  # a bad --kept stops here, before any run starts
    except UserError as e:
        print(f"study_parts: error: {e}", file=sys.stderr)
        return 2
    mine = share(seeds, a.part, a.of)
    print(f"study_parts: {a.experiment}, part {a.part} of {a.of}: {len(mine)} seeds x {len(regimes)} regimes, "
          f"run dirs in {runs_dir}", flush=True)
    left = run_share(a.experiment, mine, regimes, runs_dir, a.kept, cpu=a.cpu, nice=a.nice, code=a.code, tries=a.tries,
                     pause=a.pause, drop=a.drop_checkpoints, say=lambda line: print(line, flush=True))
    return 1 if left else 0


if __name__ == "__main__":
    raise SystemExit(main())
