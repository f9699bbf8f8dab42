"""One `humanline train` job, in the order it runs.

`Job.run` runs in the process that owns the run dir (the Hydra app calls it once per job):
  1. lock the run dir: one job per dir. Hydra writes nothing into the dir before this (conf/train.yaml:
     no `.hydra/` of Hydra's own, no log file handler), so a refused job changes no byte of it;
  2. validate the composed config, once, into a frozen RunSpec (ranks receive it, never re-validate);
  3. the resume rule: a complete run of this config is skipped, another config's dir refused, else the dir
     is made ready (resume from a checkpoint, or old outputs moved aside);
  4. record the job in the dir: `.hydra/` (config, hydra, overrides; secrets masked) and train.log;
  5. run it here, on the ranks it starts (torch's elastic launch), or as rank 0 of torchrun's ranks
     (rank 0 does 1-4 and hands the spec and run dir to the others).
A SLURM job of several nodes runs this on every node: node 0 alone does 1-4, the others wait for it
(train/nodes.py), then every node starts its ranks.
`run_rank` is one rank's part: set up (parts, resume), train, finish (model, summary.json, the end-of-run
evaluations), and on failure failed.json (rank 0) and the rank's record for whoever reports the job
(train/failures.py).

How an exception ends the job (exit code, line, failed.json) is train/failures.py's table. The job's context
(rank, world size, run dir, where the command was typed) is a `Context`, computed once and passed to every part.
"""
from __future__ import annotations

import dataclasses
import io
import logging
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf
from rich.console import Console

from humanline_cli.atomic import write_text_atomic
from humanline_cli.backend import wait_for_rank0
from humanline_cli.config import RunSpec, resolve
from humanline_cli.core.humanline import ReferenceRule
from humanline_cli.errors import RunFailed, UserError, ignore_ctrl_c
from humanline_cli.machine import Allocation, allocation_of, check_launch, this_machine
from humanline_cli.memory import release_freed
from humanline_cli.train import failures, provenance
from humanline_cli.train.build import build_parts
from humanline_cli.train.checkpoint import Checkpoints
from humanline_cli.train.failures import Outcome, outcome
from humanline_cli.train.finish import finish, header, print_summary
from humanline_cli.train.lock import RunDirLock
from humanline_cli.train.nodes import Nodes, clear_markers, prepare_on_node0, wait_for_node0
from humanline_cli.train.rundir import is_complete, prepare_run_dir, recorded_micro_batch, run_record
from humanline_cli.train.signals import StepMarker, StopSignal, die_by_sigterm, interrupted_where, release_semaphores
from humanline_cli.train.timing import PhaseTimer
from humanline_cli.train.tracking import NullTracker, Tracker, masked_config
from humanline_cli.train.trainer import train

HYDRA_DIR = ".hydra"  # the job's record of its config, written after the lock (never by Hydra itself)
LOG = "train.log"
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # Hydra's own file format


@dataclass(frozen=True)
class Context:
    """Where and as what this process runs the job."""

    run_dir: Path
    cwd: Path              # where the command was typed: relative data paths mean files there
    rank: int = 0
    world_size: int = 1    # > 1: a rank of a distributed job (torch's launcher set RANK / WORLD_SIZE)
    nodes: Nodes = field(default_factory=Nodes)  # a SLURM job of several nodes: this node's place in it

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def launcher_ranks(env=None) -> tuple[int, int]:
    """(rank, world size) as torch's launcher set them; (0, 1) outside one. Read once per process."""
    env = os.environ if env is None else env
    return int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))


@dataclass(frozen=True)
class HydraRecord:
    """What Hydra composed for this job, saved as <run dir>/.hydra/*.yaml once the job holds the dir."""

    config: object      # the task config (DictConfig, interpolations kept)
    hydra: object       # the whole Hydra node ({"hydra": ...})
    overrides: object   # the task overrides as typed

    def save(self, run_dir: Path) -> None:
        for name, node in (("config.yaml", self.config), ("hydra.yaml", self.hydra),
                           ("overrides.yaml", self.overrides)):
            (run_dir / HYDRA_DIR).mkdir(parents=True, exist_ok=True)
            write_text_atomic(run_dir / HYDRA_DIR / name, masked_config(node))


# ------------------------------------------------------------------ the job, in the process that owns the dir
class Job:
    def __init__(self, cfg, ctx: Context, record: HydraRecord | None = None, full_error: bool = False):
        self.cfg = cfg
        self.ctx = ctx
        self.record = record
        self.full_error = full_error  # HYDRA_FULL_ERROR=1: an error's traceback too (Hydra prints it)
        self._spec_marker: Path | None = None  # node 0 of several: the marker to remove once the ranks ran

    def run(self) -> Outcome:
        """The whole job; returns how it ended (a bug's exception goes through, exit 1)."""
        lock = RunDirLock(self.ctx.run_dir)
        log = None
        try:
            if OmegaConf.select(self.cfg, "backend.profile") and not self.ctx.distributed:
                from humanline_cli.train.dry_run import dry_run

                dry_run(dataclasses.replace(resolve(self.cfg), cwd=str(self.ctx.cwd)), self.allocation)
                return Outcome(0)
            if self.ctx.distributed:
                return self._join_torchrun(lock)
            spec = self._prepare_here(lock)
            if spec is None:
                return Outcome(0)
            log = _attach_log(self.ctx.run_dir) if self.ctx.nodes.index == 0 else None
            nproc = spawn_count(spec)
            if nproc:
                _launch(spec, self.ctx, nproc)
            else:
                run_rank(spec, self.ctx)
            return Outcome(0)
        except BaseException as e:  # noqa: BLE001 - the table decides; a bug goes through
            end = outcome(e, self.ctx.run_dir)
            if end is None or (end.error and self.full_error):
                raise
            return end
        finally:
            _detach_log(log)
            if self._spec_marker is not None:  # every node read it before its ranks met ours at rendezvous
                self._spec_marker.unlink(missing_ok=True)
            lock.release()

    @property
    def allocation(self) -> Allocation:
        """What the Hydra launcher allocates this job (SLURM's GPUs and nodes); nothing where it runs here."""
        return allocation_of(OmegaConf.select(self.record.hydra, "hydra.launcher") if self.record else None)

    def _prepare_here(self, lock: RunDirLock) -> RunSpec | None:
        """_prepare, or in a SLURM job of several nodes its node's part (train/nodes.py): node 0 prepares and
        leaves its result for the others, which wait for it instead of taking the lock themselves."""
        nodes, run_dir = self.ctx.nodes, self.ctx.run_dir
        if nodes.index > 0:
            return wait_for_node0(nodes, run_dir, lambda: dataclasses.replace(resolve(self.cfg), cwd=str(self.ctx.cwd)))
        if nodes.count <= 1:
            return self._prepare(lock)
        spec, self._spec_marker = prepare_on_node0(nodes, run_dir, lambda: self._prepare(lock),
                                                   lambda s: spawn_count(s) > 0)
        return spec

    def _prepare(self, lock: RunDirLock) -> RunSpec | None:
        """Steps 1-4: lock, validate, the resume rule, the record. None: nothing to do (a complete run)."""
        run_dir = self.ctx.run_dir
        lock.acquire()  # held until the job ends, ranks included
        clear_markers(run_dir)
        if lock.stale:
            print(f"humanline: note: {run_dir} was locked by a job that is gone ({lock.stale}); taking it over",
                  file=sys.stderr)
        # under torchrun every rank is one of WORLD_SIZE: backend.nproc is that count
        launched = self.ctx.world_size if self.ctx.distributed else None
        spec = dataclasses.replace(resolve(self.cfg, launched), cwd=str(self.ctx.cwd))
        if not self.ctx.distributed:  # the ranks this job starts, each on a device of its own (torchrun placed its own)
            b = spec.backend_cfg
            check_launch(b.strategy.value, b.nproc, b.precision.value,
                         this_machine("cpu" if b.device.value == "cpu" else "cuda"), self.allocation)
        if is_complete(run_dir, spec.config, spec.resume):
            print(f"humanline: skipping {run_dir}: already complete (resume=false starts over)", file=sys.stderr)
            return None
        prepare_run_dir(run_dir, spec.config, spec.resume)
        if self.record is not None:
            self.record.save(run_dir)
        return spec

    def _join_torchrun(self, lock: RunDirLock) -> Outcome:
        """torchrun started this process as one rank and every rank ran Hydra: rank 0 prepares its run dir
        and hands the spec and the dir to the others (or the error that stopped it: every rank ends)."""
        import torch.distributed as tdist

        from humanline_cli.backend import init_distributed

        backend = self.cfg.get("backend") or {}  # the spec is rank 0's, not here yet
        # the configured device picks the process group's backend (backend=cpu on a CUDA host: gloo, CPU tensors)
        init_distributed(str(backend.get("device", "auto")), backend.get("timeout_s"))
        box: list = [None, None, None]  # spec, run dir, the exception that stopped rank 0
        log = None
        if self.ctx.main:
            try:
                box[0], box[1] = self._prepare(lock), str(self.ctx.run_dir)
            except Exception as e:  # noqa: BLE001 - handed to every rank, raised by each
                box[2] = e
        # preparing (hashing a checkpoint to resume, moving old outputs aside) can outlast backend.timeout_s: the
        # others wait for it in the gloo wait group, so the broadcast that hands the result out never waits long
        wait_for_rank0()
        tdist.broadcast_object_list(box, src=0)
        spec, run_dir, error = box
        try:
            if error is not None:
                raise error
            if spec is None:
                return Outcome(0)
            ctx = dataclasses.replace(self.ctx, run_dir=Path(run_dir))
            log = _attach_log(ctx.run_dir) if ctx.main else None
            run_rank(spec, ctx)
        finally:
            _detach_log(log)
        if tdist.is_initialized():
            tdist.destroy_process_group()
        return Outcome(0)


def spawn_count(spec: RunSpec) -> int:
    """How many ranks this job starts itself (0: it runs here, in this process)."""
    b = spec.backend_cfg
    return b.nproc if b.strategy.value in ("ddp", "fsdp") and b.nproc > 1 else 0


def _attach_log(run_dir: Path) -> logging.Handler:
    """train.log: every log record of the job (the console shows warnings and our own lines only)."""
    handler = logging.FileHandler(run_dir / LOG)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.getLogger().addHandler(handler)
    return handler


def _detach_log(handler: logging.Handler | None) -> None:
    if handler is not None:
        logging.getLogger().removeHandler(handler)
        handler.close()


# ------------------------------------------------------------------ the ranks this job starts
def _launch(spec: RunSpec, ctx: Context, nproc: int) -> None:
    from humanline_cli.train.build import prepare_model, prepare_world
    from humanline_cli.train.launch import launch

    # the bundled world is built here, once, on first use (minutes of CPU SFT), before any rank exists:
    # ranks waiting for another rank's build would sit in a collective past backend.timeout_s
    prepare_world(spec)
    prepare_model(spec)  # a packaged model is converted here too, once, for the same reason
    launch(_rank_main, (spec, str(ctx.run_dir), str(ctx.cwd)), ctx.run_dir, nproc)


def _rank_main(spec: RunSpec, run_dir: str, cwd: str) -> None:
    """One rank started by `launch` (a fresh process): run it. A failure is recorded (by run_rank) and
    ends this process at once with the CLI's exit code: the elastic agent then stops every other rank,
    and the launching process reports this rank's own message."""
    import torch.distributed as tdist

    signal.signal(signal.SIGTERM, _sigterm_default)  # outside StopSignal's reach (e.g. cleaning up after a failure)
    rank, world = launcher_ranks()
    try:
        run_rank(spec, Context(Path(run_dir), Path(cwd), rank, world))
    except KeyboardInterrupt:  # Ctrl-C: rank 0 wrote failed.json (with the step); leave at once, as a
        _leave(130)             # failure does (a normal exit can wait on the process group's threads)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - every failure ends the rank the same way
        if failures.kind_of(e) == "bug":  # a bug: its traceback on this rank's stderr, as one process shows it
            import traceback

            traceback.print_exception(e, file=sys.stderr)
        # no destroy_process_group: under NCCL it can wait on the peers this failure left in a collective
        _leave(failures.EXIT[failures.kind_of(e)])
    if tdist.is_initialized():
        tdist.destroy_process_group()


def _leave(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    release_semaphores()
    os._exit(code)


def _sigterm_default(signum, frame) -> None:
    """SIGTERM outside StopSignal's reach: the agent's SIGTERM to the surviving ranks when one failed may land
    while they clean up; die as SIGTERM's default would, semaphores released first."""
    die_by_sigterm()


# ------------------------------------------------------------------ one rank: set up, train, finish
def resumed_split(spec: RunSpec, run_dir: Path) -> RunSpec:
    """Under train.micro_batch_size=auto, a run resuming from a checkpoint trains the micro-batch the checkpoint
    records (the one auto chose when the run started), not the one this host's free memory would pick: the split
    changes a step's sums in the last bits, so a resume is exact only with the same one. The memory fit then
    checks that size as if it were set by hand."""
    micro = recorded_micro_batch(Checkpoints(run_dir, 0).latest()) if spec.resume and spec.train.micro_auto else None
    if micro is None:
        return spec
    note = f"train.micro_batch_size=auto: {micro}, the micro-batch the resumed checkpoint was trained with"
    return dataclasses.replace(spec, train=dataclasses.replace(spec.train, micro_batch_size=micro, micro_auto=False),
                               notes=(*spec.notes, note))


def run_rank(spec: RunSpec, ctx: Context, console: Console | None = None) -> dict:
    """One rank's job (the only rank in one process). Under torch.distributed every rank calls it with the
    same spec and run dir; only rank 0 writes outputs (metrics, samples, summary, wandb, model, failed.json)."""
    import transformers

    console = console or Console(stderr=True)
    transformers.utils.logging.disable_progress_bar()  # our rich bars are the progress display
    timer = PhaseTimer()
    at = StepMarker()
    began = provenance.code_state()  # before setup: the code this run starts on
    if ctx.main:
        ctx.run_dir.mkdir(parents=True, exist_ok=True)
    tracker = parts = None
    peer_failed = None
    if ctx.distributed:
        def peer_failed() -> bool:  # a rank recorded a failure (a Preempted record is the same signal, not one)
            rec = failures.root_cause(ctx.run_dir)
            return rec is not None and rec["type"] != "Preempted"
    trained = False
    try:
        # SIGTERM: a checkpoint at the next step boundary, then Preempted; its previous handler is back for the cleanup
        with StopSignal(peer_failed) as stop:
            try:
                with timer.phase("setup"):
                    parts = build_parts(resumed_split(spec, ctx.run_dir), timer, ctx.run_dir)
                    spec = parts.spec  # its micro-batch fitted to this device's memory
                    if not ctx.main:
                        console = Console(file=io.StringIO())  # one progress display, rank 0's
                    tr = spec.train
                    checkpoints = Checkpoints(ctx.run_dir, tr.checkpoint_every, tr.keep_checkpoints, parts.dist, console,
                                              record=run_record(spec.config, tr.micro_batch_size))
                    resume_from = checkpoints.latest() if spec.resume else None
                    tracker = Tracker(ctx.run_dir, spec.config, spec.wandb, ctx.run_dir.name,
                                      resume=resume_from is not None) if ctx.main else NullTracker()
                    wait_for_rank0()  # rank 0 starts wandb (seconds): the others wait outside the group's timeout
                resumed = int(resume_from.name.removeprefix("step_")) if resume_from is not None else None
                if ctx.main:
                    provenance.record_start(ctx.run_dir, began, fresh=resume_from is None)
                if resumed is not None:
                    console.print(f"humanline: resuming {ctx.run_dir} from step {resumed} of {tr.steps} "
                                  f"(checkpoints/{resume_from.name}; resume=false starts over)", soft_wrap=True,
                                  markup=False, highlight=False)
                header(spec, parts, console)
                if resume_from is None and parts.evaluator is not None:  # a resumed run: from the checkpoint
                    with timer.phase("eval"):
                        parts.evaluator.set_baseline(parts.eval_sampler)
                last = train(spec.train, spec.humanline, parts, stop, objective=spec.objective_cfg,
                             rule=ReferenceRule.from_spec(spec.humanline, spec.regime, spec.correction),
                             correction=spec.correction, tracker=tracker, timer=timer,
                             console=console, eval_every=spec.eval_cfg.every, checkpoints=checkpoints,
                             resume_from=resume_from, at=at)
                trained = True  # an interruption from here on lands after training
                summary = finish(spec, parts, tracker, timer, ctx.run_dir, last, resumed)
                tracker.finish(0)
                if ctx.main:
                    print_summary(summary, ctx.run_dir, console)
                return summary
            except BaseException as caught:
                e = _record_failure(caught, ctx, spec, timer, tracker, trained, at)
                if e is not caught:
                    raise e from caught
                raise
    finally:  # engines, samplers and wandb are released whatever happened (a sweep runs on in this process)
        if parts is not None:
            parts.close()
        del parts
        release_freed()  # the next job of a sweep in this process sizes itself against the host's memory
        if tracker is not None:
            tracker.finish(0)


def _record_failure(caught: BaseException, ctx: Context, spec: RunSpec, timer: PhaseTimer, tracker, trained: bool,
                    at: StepMarker) -> BaseException:
    """A rank's failure recorded (failed.json on rank 0, wandb closed as failed); returns the exception to raise:
    `caught` itself, its one-line form (an out-of-memory), or that line with what a failed write of failed.json did."""
    e = failures.out_of_memory(caught) or caught  # one line instead of torch's allocator traceback
    where = interrupted_where(e, trained, at) if isinstance(e, KeyboardInterrupt) else None
    if where is not None:
        ignore_ctrl_c()
    failed = failures.failure_record(e, timer.report(), where)
    if ctx.distributed:
        failed = _rank_failure(e, ctx, spec, failed, where, timer)
    note = failures.write_failed(ctx.run_dir, failed) if ctx.main else None
    if note is None and ctx.main and isinstance(e, RunFailed) and isinstance(e.__cause__, OSError):
        note = "failed.json written"  # a failed write (a full disk): the line says what failed.json got
    if tracker is not None:
        tracker.finish(1)
    if note is not None and isinstance(e, (UserError, RunFailed)):  # a full disk: the error line says so
        return type(e)(f"{e}; {note}")
    return e


def _rank_failure(e: BaseException, ctx: Context, spec: RunSpec, failed: dict, where: str | None,
                  timer: PhaseTimer) -> dict:
    """Under DDP/FSDP every rank records its own cause; rank 0's failed.json reports the root one (another
    rank's, when rank 0's own error only says that rank went away)."""
    if where is not None:  # Ctrl-C: the step, for rank 0 to report when a peer's exit reached it first
        failures.record_interrupt(ctx.run_dir, ctx.rank, where)
        return failed
    failures.record(ctx.run_dir, ctx.rank, e, timer.report(), spec.backend_cfg.timeout_s)
    rec = failures.root_cause(ctx.run_dir) if ctx.main else None
    failed = failures.failed_json(rec) if rec is not None else failed
    seen = failures.interrupted(ctx.run_dir) if ctx.main and failures.is_secondary(e) else None
    if seen is not None:  # Ctrl-C reached another rank first: rank 0 only saw it leave
        failed = failures.interrupted_json(seen, timer.report())
    return failed
