"""`humanline train`: the Hydra app. Each job is a train/job.py `Job` (lock, validate, the resume rule,
record, run; train/failures.py's table from exception to exit code and line); this module turns its outcome into the
process's: user mistakes print one line and exit 2 (HYDRA_FULL_ERROR=1 shows the traceback too, still
exit 2); Ctrl-C prints where it landed and exits 130; SIGTERM 143. A multirun sweep runs every job;
failed ones are named in one line at the end (exit 2). Secrets given as overrides are masked in what
Hydra and wandb write (tracking.scrub)."""
from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from humanline_cli.cli.overrides import check_group_choices, precheck_overrides
from humanline_cli.errors import RunFailed, UserError, fail, ignore_ctrl_c, one_line


@dataclass
class Sweep:
    """This process's multirun: the jobs it ran in-process and the ones that failed (a launcher that runs
    jobs in other processes reports their failures through Hydra instead, see SweepJobFailed). One per
    `run_train`, carried by the app it builds."""

    pid: int = field(default_factory=os.getpid)
    jobs: int = 0
    failed: list = field(default_factory=list)
    bug: bool = False


def run_dir_correction(humanline, kind) -> str:
    """The correction conf/train.yaml's run dirs name: humanline=true is correction=humanline."""
    return "humanline" if str(humanline).lower() == "true" else str(kind)


def _register_run_dir_resolver() -> None:
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("run_dir_correction", run_dir_correction, replace=True)


# at import: a launcher that runs jobs in other processes (joblib, submitit) resolves each job's dir there, and
# unpickling the app's Sweep imports this module
_register_run_dir_resolver()


class QuietConsole(logging.Filter):
    """The console handler of Hydra's job logging (conf/train.yaml): third-party INFO and below (httpx's
    line per LLM-judge request, ...) stays out of the console; the run's train.log keeps every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.name.split(".")[0] in ("humanline_cli", "__main__")


def _full_error() -> bool:
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def report_interrupt(where: str = "before training"):
    """Ctrl-C outside a job (starting up, composing): nothing was written."""
    ignore_ctrl_c()  # a second Ctrl-C must not interrupt this report
    print(f"humanline: interrupted {where}", file=sys.stderr)
    sys.exit(130)


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

    from humanline_cli.cli.help import register

    register()  # conf/train.yaml's --help template lists the groups through it

    @hydra.main(version_base="1.3", config_path="pkg://conf", config_name="train")
    def app(cfg: DictConfig) -> None:
        from humanline_cli.train.job import Context, HydraRecord, Job, launcher_ranks
        from humanline_cli.train.nodes import slurm_nodes
        from humanline_cli.train.tracking import mask_saved_configs

        hc = HydraConfig.get()
        multirun = str(hc.mode) == "RunMode.MULTIRUN"
        if multirun:  # the sweeper saved multirun.yaml before any job: secret-named values masked there
            mask_saved_configs([Path(hc.runtime.cwd) / str(hc.sweep.dir) / "multirun.yaml"])
            if sweep.pid == os.getpid():
                sweep.jobs += 1
        rank, world = launcher_ranks()
        ctx = Context(Path(hc.runtime.output_dir), Path(hc.runtime.cwd), rank, world, slurm_nodes())
        record = HydraRecord(cfg, HydraConfig.instance().cfg, hc.overrides.task)
        try:
            end = Job(cfg, ctx, record, full_error=_full_error()).run()
        except Exception as e:  # a bug keeps Hydra's traceback and exits 1 (HYDRA_FULL_ERROR=1: any error)
            sweep.bug = not isinstance(e, (UserError, RunFailed, OSError))
            raise
        if end.code == 130:
            ignore_ctrl_c()  # a second Ctrl-C must not interrupt this report
        if end.error and multirun:  # one failed job does not stop a sweep; report lists it from failed.json
            _sweep_job_failed(sweep, ctx.run_dir, end.message)
            return
        if end.line is not None:
            print(end.line, file=sys.stderr)
        if end.code:
            sys.exit(end.code)

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

        if not isinstance(e, (UserError, RunFailed, OSError, HydraException, OmegaConfBaseException)):
            raise  # a bug: Python's traceback and exit 1
        import traceback

        from humanline_cli.config import compose_error

        traceback.print_exc()
        fail(compose_error(e) if isinstance(e, (HydraException, OmegaConfBaseException)) else one_line(e))
    failed = sweep.failed
    if failed:
        names = ", ".join(d.name for d, _ in failed)
        fail(f"{len(failed)} of {sweep.jobs} sweep jobs failed in {failed[0][0].parent}: {names} "
              f"(each job's error is above)")
