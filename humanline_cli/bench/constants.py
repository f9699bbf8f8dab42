"""`humanline bench constants=true [overrides]`: the cost model's constants (report/predict.py), measured on
this machine with the run's own parts (the composed online config: model, sampler, labeller, batch, lengths,
threads), written to a JSON file `humanline report --target FILE` reads.

- generation: the run's sampler on the run's prompts and sampling settings at call sizes of 1, prompts / 64,
  prompts / 16, prompts / 4 and `prompts` prompts x n samples (prompts=64 by default; give the largest call the
  sweep makes, e.g. prompts=1024 for stale-64 rounds of 1024 prompts), each timed 3 to 15 times, as many as
  span about 3 s (median); the fixed
  cost per call is a call of one sequence and one token; the latency per decoding step comes from the smallest
  real call (one wave: latency-bound), the peak tokens/s from the largest (throughput-bound), and every size's
  tokens/s is kept as the sampler's curve (the report interpolates it at each call's size); each inner size is
  predicted from its neighbours as a check;
- labelling: the task's labeller on the largest call's completions, seconds per completion;
- push and sync: sampler.push_weights(policy) and reference.sync(policy), 5 times each (median; fixed costs at
  this model's size: the bytes are inside them);
- training: the real loop (trainer.train, the online source included) for `constant_steps` steps (12) at the
  run's batch size and at half of it (after an untimed 3-step run whose `other` beyond its steps' share is the
  run's one-time cost, `other_once_s`); every step's train phase against its forward tokens (metrics
  `tokens_processed`), the first step of each dropped (allocation); a least-squares line gives the per-step fixed
  cost and the FLOP/s of the per-token part (F x P x tokens / FLOP/s, F as the model counts it); the loop's time
  outside the phases per step, against the step's forward tokens at the two batch sizes, is `other` (a fixed part
  and a per-token part: collation tokenizes every sequence); then the run's batch once more with data.async_lag=1
  (the sampler process beside the trainer): each phase's time there over its time alone is an `async_*_factor`;
- the sampler inside the loop: the generation calls the two runs without the sampler process made, after each
  run's first, against the curve's prediction for the same call; the median ratio is `sample_loop_factor` (calls
  timed back to back and the same calls between optimizer steps differed by 0-15% here,
  from one session to the next).
The training constants are measured first, so that the generation calls are timed in a process that has
trained, as a run's are.
The machine's load (/proc/loadavg) before and after is recorded: on a shared machine the constants hold only
for a sweep run under the same load.
"""
from __future__ import annotations

import io
import math
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

from humanline_cli.errors import UserError

REPEAT_SPAN_S = 3.0  # seconds of timed calls per generation size (3 to 15 calls)


def call_sizes(prompts: int) -> tuple[int, ...]:
    """Prompts per timed generation call (x n samples each): one, then `prompts` / 64, / 16, / 4 and `prompts`
    (at least two sizes above one; repeated sizes once)."""
    sizes = {1, max(2, prompts // 64), max(2, prompts // 16), max(2, prompts // 4), max(3, prompts)}
    return tuple(sorted(sizes))


def _loadavg() -> str | None:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return None


def compose_online(overrides: list[str], extra: tuple[str, ...] = ()):
    from humanline_cli.config import compose_train, resolve

    spec = resolve(compose_train([*overrides, *extra]))
    if spec.regime != "online":
        raise UserError("bench constants=true measures an online run's constants: add data=online (or a regime)")
    return spec


def _median_time(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def generation_constants(source, concurrency: int, sizes: tuple[int, ...]) -> dict:
    """Call sizes `sizes` (prompts x n) on the run's sampler: per-call fixed cost, latency per decoding step,
    peak tokens/s, tokens/s at every size (the curve), and each inner size predicted from its neighbours."""
    from humanline_cli.core.interfaces import SamplingParams
    from humanline_cli.report.predict import Call, call_s
    from humanline_cli.rewards.scorers import checked

    rows, enc, params = source.rows, source.encoder, source.params
    sampler = source.sampler
    sampler.push_weights(source.policy)
    one = SamplingParams(**{**vars(params), "n": 1, "max_new_tokens": 1, "seed": 1})
    fixed, _ = _median_time(lambda: sampler.generate([enc.prompt_ids(rows[0]["prompt"])], one), 5)
    calls = []
    for k, size in enumerate(sizes):
        prompts = [enc.prompt_ids(rows[i % len(rows)]["prompt"]) for i in range(size)]
        p = SamplingParams(**{**vars(params), "seed": 7 + k})
        t0 = time.perf_counter()
        sampler.generate(prompts, p)  # untimed: the first call at a new shape
        # a short call is timed often enough to span about REPEAT_SPAN_S seconds: one call of a few tenths of a
        # second moves by a quarter between measurements on a shared host, the median of many moves less
        repeats = min(15, max(3, math.ceil(REPEAT_SPAN_S / max(time.perf_counter() - t0, 1e-3))))
        s, out = _median_time(lambda prompts=prompts, p=p: sampler.generate(prompts, p), repeats)
        lengths = [len(ids) for ids in out.token_ids]
        calls.append({"prompts": size, "sequences": len(lengths), "tokens": sum(lengths), "longest": max(lengths),
                      "seconds": s, "repeats": repeats, "tokens_per_s": sum(lengths) / max(s - fixed, 1e-9),
                      "completions": out})
    small, big = calls[0], calls[-1]
    waves = math.ceil(small["sequences"] / concurrency)
    decode_step = max(small["seconds"] - fixed, 1e-9) / (waves * small["longest"])
    curve = [(c["sequences"], c["tokens_per_s"]) for c in calls]
    checks = []
    for i in range(1, len(calls) - 1):
        c = calls[i]
        t = sampler_target({"call_fixed_s": fixed, "sample_tokens_per_s": big["tokens_per_s"],
                            "decode_step_s": decode_step, "concurrency": concurrency,
                            "sample_curve": curve[:i] + curve[i + 1:]})
        checks.append({"sequences": c["sequences"], "measured_s": c["seconds"],
                       "predicted_s": call_s(Call(c["sequences"], c["tokens"], c["longest"]), t)})
    # the labeller on the largest call's completions
    out = big["completions"]
    for c in calls:
        c.pop("completions")
    texts = [enc.prompt_text(r["prompt"]) for r in rows[:big["prompts"]] for _ in range(params.n)]
    answers = [r.get("answer") for r in rows[:big["prompts"]] for _ in range(params.n)] if "answer" in rows[0] else None
    label_s, _ = _median_time(lambda: checked(source.labeller_name, source.labeller, texts, out.texts, answers), 3)
    return {"call_fixed_s": fixed, "decode_step_s": decode_step, "sample_tokens_per_s": big["tokens_per_s"],
            "sample_curve": curve, "concurrency": concurrency, "label_s_per_seq": label_s / len(out.texts),
            "calls": calls, "check_inner_calls": checks}


def sampler_target(gen: dict):
    """A target holding only the sampler's constants (the rest zero or free): what a call costs by the curve."""
    from humanline_cli.report.predict import Target

    return Target(name="sampler", source="", estimated=False, call_fixed_s=gen["call_fixed_s"],
                  sample_tokens_per_s=gen["sample_tokens_per_s"], decode_step_s=gen["decode_step_s"],
                  concurrency=gen["concurrency"], push_fixed_s=0.0, push_bytes_per_s=math.inf, label_s_per_seq=0.0,
                  train_flops_per_s=1.0, step_fixed_s=0.0, sync_fixed_s=0.0, sync_bytes_per_s=math.inf,
                  sample_curve=tuple(tuple(x) for x in gen["sample_curve"]))


def loop_calls(rows: list[dict], calls: tuple) -> list[dict]:
    """The generation calls a synchronous mini-run made inside its loop, after its first (which also pays the
    run's first-call costs), each with its seconds: the sample phase's growth over the step that made it."""
    out, prev, seen = [], 0.0, set()
    for r in rows:
        rnd, t = int(r.get("online/round", 0)), float(r.get("time/sample", 0.0))
        if rnd and rnd not in seen:
            seen.add(rnd)
            if 1 < rnd <= len(calls):
                c = calls[rnd - 1]
                out.append({"sequences": c.sequences, "tokens": c.tokens, "longest": c.longest, "seconds": t - prev})
        prev = t
    return out


class _Steps:
    """The run's own tracker (metrics.jsonl and wandb as the run configures them: their per-step cost is part of
    `other`), keeping every step's metrics for the fit (train.log_every=1)."""

    def __init__(self, tracker):
        self.tracker = tracker
        self.rows: list[dict] = []

    def log(self, step: int, metrics: dict) -> None:
        self.tracker.log(step, metrics)
        if "time/train" in metrics:
            self.rows.append({"step": step, **metrics})

    def log_histogram(self, step: int, counts) -> None:
        self.tracker.log_histogram(step, counts)


def _mini_run(spec, tmp: Path) -> dict:
    """The real loop for spec.train.steps steps: per-step (forward tokens, train seconds) and the loop's
    time outside its phases."""
    from rich.console import Console

    from humanline_cli.core.humanline import ReferenceRule
    from humanline_cli.report.cost import calls_of
    from humanline_cli.report.speed import loop_and_other
    from humanline_cli.train.build import build_parts
    from humanline_cli.train.timing import PhaseTimer
    from humanline_cli.train.tracking import Tracker
    from humanline_cli.train.trainer import train

    timer = PhaseTimer()
    parts = build_parts(spec, timer, tmp)
    spec = parts.spec  # its micro-batch fitted to this machine's memory
    tracker = None
    try:
        tracker = _Steps(Tracker(tmp, spec.config, spec.wandb, "constants"))
        before = dict(timer.seconds)
        t0 = time.perf_counter()
        train(spec.train, spec.humanline, parts, objective=spec.objective_cfg,
              rule=ReferenceRule.from_spec(spec.humanline, spec.regime), tracker=tracker, timer=timer,
              console=Console(file=io.StringIO()), eval_every=spec.eval_cfg.every)
        wall = time.perf_counter() - t0
        spent = {k: v - before.get(k, 0.0) for k, v in timer.seconds.items()}
        lagged = bool(spec.data_cfg.async_lag)  # the sampler process's calls are timed in it, not by the loop's rows
        _, other = loop_and_other(spent, wall, lagged)
        rows = tracker.rows
        per_step = [(r["tokens_processed"], r["time/train"] - (rows[i - 1]["time/train"] if i else 0.0))
                    for i, r in enumerate(rows)]
        tracker.tracker.finish(0)
        tracker = None
        return {"in_loop_calls": [] if lagged else loop_calls(rows, calls_of(tmp) or ()),
                "steps": len(rows), "per_step": per_step[1:], "other_s": other,
                "tokens_per_step": statistics.fmean(r["tokens_processed"] for r in rows),
                "sample_s": spent.get("sample", 0.0), "rounds": max((int(r.get("online/round", 0)) for r in rows),
                                                                     default=0),
                "async_lag": int(spec.data_cfg.async_lag or 0),
                "params": sum(p.numel() for p in parts.policy.parameters()),
                "gradient_checkpointing": spec.train.gradient_checkpointing}
    finally:
        if tracker is not None:  # interrupted: wandb's run ends here, not in its exit hook (which prints its history)
            tracker.tracker.finish(1)
        parts.close()


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares y = a + b x; (a, b) with a >= 0 (a negative intercept is noise: then y = b x)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    a = my - b * mx
    if a < 0 or b <= 0:
        return 0.0, sum(y for _, y in points) / sum(x for x, _ in points)
    return a, b


def other_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """`other` per step = a + b x the step's forward tokens through (tokens per step, other per step) of runs at
    different batch sizes; flat (their mean, b = 0) when `other` does not rise with the tokens (noise)."""
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    if sum((x - mx) * (y - my) for x, y in points) <= 0:
        return my, 0.0
    return fit_line(points)


def overlap_factors(alone: dict, beside: dict) -> dict:
    """Asynchronous rounds' slowdowns from two mini-runs at the same batch and steps, without and with
    data.async_lag=1: per-step train seconds, per-step `other`, and sampling seconds per round, beside / alone."""
    def mean_step(r):
        return statistics.fmean(s for _, s in r["per_step"])

    def per_round(r):
        return r["sample_s"] / max(r["rounds"], 1)

    def ratio(a, b):
        return a / b if b > 0 and a > 0 else 1.0

    return {"async_train_factor": ratio(mean_step(beside), mean_step(alone)),
            "async_other_factor": ratio(beside["other_s"] / beside["steps"], alone["other_s"] / alone["steps"]),
            "async_sample_factor": ratio(per_round(beside), per_round(alone))}


def training_constants(overrides: list[str], steps: int) -> dict:
    spec = compose_online(overrides)
    b = spec.train.batch_size
    runs = []
    common = ("train.log_every=1", "eval.every=0", "train.save_model=false", "train.checkpoint_every=0")
    # untimed: the process's one-time costs (lazy imports, first allocations, the tracker's first files) would
    # otherwise land in the first measured run's `other` and be counted again at every step of the prediction
    with tempfile.TemporaryDirectory() as tmp:
        first = _mini_run(compose_online(overrides, (f"train.batch_size={b}", "train.steps=3", *common,
                                                     "data.async_lag=0")), Path(tmp))
    common = (f"train.steps={steps}", *common)
    for batch in (b, max(1, b // 2)):
        s = compose_online(overrides, (f"train.batch_size={batch}", *common, "data.async_lag=0"))
        with tempfile.TemporaryDirectory() as tmp:
            runs.append({"batch_size": batch, **_mini_run(s, Path(tmp))})
    # the run's batch again with its rounds sampled one round ahead in the sampler process: what sharing the host
    # costs each phase (the factors; the line below is fitted on the runs alone)
    s = compose_online(overrides, (f"train.batch_size={b}", *common, "data.async_lag=1"))
    with tempfile.TemporaryDirectory() as tmp:
        lagged = {"batch_size": b, **_mini_run(s, Path(tmp))}
    points = [p for r in runs for p in r["per_step"]]
    a, slope = fit_line(points)
    p = runs[0]["params"]
    factor = 6 + 2 + 2 * bool(runs[0]["gradient_checkpointing"])  # online: the reference's forward every step
    o_step, o_tok = other_line([(r["tokens_per_step"], r["other_s"] / r["steps"]) for r in runs])
    # a run pays those one-time costs once: the first run's `other` beyond its steps' share
    once = max(first["other_s"] - first["steps"] * (o_step + o_tok * first["tokens_per_step"]), 0.0)
    return {"step_fixed_s": a, "train_flops_per_s": factor * p / slope, "other_step_s": o_step,
            "other_s_per_token": o_tok, "other_once_s": once,
            "first_run": {k: v for k, v in first.items() if k != "per_step"}, "params": p,
            **overlap_factors(runs[0], lagged),
            "runs": [{k: v for k, v in r.items() if k != "per_step"} | {"points": r["per_step"]}
                     for r in (*runs, lagged)]}


def measure(overrides: list[str], console, steps: int, prompts: int) -> dict:
    from humanline_cli.report.predict import Call, call_s
    from humanline_cli.train.build import build_parts
    from humanline_cli.train.timing import PhaseTimer

    load_before = _loadavg()
    spec = compose_online(overrides)
    # training first: a run samples in a process that has trained, so its generation calls are timed in that state
    console.print("[dim]constants: training steps at the run's batch size and at half of it[/]")
    tr = training_constants(overrides, steps)
    console.print("[dim]constants: generation, labelling, push, sync[/]")
    with tempfile.TemporaryDirectory() as tmp:
        parts = build_parts(spec, PhaseTimer(), Path(tmp))
        try:
            src = parts.source
            # HF decodes fixed waves of batch_size rows; vLLM batches continuously (a call is one wave)
            concurrency = spec.sampler_cfg.batch_size if spec.sampler_cfg.name == "hf" else 10**9
            gen = generation_constants(src, concurrency, call_sizes(prompts))
            push_s, _ = _median_time(lambda: src.sampler.push_weights(parts.policy), 5)
            sync_s, _ = _median_time(lambda: parts.reference.sync(parts.policy), 5)
        finally:
            parts.close()
    # the calls the training loop made (the mini-runs without the sampler process: the lagged one records none),
    # against the curve; their median ratio is the loop's factor (1.0: none made)
    sampler = sampler_target(gen)
    in_loop = [{**c, "predicted_s": call_s(Call(c["sequences"], c["tokens"], c["longest"]), sampler)}
               for r in tr["runs"] for c in r["in_loop_calls"]]
    loop_factor = statistics.median(c["seconds"] / c["predicted_s"] for c in in_loop) if in_loop else 1.0
    constants = {**{k: v for k, v in gen.items() if k not in ("calls", "check_inner_calls")},
                 "sample_loop_factor": loop_factor,
                 "push_fixed_s": push_s, "push_bytes_per_s": math.inf, "sync_fixed_s": sync_s, "sync_bytes_per_s": math.inf,
                 "step_fixed_s": tr["step_fixed_s"], "train_flops_per_s": tr["train_flops_per_s"],
                 "other_step_s": tr["other_step_s"], "other_s_per_token": tr["other_s_per_token"],
                 "other_once_s": tr["other_once_s"],
                 "async_sample_factor": tr["async_sample_factor"],
                 "async_train_factor": tr["async_train_factor"], "async_other_factor": tr["async_other_factor"],
                 "gpus": 1}
    return {"target": "this", "estimated": False, "objective": spec.objective, "host": socket.gethostname(),
            "cpus": os.cpu_count(),
            "threads": spec.threads, "model": spec.model, "params": tr["params"], "bytes_per_param": 4,
            "source": f"measured by `humanline bench constants=true` on {socket.gethostname()} at "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')} (loadavg {load_before})",
            "overrides": overrides, "inputs": {"prompts": prompts, "constant_steps": steps}, "constants": constants,
            "detail": {"generation": {"calls": gen["calls"], "check_inner_calls": gen["check_inner_calls"],
                                      "in_loop_calls": in_loop},
                       "training": tr["runs"], "training_first": tr["first_run"], "push_s": push_s, "sync_s": sync_s},
            "loadavg_before": load_before, "loadavg_after": _loadavg()}


def print_constants(res: dict, console) -> None:
    c = res["constants"]
    console.print(f"constants of this machine ({res['model']}, {res['params']} params, threads {res['threads']}); "
                  f"loadavg before {res['loadavg_before']}, after {res['loadavg_after']}", highlight=False)
    for k, v in c.items():
        if k == "sample_curve":
            v = ", ".join(f"{m:g} seq: {r:.4g} tok/s" for m, r in v)
            console.print(f"  {k:22s} {v}", highlight=False)
        else:
            console.print(f"  {k:22s} {f'{v:.6g}'}", highlight=False)
    for chk in res["detail"]["generation"]["check_inner_calls"]:
        console.print(f"  call of {chk['sequences']} sequences, from its neighbours: predicted "
                      f"{chk['predicted_s']:.3f} s, measured {chk['measured_s']:.3f} s", highlight=False)


def pool_constants(sets: list[dict], names: list[str]) -> dict:
    """One constants file from several measured on the same machine for the same run (`humanline bench
    pool=a.json,b.json,...`): each constant the median over the sets, each size of the sampler's curve likewise,
    and every constant's spread (min, median, max, (max - min) / median) kept beside it, so that a prediction says
    how far the machine itself moved while the sets were measured."""
    if len(sets) < 2:
        raise UserError("bench pool=: give at least two constants files (comma-separated)")
    first = sets[0]
    for name, d in zip(names, sets):
        if "constants" not in d or d.get("target") != "this":
            raise UserError(f"bench pool=: {name} is not a constants file of `humanline bench constants=true`")
        if (d.get("model"), d.get("threads"), d.get("overrides")) != (first.get("model"), first.get("threads"),
                                                                     first.get("overrides")):
            raise UserError(f"bench pool=: {name} was measured for another run than {names[0]} (model, threads or "
                            f"overrides differ)")
        # the same inputs measured again, or the spread and the curve's sizes mean nothing: a set whose curve has
        # other sizes (other prompts=) would be cut to the sizes all share and its peak be a smaller call's
        if d.get("inputs") != first.get("inputs") or _sizes(d) != _sizes(first):
            raise UserError(f"bench pool=: {name} was measured with other inputs than {names[0]} ("
                            f"{_inputs(d)} vs {_inputs(first)}); pool sets of the same prompts= and constant_steps=")
    for i, (name, d) in enumerate(zip(names, sets)):
        for other, e in zip(names[:i], sets[:i]):
            if d.get("source") == e.get("source") and d.get("constants") == e.get("constants"):
                raise UserError(f"bench pool=: {name} is the same measurement as {other}; pool distinct sets")
    spread, pooled = {}, {}
    for key, v in first["constants"].items():
        if key == "sample_curve":
            continue
        if isinstance(v, (int, float)) and all(isinstance(d["constants"].get(key), (int, float)) for d in sets):
            vals = [float(d["constants"][key]) for d in sets]
            pooled[key] = statistics.median(vals)
            spread[key] = _spread(vals)
        else:
            pooled[key] = v
    curves = [dict((int(m), float(r)) for m, r in d["constants"].get("sample_curve", ())) for d in sets]
    sizes = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    pooled["sample_curve"] = [[m, statistics.median(c[m] for c in curves)] for m in sizes]
    for m in sizes:
        spread[f"sample_curve@{m}"] = _spread([c[m] for c in curves])
    if pooled["sample_curve"]:  # the peak is the largest call's rate, as each set defines it
        pooled["sample_tokens_per_s"] = pooled["sample_curve"][-1][1]
    times = [d.get("source", "").partition(" at ")[2].partition(" (")[0] for d in sets]
    return {**{k: v for k, v in first.items() if k not in ("constants", "detail", "source", "loadavg_before",
                                                            "loadavg_after")},
            "source": f"median of {len(sets)} sets of `humanline bench constants=true` measured on {first.get('host')} "
                      f"from {times[0] or '?'} to {times[-1] or '?'} ({', '.join(names)})",
            "constants": pooled, "spread": spread, "pooled_from": names,
            "loadavg": [[d.get("loadavg_before"), d.get("loadavg_after")] for d in sets]}


def _sizes(d: dict) -> list[int]:
    """The call sizes of a set's sampler curve (prompts= decides them)."""
    return sorted(int(m) for m, _ in d["constants"].get("sample_curve", ()))


def _inputs(d: dict) -> str:
    """A set's measured inputs, for a message: prompts= and constant_steps= where recorded, the curve's sizes."""
    shown = [f"{k}={v}" for k, v in (d.get("inputs") or {}).items()]
    return ", ".join([*shown, f"curve at {', '.join(map(str, _sizes(d))) or 'no'} sequences"])


def _spread(vals: list[float]) -> dict:
    med = statistics.median(vals)
    rel = (max(vals) - min(vals)) / med if med and math.isfinite(med) else 0.0
    return {"min": min(vals), "median": med, "max": max(vals), "spread": rel, "values": vals}


def print_pooled(res: dict, console) -> None:
    console.print(f"constants pooled: {res['source']}", highlight=False)
    console.print(f"  {'constant':26s} {'min':>12s} {'median':>12s} {'max':>12s} {'(max-min)/median':>17s}",
                  highlight=False)
    for k, s in res["spread"].items():
        console.print(f"  {k:26s} {s['min']:12.5g} {s['median']:12.5g} {s['max']:12.5g} {s['spread']:17.1%}",
                      highlight=False)
