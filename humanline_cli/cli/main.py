"""`humanline <command>`: train (Hydra app), plus report/eval added by later modules.

Hydra owns argv, so the subcommand is stripped before Hydra parses the rest. User mistakes print
one line and exit 2 (HYDRA_FULL_ERROR=1 shows the traceback too, still exit 2). Ctrl-C prints one
line and exits 130. A multirun sweep runs every job; failed ones are named in one line at the end
(exit 2). Secrets given as overrides are masked in what Hydra and wandb write (tracking.scrub).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

COMMANDS = {
    "train": "train a policy (Hydra app: overrides, -m sweeps, --help, --cfg job)",
    "report": "paper-style table (Markdown, CSV) and plots from a sweep or runs dir",
    "eval": "win rate of one trained run against another run or the starting policy",
    "bench": "training throughput (plain, humanline, vs TRL) and model FLOP/s; KEY=VALUE args, --help",
    "sample": "offline dataset from a model's own samples, scored (pairs, groups, unpaired, card); out=DIR, --help",
}
USAGE = "usage: humanline {" + ",".join(COMMANDS) + "} ...\n" + "\n".join(f"  {k:8s} {v}" for k, v in COMMANDS.items())


# this process's multirun: the jobs it ran in-process and the ones that failed (a launcher that
# runs jobs in other processes reports their failures through Hydra instead, see SweepJobFailed)
_SWEEP: dict = {"pid": None, "jobs": 0, "failed": []}


class QuietConsole(logging.Filter):
    """The console handler of Hydra's job logging (conf/train.yaml): third-party INFO and below (httpx's
    line per LLM-judge request, ...) stays out of the console; the run's train.log keeps every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.name.split(".")[0] in ("humanline_cli", "__main__")


def _fail(msg: str, code: int = 2):
    print(f"humanline: error: {msg}", file=sys.stderr)
    sys.exit(code)


def _full_error() -> bool:
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def _one_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return " ".join(lines) if lines else type(e).__name__


def _read_failed(run_dir: Path | None) -> dict | None:
    import json

    try:
        return json.loads((run_dir / "failed.json").read_text()) if run_dir is not None else None
    except (OSError, ValueError):
        return None


def _interrupted(e: BaseException, run_dir: Path | None):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not interrupt this report
    from humanline_cli.train.signals import interrupted_where

    failed = _read_failed(run_dir)
    note = " (failed.json written)" if failed is not None else ""
    # under DDP/FSDP the step is rank 0's (it recorded it in failed.json); in one process, this traceback's
    where = failed.get("interrupted") if failed is not None and failed.get("interrupted") else interrupted_where(e)
    print(f"humanline: interrupted {where}{note}", file=sys.stderr)
    sys.exit(130)


def _mask_secrets(hc, run_dir: Path, multirun: bool) -> None:
    """Hydra saved .hydra/*.yaml (and a sweep's multirun.yaml) before calling us: mask secret-named
    keys there, and in sys.argv, which Hydra has parsed and wandb records as the run's args."""
    from humanline_cli.train.tracking import mask_saved_configs, scrub_argv

    sys.argv = scrub_argv(sys.argv)
    files = []
    if hc.output_subdir is not None:
        files += [run_dir / str(hc.output_subdir) / name for name in ("config.yaml", "hydra.yaml", "overrides.yaml")]
    if multirun:
        files.append(Path(hc.runtime.cwd) / str(hc.sweep.dir) / "multirun.yaml")
    mask_saved_configs(files)


def _sweep_job_failed(run_dir: Path, msg: str) -> None:
    """One sweep job failed: name it, keep the sweep going; the last line of the sweep lists them."""
    print(f"humanline: sweep job {run_dir.name} failed: {msg}", file=sys.stderr)
    if _SWEEP["pid"] == os.getpid():
        _SWEEP["failed"].append((run_dir, msg))
        return
    from hydra.errors import CompactHydraException

    class SweepJobFailed(CompactHydraException):
        """A job run by an out-of-process launcher (joblib, submitit): Hydra runs the others, then
        prints this one line (the first failure) and exits 1, which the CLI turns into 2."""

    raise SweepJobFailed(f"humanline: error: sweep job {run_dir} failed: {msg}")


def is_complete(run_dir: Path, cfg, hydra_subdir: str | None = ".hydra") -> bool:
    """The resume rule, for single runs and every sweep job: True (nothing to do) when the run dir holds
    a complete run of the same resolved config (saved as resolved_config.json, compared without keys
    that never change results); a run of another config raises a one-line checkpoint.RunDirConflict
    (resume=false starts over); False otherwise: the job runs, after checkpoint.prepare_run_dir made
    the dir ready (resuming from its last checkpoint, or moving old outputs aside with resume=false)."""
    from humanline_cli.config import validate
    from humanline_cli.train.rundir import is_complete as same_and_complete

    spec = validate(cfg)
    return same_and_complete(run_dir, spec.config, spec.resume, hydra_subdir)


def _train_app():
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig

    @hydra.main(version_base="1.3", config_path="pkg://conf", config_name="train")
    def app(cfg: DictConfig) -> None:
        from humanline_cli.errors import Preempted, RunFailed, UserError
        from humanline_cli.train.run import run_job

        run_dir = Path(HydraConfig.get().runtime.output_dir)
        multirun = str(HydraConfig.get().mode) == "RunMode.MULTIRUN"
        _mask_secrets(HydraConfig.get(), run_dir, multirun)
        if multirun and _SWEEP["pid"] == os.getpid():
            _SWEEP["jobs"] += 1
        from humanline_cli.train.launch import launch, shared_run_dir, spawn_count
        from humanline_cli.train.lock import RunDirBusy, RunDirLock
        from humanline_cli.train.rundir import restore_hydra

        lock = RunDirLock(run_dir)
        try:
            hydra_subdir = HydraConfig.get().output_subdir
            try:  # one job per run dir, held until this job ends (ranks included), before anything is read
                lock.acquire()
            except RunDirBusy:
                restore_hydra(run_dir, hydra_subdir)  # Hydra rewrote .hydra/ of the live job before we ran
                raise
            if lock.stale:
                print(f"humanline: note: {run_dir} was locked by a job that is gone ({lock.stale}); taking it over",
                      file=sys.stderr)
            if is_complete(run_dir, cfg, hydra_subdir):  # another config's run dir: RunDirConflict, one line
                print(f"humanline: skipping {run_dir}: already complete (resume=false starts over)", file=sys.stderr)
                return
            from humanline_cli.config import validate
            from humanline_cli.train.rundir import prepare_run_dir

            spec = validate(cfg)
            prepare_run_dir(run_dir, spec.config, spec.resume, hydra_subdir)  # before any rank starts
            nproc = spawn_count(cfg)
            if nproc:
                launch(cfg, run_dir, nproc)
            else:
                run_job(cfg, shared_run_dir(run_dir, cfg))
        except KeyboardInterrupt as e:
            _interrupted(e, run_dir)
        except Preempted as e:  # SIGTERM (SLURM): the whole process is going away, a sweep included
            note = " (failed.json written)" if _read_failed(run_dir) is not None else ""
            print(f"humanline: {e}{note}", file=sys.stderr)
            sys.exit(143)
        except (UserError, RunFailed, OSError) as e:
            if _full_error():
                raise
            # bad input names itself; a failed run (NaN loss, disk full) also names its run dir
            msg = str(e) if isinstance(e, UserError) else f"run failed ({run_dir}): {_one_line(e)}"
            if multirun:  # one failed job does not stop a sweep; report lists it from failed.json
                _sweep_job_failed(run_dir, msg)
                return
            _fail(msg)
        except Exception:  # not the user's mistake: a bug keeps Hydra's traceback and exits 1
            _SWEEP["bug"] = True
            raise
        finally:
            lock.release()

    return app


def main(argv: list[str] | None = None) -> None:
    try:
        _main(argv)
    except KeyboardInterrupt as e:  # outside a job (starting up, composing): nothing was written
        _interrupted(e, None)


def _main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv if argv is None else argv)
    args = argv[1:]
    if args and (args[0].startswith("-sc") or args[0].startswith("--shell-completion")):
        sys.argv = [argv[0], *args]  # shell completion arrives without the subcommand...
        line = os.environ.get("COMP_LINE", "")
        words = line.split(" ")
        if len(words) > 1 and words[1] in COMMANDS:  # ...but the line being completed has it
            os.environ["COMP_LINE"] = " ".join([words[0], *words[2:]])
        return _run_hydra()
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return
    cmd, rest = args[0], args[1:]
    if cmd not in COMMANDS:
        _fail(f"unknown command {cmd!r}; expected one of: {', '.join(COMMANDS)}")
    rest = normalize_overrides(rest)
    if cmd == "train" and os.environ.get("RANK", "0") != "0":
        # torchrun: only rank 0's Hydra makes the run dir; the others use a throwaway one and adopt
        # rank 0's (launch.shared_run_dir)
        import tempfile

        rest += [f"hydra.run.dir={tempfile.mkdtemp(prefix='humanline-rank')}", "hydra.output_subdir=null"]
    sys.argv = [f"{Path(argv[0]).name} {cmd}", *rest]
    match cmd:
        case "train":
            _run_hydra()
        case "report":
            from humanline_cli.report.aggregate import main_report

            sys.exit(main_report(rest))
        case "eval":
            from humanline_cli.cli.eval import main_eval

            sys.exit(main_eval(rest))
        case "bench":
            from humanline_cli.bench.project import main_bench

            sys.exit(main_bench(rest))
        case "sample":
            from humanline_cli.cli.sample import main_sample

            sys.exit(main_sample(rest))


def normalize_overrides(args: list[str]) -> list[str]:
    """`+humanline=...` (the paper-style switch users type) sets the declared `humanline` key."""
    return [a[1:] if a.startswith("+humanline=") else a for a in args]


def check_group_choices(args: list[str]) -> None:
    """Catch unknown group options (objective=foo) with one line before Hydra's multi-line report.
    Skipped when the user adds their own config search path."""
    if any(a.startswith(("hydra.searchpath", "+hydra.searchpath")) for a in args):
        return
    from importlib.resources import files

    conf = files("conf")
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.lstrip("+~").split("=", 1)
        if "." in key or "/" in key or not conf.joinpath(key).is_dir() or value.startswith(("glob(", "range(")):
            continue
        options = sorted(p.name[:-5] for p in conf.joinpath(key).iterdir() if p.name.endswith(".yaml"))
        for v in value.split(","):
            if v.strip() and v.strip() not in options:
                _fail(f"unknown {key} {v.strip()!r} (choose from: {', '.join(options)})")


HYDRA_FLAGS = ("-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "-sc",
               "--shell-completion", "-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir",
               "--resolve", "-p", "--package", "--version")


def sweep_points(overrides: list[str]) -> list[tuple[str, list[str]]]:
    """The configs a pre-check composes: the first value of every sweep, then each other value of
    each swept key with the rest at their first value (linear in the sweep size, not a product).
    Returns (label, overrides) pairs; the label names the sweep point for error messages."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType

    parsed = OverridesParser.create().parse_overrides(overrides)
    options: list[list[str]] = []
    for o in parsed:
        if o.is_sweep_override() and o.value_type != ValueType.GLOB_CHOICE_SWEEP:
            options.append([f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()])
        elif o.is_sweep_override():
            continue  # glob sweeps need Hydra's config loader; Hydra checks them itself
        else:
            options.append([o.input_line])
    base = [vals[0] for vals in options]
    points = [("", base)]
    for i, vals in enumerate(options):
        for v in vals[1:]:
            points.append((v, base[:i] + [v] + base[i + 1:]))
    return points


def precheck_overrides(args: list[str]) -> None:
    """Compose (and validate) with Hydra's own API before Hydra runs, so a bad override (typo'd key,
    wrong type, bad value in any sweep point) is reported in one line and nothing starts. Hydra's
    own flags (--help, --cfg, ...) go straight to Hydra."""
    if any(a.split("=")[0] in HYDRA_FLAGS for a in args) or os.environ.get("HYDRA_FULL_ERROR") == "1":
        return
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from humanline_cli.config import compose_error, validate
    from humanline_cli.errors import UserError

    overrides = [a for a in args if not a.startswith("-")]
    keep = [a for a in overrides if not a.startswith(("hydra.", "hydra/", "+hydra", "~hydra"))
            or a.startswith(("hydra.searchpath", "+hydra.searchpath"))]
    if sum(a.split("=", 1)[0].lstrip("+") == "humanline" for a in overrides) > 1:  # Hydra would refuse a 2nd `+`
        _fail("humanline is set more than once (+humanline=true or humanline=false, not both)")
    try:
        points = sweep_points(keep)
        from hydra.core.override_parser.overrides_parser import OverridesParser

        # the hydra.* overrides too: an unquoted non-ASCII run dir is a lexer error Hydra prints in 4 lines
        OverridesParser.create().parse_overrides([a for a in overrides if a not in keep])
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        hint = ("; quote a value with spaces or non-ASCII characters: key='\"value\"'"
                if "LexerNoViableAlt" in str(e) else "")
        _fail(compose_error(e).split("; See https://hydra.cc")[0] + hint)
    with initialize_config_module(config_module="conf", version_base="1.3"):
        for label, point in points:
            where = f"sweep point {label}: " if label else ""
            try:
                validate(compose("train", overrides=point))
            except UserError as e:
                _fail(f"{where}{e}")
            except (HydraException, OmegaConfBaseException, ValueError) as e:
                _fail(f"{where}{compose_error(e)}")
        multirun = any(a in ("-m", "--multirun") for a in args)
        hydra_args = [a for a in overrides if a not in keep]
        problem = output_dir_problem(points[0][1] + hydra_args, multirun)
        if problem:
            _fail(problem)


def output_dir_problem(overrides: list[str], multirun: bool) -> str | None:
    """Why Hydra could not create the run dir (the sweep dir under -m), or None. Checked before
    Hydra starts (Hydra's own failure there is a multi-line traceback). `${now:}` is resolved now, a
    second or so before Hydra does: only the parents matter, and they are the same. Creates nothing
    that stays (a probe dir is removed at once); an existing dir is only checked, never written."""

    from hydra import compose
    from omegaconf import OmegaConf

    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    try:  # a config that will not compose with its hydra.* overrides is Hydra's to report
        path = Path(str(OmegaConf.select(compose("train", overrides=overrides, return_hydra_config=True), key)))
    except Exception:
        return None
    path = path.absolute()
    where = f"cannot write the run dir {path}"
    try:
        return _dir_problem(path, key, where)
    except OSError as e:  # a path component over the file system's limit (255 bytes), a loop of links
        return f"{where}: {e.strerror} (set {key}=...)"


def _dir_problem(path: Path, key: str, where: str) -> str | None:
    import tempfile

    if path.exists():
        if not path.is_dir():
            return f"{where}: it is a file, not a directory (set {key}=...)"
        if not os.access(path, os.W_OK | os.X_OK):
            return f"{where}: permission denied or read-only (set {key}=...)"
        return None
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{where}: {parent} is a file, not a directory (set {key}=...)"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".humanline-probe-", dir=parent))
    except OSError as e:
        return f"{where}: cannot create directories in {parent}: {e.strerror} (set {key}=...)"
    return None


def _run_hydra():
    check_group_choices(sys.argv[1:])
    precheck_overrides(sys.argv[1:])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("WANDB_SILENT", "true")  # our summary says where the wandb run is
    app = _train_app()
    _SWEEP.update(pid=os.getpid(), jobs=0, failed=[], bug=False)
    try:
        app()
    except SystemExit as e:
        # Hydra exits 1 on config errors (unknown group option, bad override); we promise exit 2.
        if e.code == 1:
            sys.exit(1 if _SWEEP.get("bug") else 2)
        raise
    except Exception as e:  # only under HYDRA_FULL_ERROR=1 does Hydra let an error out
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        from humanline_cli.errors import RunFailed, UserError

        if not isinstance(e, (UserError, RunFailed, OSError, HydraException, OmegaConfBaseException)):
            raise  # a bug: Python's traceback and exit 1
        import traceback

        from humanline_cli.config import compose_error

        traceback.print_exc()
        _fail(compose_error(e) if isinstance(e, (HydraException, OmegaConfBaseException)) else _one_line(e))
    failed = _SWEEP["failed"]
    if failed:
        names = ", ".join(d.name for d, _ in failed)
        _fail(f"{len(failed)} of {_SWEEP['jobs']} sweep jobs failed in {failed[0][0].parent}: {names} "
              f"(each job's error is above)")


if __name__ == "__main__":
    main()
