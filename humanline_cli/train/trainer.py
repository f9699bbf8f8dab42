"""The training loop, top to bottom. One loop for every objective and regime: a source yields StepData
(the micro-batches of one optimizer step); each step is: next batch, loss (the humanline clamp lives one
call down, in the objective), backward, clip, reference sync, optimizer step, log. What keeps ranks in
lockstep (agreement, fillers, weights over the global batch), skipped steps, checkpoints, SIGTERM and the
progress bar are the named helpers below the loop. A resumed run restores a checkpoint before its first
step and continues exactly where it stopped."""
from __future__ import annotations

import contextlib
import math
import time

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from humanline_cli.backend import all_agree, all_reduce_sum, clip_grad_norm
from humanline_cli.config import TrainSpec
from humanline_cli.core.batches import n_units, to_device
from humanline_cli.core.corrections import NO_CORRECTION, CorrectionSpec
from humanline_cli.core.humanline import HumanlineSpec, ReferenceRule
from humanline_cli.core.objectives import compute_loss, loss_count, micro_batch_weights, step_z0
from humanline_cli.core.optim import make_optimizer, make_scheduler
from humanline_cli.errors import PeerFailed, Preempted, RunFailed
from humanline_cli.eval.evaluator import flat_metrics
from humanline_cli.sources.source import is_filler
from humanline_cli.train.behaviour import with_behaviour
from humanline_cli.train.build import Parts
from humanline_cli.train.checkpoint import Checkpoints
from humanline_cli.train.signals import StepMarker, StopSignal
from humanline_cli.train.timing import PhaseTimer
from humanline_cli.train.tracking import Tracker

SUMMED = ("_units", "_n_tokens", "_n_processed")  # counts: summed, not averaged


def train(tr: TrainSpec, hl: HumanlineSpec, parts: Parts, stop: StopSignal | None = None, *, objective,
          rule: ReferenceRule, tracker: Tracker, timer: PhaseTimer, console=None, eval_every: int = 0,
          checkpoints: Checkpoints | None = None, resume_from=None, at: StepMarker | None = None,
          correction: CorrectionSpec = NO_CORRECTION) -> dict:
    """Run optimizer steps 1..tr.steps (or, with `resume_from`, a checkpoint dir, the steps after it) of
    `objective` with humanline `hl` and the stale-data `correction`; the reference moves when `rule` says.
    Returns the last logged metrics."""
    policy, reference = parts.policy, parts.reference
    model = parts.train_model  # what the gradient flows through (a DDP wrapper under DDP), with the forward options
    ranks = Ranks(parts)
    release_unsharded(policy)
    opt = make_optimizer(policy, tr.lr, tr.weight_decay)
    sched = make_scheduler(opt, tr.steps, tr.warmup_ratio, tr.schedule)
    params = [p for p in policy.parameters() if p.requires_grad]
    start, last = checkpoints.load(resume_from, parts, opt, sched, timer) if resume_from is not None else (0, {})
    skips = Skips(tr, int(last.pop("skipped_steps", 0)), tracker, console)
    save = Saver(checkpoints, parts, opt, sched, timer, rule.moves, tr.steps)
    at = at or StepMarker()
    with Bar(console, tr.steps, start) as bar, at, armed(stop):  # a Ctrl-C in the loop carries its step
        for step in range(start + 1, tr.steps + 1):
            at.step = step
            # SIGTERM during the previous step, on any rank: all stop before this one, after a checkpoint
            if stop is not None and step > start + 1 and not ranks.agree(not stop.requested):
                save.preempted(step - 1, skips.attach(last))
            data = parts.source.next_step(step)  # online sources sample/label here (their own timers)
            if not data.micro_batches:  # an online round with no usable pair/example (every score tied)
                skips.skip(step, data.info)
                bar.advance()
                save.at_end_of(step, skips.attach(last))
                continue
            if rule.at_round_start(data.new_round):
                with timer.phase("sync"):  # plain online: the reference is the round's starting policy
                    reference.sync(policy)
            t0 = time.perf_counter()
            log_now = step == 1 or step % tr.log_every == 0 or step == tr.steps
            with timer.phase("train"):
                # offline data under tis/mis/decoupled: the generating policy's log-probs, once per sequence
                mbs = with_behaviour([to_device(mb, parts.backend.device) for mb in data.micro_batches],
                                     parts.behaviour)
                fillers, counts, weights = step_weights(objective, data, mbs, ranks)
                with parts.backend.autocast():
                    z0 = step_z0(objective, model.unwrapped(), reference, mbs, hl, ranks.reduce_sum, fillers)
                rows = []
                for i, mb in enumerate(mbs):
                    with grad_sync(model.module, i, len(mbs)):
                        with parts.backend.autocast():
                            # the humanline clamp and the stale-data correction live one call down
                            loss, m = compute_loss(objective, model, reference, mb, hl, log_now, z0, correction)
                        ranks.check_finite(loss, step, i, data.micro_batches)
                        (loss * weights[i]).backward()
                    rows.append(micro_row(m, loss, mb, counts[i], fillers[i]))
                grad_norm = clip_grad_norm(params, tr.max_grad_norm, parts.dist)
                if not math.isfinite(grad_norm):
                    raise RunFailed(f"gradient norm is {grad_norm} at step {step} (try a lower train.lr)")
            if rule.before_optimizer_step(step):
                # After backward and clipping, BEFORE optimizer.step: the reference becomes this
                # step's pre-update weights, so step t+1 measures log-ratios against step t.
                with timer.phase("sync"):
                    reference.sync(policy)
            with timer.phase("train"):
                lr_now = sched.get_last_lr()[0]
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            if rule.after_optimizer_step(step):
                # TR-DPO: AFTER the step (TRL's callback runs on_step_end), a weighted mix, not a copy
                with timer.phase("sync"):
                    reference.mix(policy, rule.mix_alpha)
            last = step_metrics(rows, ranks, lr_now, grad_norm, time.perf_counter() - t0, data.info, reference, timer)
            if log_now:
                tracker.log(step, last)
                tracker.log_histogram(step, [sum(c) for c in zip(*(r["_logratio_hist"] for r in rows))])
            if eval_every and parts.evaluator is not None and step % eval_every == 0 and step < tr.steps:
                evaluate(parts, tracker, timer, step)
            bar.advance(last)
            save.at_end_of(step, skips.attach(last))
    return skips.attach(last)


# ------------------------------------------------------------------ ranks in lockstep
class Ranks:
    """The collectives the loop needs, as no-ops in one process: sums over ranks, and decisions every rank
    takes together (one rank stopping alone would leave the others waiting in a collective)."""

    def __init__(self, parts: Parts):
        self.dist = parts.dist
        device = parts.backend.device
        self.reduce_sum = (lambda x: all_reduce_sum(x.to(device), self.dist).cpu()) if self.dist.enabled else None

    def agree(self, flag: bool) -> bool:
        return all_agree(flag, self.dist)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce_sum(x) if self.reduce_sum is not None else x

    def check_finite(self, loss: torch.Tensor, step: int, i: int, micro_batches) -> None:
        """Agreed by all ranks: one rank stopping here would leave the others in backward's gradient reduce;
        the rank that saw the NaN names it and the units it came from, the others stop quietly."""
        finite = bool(torch.isfinite(loss))
        if self.agree(finite):
            return
        if not finite:
            raise RunFailed(f"loss is {float(loss.detach())} at step {step}, micro-batch {i + 1} of "
                            f"{len(micro_batches)}{blame(micro_batches[i])} (check their scores, or try a lower "
                            f"train.lr)")
        raise PeerFailed(f"another rank's loss is not finite at step {step}")


def step_weights(objective, data, mbs, ranks: Ranks) -> tuple[list[bool], list[float], list[float]]:
    """Each micro-batch's mean loss is weighted by its share of the GLOBAL batch's units or tokens (times
    world_size: DDP/FSDP average gradients over ranks); a filler (padding a rank's shorter share, so
    collectives stay in lockstep) runs with weight 0. Returns (fillers, counts, weights)."""
    fillers = [is_filler(mb) for mb in data.micro_batches]
    counts = [0.0 if f else loss_count(objective, mb) for mb, f in zip(mbs, fillers)]
    # per micro-batch index over all ranks (every rank has as many, fillers pad): the last entry is the
    # step's total, the others each micro-step's count (aggregation=dapo_micro divides by them)
    sums = [float(x) for x in ranks.sum(torch.tensor(counts + [sum(counts)], dtype=torch.float64))]
    weights = micro_batch_weights(objective, counts, sums[-1], ranks.dist.world_size, data.round_tokens_per_step,
                                  micro_totals=sums[:-1])
    return fillers, counts, weights


def grad_sync(model, micro_batch: int, n_micro: int):
    """Gradient accumulation under DDP/FSDP2. DDP: all-reduce only on the last micro-batch (replicas
    hold full gradients anyway). FSDP2: reduce-scatter EVERY micro-batch, so between micro-batches each
    rank holds only its fp32 gradient shard (1/N of the model) instead of a full unsharded gradient
    (~32 GB more per rank for 8B); the sum of per-micro-batch reduce-scatters is the reduce-scatter of
    the sum, the same update up to float addition order, for N-1 more reduce-scatters per step."""
    last = micro_batch == n_micro - 1
    if hasattr(model, "no_sync") and not last:  # DDP
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(True)
    return contextlib.nullcontext()


def release_unsharded(policy) -> None:
    """FSDP2: an earlier forward (the baseline eval) may leave the root's unsharded tensors registered;
    the optimizer must hold the shards."""
    if hasattr(policy, "reshard"):
        policy.reshard()


# ------------------------------------------------------------------ metrics
def micro_row(m: dict, loss: torch.Tensor, mb, count: float, filler: bool) -> dict:
    """One micro-batch's metrics, with its weight (`_weight`) and counts for the step's mean; a filler counts
    nothing: summed counts and the histogram zeroed, weight 0 for the rest."""
    m["loss"] = float(loss.detach())
    m["_units"] = n_units(mb)
    m["_weight"] = count
    if filler:
        m.update({k: 0.0 for k in SUMMED if k in m})
        if "_logratio_hist" in m:
            m["_logratio_hist"] = [0] * len(m["_logratio_hist"])
    return m


def _mean_metrics(rows: list[dict], reduce_sum=None) -> dict:
    """Micro-batch metrics averaged with the same weights as the loss, over the whole global batch
    (every rank's micro-batches when `reduce_sum` sums across ranks); counts are summed."""
    keys = sorted({k for r in rows for k in r if not isinstance(r[k], list)})
    num = torch.tensor([sum(r[k] * (1.0 if k in SUMMED else r["_weight"]) for r in rows if k in r) for k in keys],
                       dtype=torch.float64)
    den = torch.tensor([1.0 if k in SUMMED else sum(r["_weight"] for r in rows if k in r) for k in keys],
                       dtype=torch.float64)
    if reduce_sum is not None:  # every rank has the same keys (same objective and settings)
        both = reduce_sum(torch.cat([num, den]))
        num, den = both[: len(keys)], both[len(keys):]
        den = torch.where(torch.tensor([k in SUMMED for k in keys]), torch.ones_like(den), den)
    return {k: float(n / d) if d > 0 else 0.0 for k, n, d in zip(keys, num.tolist(), den.tolist())}


def step_metrics(rows: list[dict], ranks: Ranks, lr: float, grad_norm: float, dt: float, info: dict, reference,
                 timer: PhaseTimer) -> dict:
    """The step's logged row: the global batch's weighted means, lr, gradient norm, throughput, the source's
    info, the reference cache's counters and the wall-clock so far."""
    m = _mean_metrics(rows, ranks.reduce_sum)
    metrics = {k: v for k, v in m.items() if not k.startswith("_")}
    metrics.update(lr=lr, grad_norm=grad_norm, tokens_per_s=m["_n_tokens"] / max(dt, 1e-9), units=int(m["_units"]),
                   **info)
    # real tokens over the decoder positions run: < 1 with padding, 1 packed, > 1 where a shared prompt runs once
    metrics["tokens_per_position"] = m["_n_tokens"] / max(m["_n_processed"], 1.0)
    metrics["tokens_processed"] = int(m["_n_processed"])  # the step's forward tokens: its counted work
    metrics.update(reference.step_stats())  # the log-prob cache: how much of the reference forward was skipped
    metrics["wall_s"] = timer.elapsed()
    metrics.update({f"time/{k}": v for k, v in timer.report().items() if k != "total"})
    return metrics


def evaluate(parts: Parts, tracker: Tracker, timer: PhaseTimer, step: int) -> None:
    """eval.every: the policy's evaluation mid-run, logged at this step."""
    with timer.phase("eval"):
        parts.eval_sampler.push_weights(parts.policy)
        ev = parts.evaluator.evaluate(parts.eval_sampler)
    tracker.log(step, {**flat_metrics(ev), "wall_s": timer.elapsed()})


def _short(x) -> str:
    text = x if isinstance(x, str) else getattr(x, "text", None) or repr(x)
    return repr(text[:30] + "..." if len(text) > 30 else text)


def blame(batch, most: int = 3) -> str:
    """', units: prompt '...' (rewards [...]), ...': the units a micro-batch was built from (sources attach
    them as `batch.units`), for the message of a non-finite loss; '' when the batch does not carry them."""
    units = batch.units
    if not units:
        return ""
    names = []
    for u in units[:most]:
        extra = f" (rewards {list(u.rewards)})" if hasattr(u, "rewards") else ""
        names.append(f"prompt {_short(u.prompt)}{extra}")
    more = f" and {len(units) - most} more" if len(units) > most else ""
    return f", units: {'; '.join(names)}{more}"


# ------------------------------------------------------------------ skipped steps, checkpoints, SIGTERM, progress
class Skips:
    """Steps whose online round gave no usable pair/example: counted in metrics.jsonl; the run fails as soon as
    more than train.max_skipped_fraction of it is skipped (it can no longer pass)."""

    def __init__(self, tr: TrainSpec, skipped: int, tracker: Tracker, console):
        self.tr, self.skipped, self.tracker, self.console = tr, skipped, tracker, console

    def skip(self, step: int, info: dict) -> None:
        tr = self.tr
        self.skipped += 1
        self.tracker.log(step, {"skipped": 1.0, "skipped_steps": self.skipped, **info})
        if self.skipped > tr.max_skipped_fraction * tr.steps:
            raise RunFailed(f"{self.skipped} of {tr.steps} steps skipped by step {step} (online rounds with no "
                            f"usable pair/example: every score tied, or gaps below the data's min_gap), more "
                            f"than train.max_skipped_fraction={tr.max_skipped_fraction:g} of the run")
        if self.skipped == 1 and self.console is not None:
            self.console.print(f"humanline: warning: step {step} skipped: its round gave no usable pair/example "
                               f"(skipped steps are counted in metrics.jsonl; more than "
                               f"train.max_skipped_fraction={tr.max_skipped_fraction:g} of the run fails it)",
                               soft_wrap=True, markup=False, highlight=False)

    def attach(self, last: dict) -> dict:
        """The metrics a checkpoint or the caller keeps, with the skipped count when there is one."""
        return {**last, "skipped_steps": self.skipped} if self.skipped else last


class Saver:
    """Checkpoints at the very end of a step (nothing of it is left to do), and the stop after SIGTERM."""

    def __init__(self, checkpoints: Checkpoints | None, parts: Parts, opt, sched, timer: PhaseTimer, moving: bool,
                 steps: int):
        self.checkpoints, self.parts, self.opt, self.sched, self.timer = checkpoints, parts, opt, sched, timer
        self.moving, self.steps = moving, steps  # moving: the reference can leave the starting weights
        # the last step too when an evaluation follows it: a failed end-of-run eval is rerun from there, not retrained
        self.end_eval = parts.evaluator is not None or parts.math500 is not None

    def at_end_of(self, step: int, last: dict, now: bool = False) -> None:
        now = now or (step == self.steps and self.end_eval)
        c = self.checkpoints
        if c is not None and (c.due(step) or (now and c.every > 0)):
            with self.timer.phase("checkpoint"):
                c.save(step, self.parts, self.opt, self.sched, self.timer, last, self.moving)

    def preempted(self, step: int, last: dict) -> None:
        """SIGTERM reached some rank during `step`: every rank stops here, after a checkpoint; raises Preempted."""
        c = self.checkpoints
        if not (c is not None and c.due(step)):
            self.at_end_of(step, last, now=True)
        where = f"stopped by SIGTERM after step {step} of {self.steps}"
        if c is None or c.every <= 0:
            raise Preempted(f"{where}; no checkpoint (train.checkpoint_every=0), so a rerun starts over")
        if not (c.root / f"step_{step}" / "state.json").is_file():  # a full disk (warned above)
            raise Preempted(f"{where}; its checkpoint could not be written: rerun the same command to resume "
                            f"from the last one written")
        raise Preempted(f"{where}; checkpoint checkpoints/step_{step} written: rerun the same command to resume")


@contextlib.contextmanager
def armed(stop: StopSignal | None):
    """While the loop runs, SIGTERM waits for the step boundary (elsewhere it stops the job at once)."""
    if stop is not None:
        stop.arm(True)
    yield
    if stop is not None:
        stop.arm(False)


class Bar:
    """The progress bar: steps done, elapsed time, the last loss (and unclamped fraction under humanline)."""

    def __init__(self, console, steps: int, start: int):
        self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("{task.fields[info]}"), console=console, transient=False)
        self.steps, self.start = steps, start

    def __enter__(self) -> Bar:
        self.progress.__enter__()
        self.task = self.progress.add_task("train", total=self.steps, completed=self.start, info="")
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def advance(self, metrics: dict | None = None) -> None:
        if metrics is None:
            self.progress.advance(self.task)
            return
        info = f"loss {metrics['loss']:.4f}"
        if "humanline/unclamped_fraction" in metrics:
            info += f"  unclamped {metrics['humanline/unclamped_fraction']:.3f}"
        self.progress.update(self.task, advance=1, info=info)
