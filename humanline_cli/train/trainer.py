"""The training loop, top to bottom. One loop for every objective and regime: a source yields
StepData (micro-batches for one optimizer step); the loop does forward/backward, gradient
clipping, the humanline reference sync, the optimizer step, logging, evaluation and checkpoints
(a resumed run restores one before its first step and continues exactly where it stopped)."""
from __future__ import annotations

import contextlib
import math
import time

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from humanline_cli.backend import all_agree, all_reduce_sum, clip_grad_norm
from humanline_cli.config import RunSpec
from humanline_cli.core.batches import n_units, to_device
from humanline_cli.core.humanline import ReferenceRule
from humanline_cli.core.objectives import compute_loss, loss_count, micro_batch_weights, step_z0
from humanline_cli.core.optim import make_optimizer, make_scheduler
from humanline_cli.core.reference import reference_moves
from humanline_cli.errors import PeerFailed, Preempted, RunFailed
from humanline_cli.eval.evaluator import flat_metrics
from humanline_cli.sources.source import is_filler
from humanline_cli.train.build import Parts
from humanline_cli.train.checkpoint import Checkpoints
from humanline_cli.train.signals import StepMarker, StopSignal
from humanline_cli.train.timing import PhaseTimer
from humanline_cli.train.tracking import Tracker

SUMMED = ("_units", "_n_tokens", "_n_processed")  # counts: summed, not averaged


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


def _short(x) -> str:
    text = x if isinstance(x, str) else getattr(x, "text", None) or repr(x)
    return repr(text[:30] + "..." if len(text) > 30 else text)


def blame(batch, most: int = 3) -> str:
    """', units: prompt '...' (rewards [...]), ...': the units a micro-batch was built from (sources attach
    them as `batch.units`), for the message of a non-finite loss; '' when the batch does not carry them."""
    units = getattr(batch, "units", None)
    if not units:
        return ""
    names = []
    for u in units[:most]:
        extra = f" (rewards {list(u.rewards)})" if hasattr(u, "rewards") else ""
        names.append(f"prompt {_short(u.prompt)}{extra}")
    more = f" and {len(units) - most} more" if len(units) > most else ""
    return f", units: {'; '.join(names)}{more}"


def _grad_sync(model, micro_batch: int, n_micro: int):
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


def train(spec: RunSpec, parts: Parts, tracker: Tracker, timer: PhaseTimer, console=None,
          checkpoints: Checkpoints | None = None, resume_from=None, stop: StopSignal | None = None,
          at: StepMarker | None = None) -> dict:
    """Run optimizer steps 1..train.steps (or, with `resume_from`, a checkpoint dir, the steps after
    it); write a checkpoint every `checkpoints.every` steps. Returns the last logged train metrics."""
    policy, reference, tr = parts.policy, parts.reference, spec.train
    model = parts.train_model or policy  # what the gradient flows through (a DDP wrapper under DDP)
    dist = parts.dist
    reduce_sum = (lambda x: all_reduce_sum(x.to(parts.backend.device), dist).cpu()) if dist.enabled else None
    objective_cfg, eval_every = spec.objective_cfg, spec.eval_cfg.every
    rule = ReferenceRule.from_spec(spec.humanline, spec.regime)
    if hasattr(policy, "reshard"):  # FSDP2: an earlier forward (the baseline eval) may leave the root's
        policy.reshard()            # unsharded tensors registered; the optimizer must hold the shards
    opt = make_optimizer(policy, tr.lr, tr.weight_decay)
    sched = make_scheduler(opt, tr.steps, tr.warmup_ratio, tr.schedule)
    params = [p for p in policy.parameters() if p.requires_grad]
    last: dict = {}
    start = 0
    if resume_from is not None:  # weights, optimizer, scheduler, data position, RNGs, timers, baseline
        start, last = checkpoints.load(resume_from, parts, opt, sched, timer)
    skipped = int(last.pop("skipped_steps", 0))  # steps with no usable unit so far (train.max_skipped_fraction)
    moving = reference_moves(spec.humanline, spec.regime)  # the reference can leave the starting weights

    def checkpoint(step: int, now: bool = False) -> None:  # at the very end of a step: nothing of it is left to do
        if checkpoints is not None and (checkpoints.due(step) or (now and checkpoints.every > 0)):
            with timer.phase("checkpoint"):
                checkpoints.save(step, parts, opt, sched, timer, {**last, "skipped_steps": skipped} if skipped else last,
                                 moving)

    def stop_here(step: int) -> None:
        """SIGTERM reached some rank during this step: every rank stops here, after a checkpoint."""
        if not (checkpoints is not None and checkpoints.due(step)):
            checkpoint(step, now=True)
        where = f"stopped by SIGTERM after step {step} of {tr.steps}"
        if checkpoints is None or checkpoints.every <= 0:
            raise Preempted(f"{where}; no checkpoint (train.checkpoint_every=0), so a rerun starts over")
        if not (checkpoints.root / f"step_{step}" / "state.json").is_file():  # a full disk (warned above)
            raise Preempted(f"{where}; its checkpoint could not be written: rerun the same command to resume "
                            f"from the last one written")
        raise Preempted(f"{where}; checkpoint checkpoints/step_{step} written: rerun the same command to resume")

    progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.fields[info]}"), console=console, transient=False)
    at = at or StepMarker()
    with progress, at:  # a Ctrl-C in the loop carries its step (Interrupted)
        bar = progress.add_task("train", total=tr.steps, completed=start, info="")
        if stop is not None:
            stop.arm(True)  # from here SIGTERM waits for the step boundary
        for step in range(start + 1, tr.steps + 1):
            at.step = step
            # SIGTERM during the previous step, on any rank: all stop before this one. Agreed at the top of
            # a step (where every rank waits for the others anyway, at the step's first collective)
            if stop is not None and step > start + 1 and not all_agree(not stop.requested, dist):
                stop_here(step - 1)
            data = parts.source.next_step(step)  # online sources sample/label here (their own timers)
            if not data.micro_batches:  # an online round with no usable pair/example (every score tied)
                skipped += 1
                tracker.log(step, {"skipped": 1.0, "skipped_steps": skipped, **data.info})
                if skipped > tr.max_skipped_fraction * tr.steps:  # the run can no longer pass: stop now
                    raise RunFailed(f"{skipped} of {tr.steps} steps skipped by step {step} (online rounds with no "
                                    f"usable pair/example: every score tied, or gaps below the data's min_gap), more "
                                    f"than train.max_skipped_fraction={tr.max_skipped_fraction:g} of the run")
                if skipped == 1 and console is not None:
                    console.print(f"humanline: warning: step {step} skipped: its round gave no usable pair/example "
                                  f"(skipped steps are counted in metrics.jsonl; more than "
                                  f"train.max_skipped_fraction={tr.max_skipped_fraction:g} of the run fails it)",
                                  soft_wrap=True, markup=False, highlight=False)
                progress.advance(bar)
                checkpoint(step)
                continue
            if rule.at_round_start(data.new_round):
                with timer.phase("sync"):  # plain online: the reference is the round's starting policy
                    reference.sync(policy)
            t0 = time.perf_counter()
            log_now = step == 1 or step % tr.log_every == 0 or step == tr.steps
            with timer.phase("train"):
                rows = []
                mbs = [to_device(mb, parts.backend.device) for mb in data.micro_batches]
                # each micro-batch's mean loss weighted by its share of the GLOBAL batch's units or
                # tokens (times world_size: DDP/FSDP average gradients over ranks); a filler (padding a
                # rank's shorter share, so collectives stay in lockstep) runs with weight 0
                fillers = [is_filler(mb) for mb in data.micro_batches]
                counts = [0.0 if f else loss_count(objective_cfg, mb) for mb, f in zip(mbs, fillers)]
                # per micro-batch index over all ranks (every rank has as many, fillers pad): the last entry is
                # the step's total, the others each micro-step's count (aggregation=dapo_micro divides by them)
                sums = torch.tensor(counts + [sum(counts)], dtype=torch.float64)
                sums = [float(x) for x in (reduce_sum(sums) if reduce_sum else sums)]
                weights = micro_batch_weights(objective_cfg, counts, sums[-1], dist.world_size,
                                              data.round_tokens_per_step, micro_totals=sums[:-1])
                with parts.backend.autocast():
                    z0 = step_z0(objective_cfg, policy, reference, mbs, spec.humanline, reduce_sum, fillers)
                for i, mb in enumerate(mbs):
                    with _grad_sync(model, i, len(mbs)):
                        with parts.backend.autocast():
                            loss, m = compute_loss(objective_cfg, model, reference, mb, spec.humanline, log_now, z0)
                        # agreed by all ranks: one rank stopping here would leave the others in backward's
                        # gradient reduce; the rank that saw the NaN names it, the others stop quietly
                        finite = bool(torch.isfinite(loss))
                        if not all_agree(finite, dist):
                            if not finite:
                                raise RunFailed(f"loss is {float(loss.detach())} at step {step}, micro-batch {i + 1} of "
                                                f"{len(mbs)}{blame(data.micro_batches[i])} (check their scores, "
                                                f"or try a lower train.lr)")
                            raise PeerFailed(f"another rank's loss is not finite at step {step}")
                        (loss * weights[i]).backward()
                    m["loss"] = float(loss.detach())
                    m["_units"] = n_units(mb)
                    m["_weight"] = counts[i]
                    if fillers[i]:  # counts nothing: summed counts and the histogram zeroed, weight 0 for the rest
                        m.update({k: 0.0 for k in SUMMED if k in m})
                        if "_logratio_hist" in m:
                            m["_logratio_hist"] = [0] * len(m["_logratio_hist"])
                    rows.append(m)
                grad_norm = clip_grad_norm(params, tr.max_grad_norm, dist)
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
            dt = time.perf_counter() - t0
            m = _mean_metrics(rows, reduce_sum)
            metrics = {k: v for k, v in m.items() if not k.startswith("_")}
            metrics.update(lr=lr_now, grad_norm=grad_norm, tokens_per_s=m["_n_tokens"] / max(dt, 1e-9),
                           units=int(m["_units"]), **data.info)
            metrics["useful_token_fraction"] = m["_n_tokens"] / max(m["_n_processed"], 1.0)  # real / forward tokens
            if hasattr(reference, "step_stats"):  # CachedReference: how much of the reference forward was skipped
                metrics.update(reference.step_stats())
            last = metrics
            metrics["wall_s"] = timer.elapsed()
            metrics.update({f"time/{k}": v for k, v in timer.report().items() if k != "total"})
            if log_now:
                tracker.log(step, metrics)
                hist = [sum(c) for c in zip(*(r["_logratio_hist"] for r in rows))]
                tracker.log_histogram(step, hist)
            if eval_every and parts.evaluator is not None and step % eval_every == 0 and step < tr.steps:
                with timer.phase("eval"):
                    parts.eval_sampler.push_weights(policy)
                    ev = parts.evaluator.evaluate(parts.eval_sampler)
                tracker.log(step, {**flat_metrics(ev), "wall_s": timer.elapsed()})
            info = f"loss {metrics['loss']:.4f}"
            if "humanline/unclamped_fraction" in metrics:
                info += f"  unclamped {metrics['humanline/unclamped_fraction']:.3f}"
            progress.update(bar, advance=1, info=info)
            checkpoint(step)
        if stop is not None:
            stop.arm(False)
    return {**last, "skipped_steps": skipped} if skipped else last
