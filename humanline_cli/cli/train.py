"""`humanline train`: the Hydra app. One job per run dir (a lock), the resume rule, the config validated
once, then the job in this process or its ranks. User mistakes print one line and exit 2
(HYDRA_FULL_ERROR=1 shows the traceback too, still exit 2); Ctrl-C prints where it landed and exits 130;
SIGTERM 143. A multirun sweep runs every job; failed ones are named in one line at the end (exit 2).
Secrets given as overrides are masked in what Hydra and wandb write (tracking.scrub)."""
from __future__ import annotations

import logging
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

from humanline_cli.cli.overrides import check_group_choices, precheck_overrides
from humanline_cli.errors import fail


@dataclass
class Sweep:
    """This process's multirun: the jobs it ran in-process and the ones that failed (a launcher that runs
    jobs in other processes reports their failures through Hydra instead, see SweepJobFailed). One per
    `run_train`, carried by the app it builds."""

    pid: int = field(default_factory=os.getpid)
    jobs: int = 0
    failed: list = field(default_factory=list)
    bug: bool = False


class QuietConsole(logging.Filter):
    """The console handler of Hydra's job logging (conf/train.yaml): third-party INFO and below (httpx's
    line per LLM-judge request, ...) stays out of the console; the run's train.log keeps every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.name.split(".")[0] in ("humanline_cli", "__main__")


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


def interrupted(e: BaseException, run_dir: Path | None):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not interrupt this report
    from humanline_cli.train.signals import interrupted_where

    failed = _read_failed(run_dir)
    note = " (failed.json written)" if failed is not None else ""
    # under DDP/FSDP the step is rank 0's (it recorded it in failed.json); in one process, this traceback's
    where = failed.get("interrupted") if failed is not None and failed.get("interrupted") else None
    where = where or interrupted_where(e)  # DDP/FSDP: the launcher's Interrupted carries a rank's record
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


def _sweep_job_failed(sweep: Sweep, run_dir: Path, msg: str) -> None:
    """One sweep job failed: name it, keep the sweep going; the last line of the sweep lists them."""
    print(f"humanline: sweep job {run_dir.name} failed: {msg}", file=sys.stderr)
    if sweep.pid == os.getpid():
        sweep.failed.append((run_dir, msg))
        return
    from hydra.errors import CompactHydraException

    class SweepJobFailed(CompactHydraException):
        """A job run by an out-of-process launcher (joblib, submitit): Hydra runs the others, then
        prints this one line (the first failure) and exits 1, which the CLI turns into 2."""

    raise SweepJobFailed(f"humanline: error: sweep job {run_dir} failed: {msg}")


def _train_app(sweep: Sweep):
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig

    @hydra.main(version_base="1.3", config_path="pkg://conf", config_name="train")
    def app(cfg: DictConfig) -> None:
        from humanline_cli.errors import Preempted, RunFailed, UserError
        from humanline_cli.train.run import run_job

        run_dir = Path(HydraConfig.get().runtime.output_dir)
        from humanline_cli.train.build import ORIGINAL_CWD

        os.environ[ORIGINAL_CWD] = HydraConfig.get().runtime.cwd  # relative data paths, under hydra.job.chdir too
        multirun = str(HydraConfig.get().mode) == "RunMode.MULTIRUN"
        _mask_secrets(HydraConfig.get(), run_dir, multirun)
        if multirun and sweep.pid == os.getpid():
            sweep.jobs += 1
        from humanline_cli.config import resolve
        from humanline_cli.train.launch import launch, shared_run_dir, spawn_count
        from humanline_cli.train.lock import RunDirBusy, RunDirLock
        from humanline_cli.train.rundir import is_complete, prepare_run_dir, restore_hydra

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
            spec = resolve(cfg)  # once: the resume rule, the run dir and the job all read this spec
            # the resume rule: a complete run of this config is skipped; another config's run dir is refused
            # (RunDirConflict, one line); else prepare_run_dir readies it (resume, or old outputs aside)
            if is_complete(run_dir, spec.config, spec.resume, hydra_subdir):
                print(f"humanline: skipping {run_dir}: already complete (resume=false starts over)", file=sys.stderr)
                return
            prepare_run_dir(run_dir, spec.config, spec.resume, hydra_subdir)  # before any rank starts
            nproc = spawn_count(cfg)
            if nproc:
                launch(cfg, run_dir, nproc)  # each rank is its own process: it validates the saved config itself
            else:
                run_job(cfg, shared_run_dir(run_dir, cfg), spec=spec)
        except KeyboardInterrupt as e:
            interrupted(e, run_dir)
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
                _sweep_job_failed(sweep, run_dir, msg)
                return
            fail(msg)
        except Exception:  # not the user's mistake: a bug keeps Hydra's traceback and exits 1
            sweep.bug = True
            raise
        finally:
            lock.release()

    return app


def run_train():
    """`humanline train ...` with sys.argv already Hydra's (the subcommand stripped by cli.main)."""
    check_group_choices(sys.argv[1:])
    precheck_overrides(sys.argv[1:])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("WANDB_SILENT", "true")  # our summary says where the wandb run is
    sweep = Sweep()
    app = _train_app(sweep)
    try:
        app()
    except SystemExit as e:
        # Hydra exits 1 on config errors (unknown group option, bad override); we promise exit 2.
        if e.code == 1:
            sys.exit(1 if sweep.bug else 2)
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
        fail(compose_error(e) if isinstance(e, (HydraException, OmegaConfBaseException)) else _one_line(e))
    failed = sweep.failed
    if failed:
        names = ", ".join(d.name for d, _ in failed)
        fail(f"{len(failed)} of {sweep.jobs} sweep jobs failed in {failed[0][0].parent}: {names} "
              f"(each job's error is above)")
