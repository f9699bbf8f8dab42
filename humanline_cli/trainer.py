"""The training loop, top to bottom. One loop for every objective and regime: a source yields
StepData (micro-batches for one optimizer step); the loop does forward/backward, gradient
clipping, the humanline reference sync, the optimizer step, logging and evaluation."""
from __future__ import annotations

import math
import time

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .batches import n_units, to_device
from .build import Parts
from .config import RunSpec
from .errors import RunFailed
from .humanline import should_sync, sync_reference
from .objectives import compute_loss
from .optim import make_optimizer, make_scheduler
from .timing import PhaseTimer
from .tracking import Tracker


def _mean_metrics(rows: list[dict]) -> dict:
    keys = {k for r in rows for k in r if not isinstance(r[k], list)}
    return {k: sum(r[k] for r in rows if k in r) / sum(1 for r in rows if k in r) for k in keys}


def train(spec: RunSpec, parts: Parts, objective_cfg, tracker: Tracker, timer: PhaseTimer,
          eval_every: int = 0, console=None) -> dict:
    policy, reference, tr = parts.policy, parts.reference, spec.train
    opt = make_optimizer(policy, tr.lr, tr.weight_decay)
    sched = make_scheduler(opt, tr.steps, tr.warmup_ratio, tr.schedule)
    params = [p for p in policy.parameters() if p.requires_grad]
    last: dict = {}
    progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.fields[info]}"), console=console, transient=False)
    with progress:
        bar = progress.add_task("train", total=tr.steps, info="")
        for step in range(1, tr.steps + 1):
            data = parts.source.next_step(step)  # online sources sample/label here (their own timers)
            if not data.micro_batches:
                tracker.log(step, {"skipped": 1.0, **data.info})
                progress.advance(bar)
                continue
            if data.new_round and parts.reference_resets_each_round:
                with timer.phase("sync"):  # plain online: the reference is the round's starting policy
                    sync_reference(policy, reference)
            t0 = time.perf_counter()
            log_now = step == 1 or step % tr.log_every == 0 or step == tr.steps
            with timer.phase("train"):
                rows = []
                for mb in data.micro_batches:
                    mb = to_device(mb, parts.backend.device)
                    with parts.backend.autocast():
                        loss, m = compute_loss(objective_cfg, policy, reference, mb, spec.humanline, log_now)
                    if not torch.isfinite(loss):
                        raise RunFailed(f"loss is {float(loss.detach())} at step {step} (try a lower train.lr)")
                    (loss / len(data.micro_batches)).backward()
                    m["loss"] = float(loss.detach())
                    m["_units"] = n_units(mb)
                    rows.append(m)
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, tr.max_grad_norm))
                if not math.isfinite(grad_norm):
                    raise RunFailed(f"gradient norm is {grad_norm} at step {step} (try a lower train.lr)")
            if should_sync(spec.humanline, step):
                # After backward and clipping, BEFORE optimizer.step: the reference becomes this
                # step's pre-update weights, so step t+1 measures log-ratios against step t.
                with timer.phase("sync"):
                    sync_reference(policy, reference)
            with timer.phase("train"):
                lr = sched.get_last_lr()[0]
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            m = _mean_metrics(rows)
            n_tok = sum(r["_n_tokens"] for r in rows)
            metrics = {k: v for k, v in m.items() if not k.startswith("_")}
            metrics.update(lr=lr, grad_norm=grad_norm, tokens_per_s=n_tok / max(dt, 1e-9),
                           units=sum(r["_units"] for r in rows), **data.info)
            last = metrics
            metrics["wall_s"] = timer.elapsed()
            metrics.update({f"time/{k}": v for k, v in timer.report().items() if k != "total"})
            if log_now:
                tracker.log(step, metrics)
                hist = [sum(c) for c in zip(*(r["_logratio_hist"] for r in rows))]
                tracker.log_histogram(step, hist)
            if eval_every and step % eval_every == 0 and step < tr.steps:
                with timer.phase("eval"):
                    parts.eval_sampler.push_weights(policy)
                    ev = parts.evaluator.evaluate(parts.eval_sampler)
                tracker.log(step, {**{f"eval/{k}": v for k, v in ev.items() if isinstance(v, (int, float))},
                                   "wall_s": timer.elapsed()})
            info = f"loss {metrics['loss']:.4f}"
            if "humanline/unclamped_fraction" in metrics:
                info += f"  unclamped {metrics['humanline/unclamped_fraction']:.3f}"
            progress.update(bar, advance=1, info=info)
    return last
