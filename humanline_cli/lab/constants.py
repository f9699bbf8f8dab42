"""`python -m humanline_cli.lab.constants [--prompts N] [--steps N] [--out FILE] [overrides]`: the cost model's
constants (lab/predict.py) measured on this machine with the composed online run's own parts, written for
`python -m humanline_cli.lab.speed DIR --target FILE`
(docs/performance.md, "Constants of this machine"): the sampler's curve at call sizes 1, prompts/64, /16, /4 and
prompts; the labeller; push and sync; `--steps` training steps at the run's batch and half of it (a line
through (forward tokens, train seconds)), `other` outside the phases, async_* factors from the batch again at
data.async_lag=1, and the sampler's calls inside the loop against the curve. Training is measured first, so that
the generation calls are timed in a process that has trained, as a run's are; /proc/loadavg is kept before and after.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import time
from pathlib import Path

from humanline_cli.bench.clock import EndClock, built, compose, train_loop
from humanline_cli.errors import UserError
from humanline_cli.lab.tool import measure_and_write

REPEAT_SPAN_S = 3.0  # seconds of timed calls per generation size (3 to 15 calls)
COMMON = ("train.log_every=1", "eval.every=0", "train.save_model=false", "train.checkpoint_every=0")


def call_sizes(prompts: int) -> tuple[int, ...]:
    """Prompts per timed call (x n samples): 1, prompts / 64, / 16, / 4 and prompts (at least two sizes above 1)."""
    return tuple(sorted({1, max(2, prompts // 64), max(2, prompts // 16), max(2, prompts // 4), max(3, prompts)}))


def _loadavg() -> str | None:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return None


def cpu_identity() -> dict:
    """The CPU the constants hold for: its name and the flags that set its matmul rates (SIMD widths, bf16)."""
    from humanline_cli.precision import cpu_info

    name, flags = cpu_info()
    return {"cpu": name, "cpu_flags": [f for f in flags if f.startswith(("avx", "amx", "fma", "sve", "asimd"))
                                       or f == "bf16"]}


def compose_online(overrides: list[str], extra: tuple[str, ...] = ()):
    spec = compose(overrides, extra)
    if spec.regime != "online":
        raise UserError("constants: measures an online run's constants: add data=online (or a regime)")
    return spec


def _median_time(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def generation_constants(source, concurrency: int, sizes: tuple[int, ...]) -> dict:
    """The run's sampler at `sizes` prompts x n per call: fixed cost per call, latency per decoding step (the
    smallest call: one wave), peak tokens/s (the largest), the curve, each inner size predicted from its
    neighbours, and the labeller's seconds per completion on the largest call's."""
    from humanline_cli.core.interfaces import SamplingParams
    from humanline_cli.lab.predict import call_s
    from humanline_cli.report.cost import Call
    from humanline_cli.rewards.scorers import checked

    rows, enc, params, sampler = source.rows, source.encoder, source.params, source.sampler
    sampler.push_weights(source.policy)
    one = SamplingParams(**{**vars(params), "n": 1, "max_new_tokens": 1, "seed": 1})
    fixed, _ = _median_time(lambda: sampler.generate([enc.prompt_ids(rows[0]["prompt"])], one), 5)
    calls, outs = [], []
    for k, size in enumerate(sizes):
        prompts = [enc.prompt_ids(rows[i % len(rows)]["prompt"]) for i in range(size)]
        p = SamplingParams(**{**vars(params), "seed": 7 + k})
        t0 = time.perf_counter()
        sampler.generate(prompts, p)  # untimed: the first call at a new shape
        # timed often enough to span REPEAT_SPAN_S: one short call moves by a quarter on a shared host, a median less
        repeats = min(15, max(3, math.ceil(REPEAT_SPAN_S / max(time.perf_counter() - t0, 1e-3))))
        s, out = _median_time(lambda prompts=prompts, p=p: sampler.generate(prompts, p), repeats)
        lengths = [len(ids) for ids in out.token_ids]
        calls.append({"prompts": size, "sequences": len(lengths), "tokens": sum(lengths), "longest": max(lengths),
                      "seconds": s, "repeats": repeats, "tokens_per_s": sum(lengths) / max(s - fixed, 1e-9)})
        outs.append(out)
    small, big = calls[0], calls[-1]
    decode_step = max(small["seconds"] - fixed, 1e-9) / (math.ceil(small["sequences"] / concurrency) * small["longest"])
    curve = [(c["sequences"], c["tokens_per_s"]) for c in calls]
    checks = [{"sequences": c["sequences"], "measured_s": c["seconds"],
               "predicted_s": call_s(Call(c["sequences"], c["tokens"], c["longest"]), sampler_target(
                   {"call_fixed_s": fixed, "sample_tokens_per_s": big["tokens_per_s"], "decode_step_s": decode_step,
                    "concurrency": concurrency, "sample_curve": curve[:i] + curve[i + 1:]}))}
              for i, c in enumerate(calls[1:-1], 1)]
    kept = [r for r in rows[:big["prompts"]] for _ in range(params.n)]
    answers = [r.get("answer") for r in kept] if "answer" in rows[0] else None
    texts = [enc.prompt_text(r["prompt"]) for r in kept]
    label_s, _ = _median_time(lambda: checked(source.labeller_name, source.labeller, texts, outs[-1].texts, answers), 3)
    return {"call_fixed_s": fixed, "decode_step_s": decode_step, "sample_tokens_per_s": big["tokens_per_s"],
            "sample_curve": curve, "concurrency": concurrency, "label_s_per_seq": label_s / len(outs[-1].texts),
            "calls": calls, "check_inner_calls": checks}


def sampler_target(gen: dict):
    """A target holding only the sampler's constants (the rest zero or free): what a call costs by the curve."""
    from humanline_cli.lab.predict import Target

    return Target(name="sampler", source="", estimated=False, call_fixed_s=gen["call_fixed_s"],
                  sample_tokens_per_s=gen["sample_tokens_per_s"], decode_step_s=gen["decode_step_s"],
                  concurrency=gen["concurrency"], push_fixed_s=0.0, push_bytes_per_s=math.inf, label_s_per_seq=0.0,
                  train_flops_per_s=1.0, step_fixed_s=0.0, sync_fixed_s=0.0, sync_bytes_per_s=math.inf,
                  sample_curve=tuple(tuple(x) for x in gen["sample_curve"]))


def loop_calls(rows: list[dict], calls: tuple) -> list[dict]:
    """The generation calls a synchronous mini-run made in its loop after its first (which pays the first-call
    costs), each with its seconds: the sample phase's growth over the step that made it."""
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


class TrackedEndClock(EndClock):
    """An EndClock over a real tracker (`inner`), whose per-step cost is then the run's, as in a real run; every
    step's metrics with a train time are kept (`rows`)."""

    def __init__(self, last_step: int, inner):
        super().__init__(last_step, None)
        self.inner, self.rows = inner, []

    def log(self, step: int, metrics: dict) -> None:
        self.inner.log(step, metrics)
        if "time/train" in metrics:
            self.rows.append({"step": step, **metrics})
        super().log(step, metrics)

    def log_histogram(self, step: int, counts) -> None:
        self.inner.log_histogram(step, counts)


def _mini_run(spec) -> dict:
    """The real loop for spec.train.steps steps: per step (forward tokens, train seconds), and `other`."""
    from humanline_cli.lab.speed import loop_and_other
    from humanline_cli.report.cost import calls_of
    from humanline_cli.train.tracking import Tracker

    with built(spec) as (parts, timer, tmp):
        spec = parts.spec
        tracker = TrackedEndClock(spec.train.steps, Tracker(tmp, spec.config, spec.wandb, "constants"))
        try:
            before, t0 = dict(timer.seconds), time.perf_counter()
            train_loop(parts, timer, tracker)
            wall = time.perf_counter() - t0
        except BaseException:  # interrupted: wandb's run ends here, not in its exit hook (which prints its history)
            tracker.inner.finish(1)
            raise
        tracker.inner.finish(0)
        spent = {k: v - before.get(k, 0.0) for k, v in timer.seconds.items()}
        lagged = bool(spec.data_cfg.async_lag)  # the sampler process times its own calls, not the loop's rows
        _, other = loop_and_other(spent, wall, lagged)
        rows = tracker.rows
        per_step = [(r["tokens_processed"], r["time/train"] - (rows[i - 1]["time/train"] if i else 0.0))
                    for i, r in enumerate(rows)]
        return {"in_loop_calls": [] if lagged else loop_calls(rows, calls_of(tmp) or ()),
                "steps": len(rows), "per_step": per_step[1:], "other_s": other,
                "tokens_per_step": statistics.fmean(r["tokens_processed"] for r in rows),
                "sample_s": spent.get("sample", 0.0),
                "rounds": max((int(r.get("online/round", 0)) for r in rows), default=0),
                "async_lag": int(spec.data_cfg.async_lag or 0),
                "params": sum(p.numel() for p in parts.policy.parameters()),
                "gradient_checkpointing": spec.train.gradient_checkpointing}


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares y = a + b x; (a, b) with a >= 0 (a negative intercept is noise: then y = b x)."""
    xs, ys = zip(*points)
    try:
        b, a = statistics.linear_regression(xs, ys)
    except statistics.StatisticsError:  # one x: no slope
        a, b = 0.0, 0.0
    return (a, b) if a >= 0 and b > 0 else (0.0, sum(ys) / sum(xs))


def other_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """`other` per step = a + b x forward tokens per step; flat (the mean) when it does not rise with them."""
    xs, ys = zip(*points)
    if len(points) < 2 or statistics.covariance(xs, ys) <= 0:
        return statistics.fmean(ys), 0.0
    return fit_line(points)


def overlap_factors(alone: dict, beside: dict) -> dict:
    """The same batch and steps with data.async_lag=1 over alone: per-step train, per-step other, sample per round."""
    def ratio(a, b):
        return a / b if b > 0 and a > 0 else 1.0

    step = [statistics.fmean(s for _, s in r["per_step"]) for r in (beside, alone)]
    return {"async_train_factor": ratio(*step),
            "async_other_factor": ratio(*(r["other_s"] / r["steps"] for r in (beside, alone))),
            "async_sample_factor": ratio(*(r["sample_s"] / max(r["rounds"], 1) for r in (beside, alone)))}


def training_constants(overrides: list[str], steps: int) -> dict:
    b = compose_online(overrides).train.batch_size

    def mini(batch: int, n_steps: int, lag: int) -> dict:
        spec = compose_online(overrides, (f"train.batch_size={batch}", f"train.steps={n_steps}", *COMMON,
                                          f"data.async_lag={lag}"))
        return {"batch_size": batch, **_mini_run(spec)}

    # untimed first: the process's one-time costs (lazy imports, first allocations) would land in a measured `other`
    first = mini(b, 3, 0)
    first.pop("batch_size")
    runs = [mini(batch, steps, 0) for batch in (b, max(1, b // 2))]
    lagged = mini(b, steps, 1)  # the sampler process beside the trainer: the async factors (not in the line)
    a, slope = fit_line([p for r in runs for p in r["per_step"]])
    p = runs[0]["params"]
    factor = 6 + 2 + 2 * bool(runs[0]["gradient_checkpointing"])  # online: the reference's forward every step
    o_step, o_tok = other_line([(r["tokens_per_step"], r["other_s"] / r["steps"]) for r in runs])
    # a run pays the one-time costs once: the first run's `other` beyond its steps' share
    once = max(first["other_s"] - first["steps"] * (o_step + o_tok * first["tokens_per_step"]), 0.0)
    return {"step_fixed_s": a, "train_flops_per_s": factor * p / slope, "other_step_s": o_step,
            "other_s_per_token": o_tok, "other_once_s": once,
            "first_run": {k: v for k, v in first.items() if k != "per_step"}, "params": p,
            **overlap_factors(runs[0], lagged),
            "runs": [{k: v for k, v in r.items() if k != "per_step"} | {"points": r["per_step"]}
                     for r in (*runs, lagged)]}


def measure(overrides: list[str], console, steps: int, prompts: int) -> dict:
    from humanline_cli.lab.predict import COPY_BYTES_PER_PARAM, call_s
    from humanline_cli.report.cost import Call

    load_before = _loadavg()
    spec = compose_online(overrides)
    console.print("[dim]constants: training steps at the run's batch size and at half of it[/]")
    tr = training_constants(overrides, steps)
    console.print("[dim]constants: generation, labelling, push, sync[/]")
    with built(spec) as (parts, _, _):
        precision, why = parts.backend.precision, parts.backend.why or None  # as the mini-runs resolved it
        src = parts.source
        # HF decodes fixed waves of batch_size rows; vLLM batches continuously (a call is one wave)
        concurrency = spec.sampler_cfg.batch_size if spec.sampler_cfg.name == "hf" else 10**9
        gen = generation_constants(src, concurrency, call_sizes(prompts))
        push_s, _ = _median_time(lambda: src.sampler.push_weights(parts.policy), 5)
        sync_s, _ = _median_time(lambda: parts.reference.sync(parts.policy), 5)
    # the loop's own calls (runs without the sampler process) against the curve: their median ratio (1.0: none)
    sampler = sampler_target(gen)
    in_loop = [{**c, "predicted_s": call_s(Call(c["sequences"], c["tokens"], c["longest"]), sampler)}
               for r in tr["runs"] for c in r["in_loop_calls"]]
    loop_factor = statistics.median(c["seconds"] / c["predicted_s"] for c in in_loop) if in_loop else 1.0
    keys = ("step_fixed_s", "train_flops_per_s", "other_step_s", "other_s_per_token", "other_once_s",
            "async_sample_factor", "async_train_factor", "async_other_factor")
    constants = {**{k: v for k, v in gen.items() if k not in ("calls", "check_inner_calls")},
                 "sample_loop_factor": loop_factor, "push_fixed_s": push_s, "push_bytes_per_s": math.inf,
                 "sync_fixed_s": sync_s, "sync_bytes_per_s": math.inf, **{k: tr[k] for k in keys}, "gpus": 1}
    host = socket.gethostname()
    return {"target": "this", "estimated": False, "objective": spec.objective, "host": host, "cpus": os.cpu_count(),
            **cpu_identity(), "threads": spec.threads, "model": spec.model, "params": tr["params"],
            "precision": precision, "precision_why": why, "bytes_per_param": COPY_BYTES_PER_PARAM[precision],
            "source": f"measured by `python -m humanline_cli.lab.constants` on {host} at "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')} (loadavg {load_before})",
            "overrides": overrides, "inputs": {"prompts": prompts, "constant_steps": steps}, "constants": constants,
            "detail": {"generation": {"calls": gen["calls"], "check_inner_calls": gen["check_inner_calls"],
                                      "in_loop_calls": in_loop},
                       "training": tr["runs"], "training_first": tr["first_run"], "push_s": push_s, "sync_s": sync_s},
            "loadavg_before": load_before, "loadavg_after": _loadavg()}


def print_constants(res: dict, console) -> None:
    c = res["constants"]
    lines = [f"constants of this machine ({res['model']}, {res['params']} params, threads {res['threads']}, "
             f"{res['precision']}{'; ' + res['precision_why'] if res['precision_why'] else ''}; {res['cpu']}); "
             f"loadavg before {res['loadavg_before']}, after {res['loadavg_after']}"]
    lines += [f"  {k:22s} " + (", ".join(f"{m:g} seq: {r:.4g} tok/s" for m, r in v) if k == "sample_curve" else f"{v:.6g}")
              for k, v in c.items()]
    lines += [f"  call of {x['sequences']} sequences, from its neighbours: predicted {x['predicted_s']:.3f} s, "
              f"measured {x['measured_s']:.3f} s" for x in res["detail"]["generation"]["check_inner_calls"]]
    console.print("\n".join(lines), highlight=False, markup=False)


def pool_constants(sets: list[dict], names: list[str]) -> dict:
    """`--pool a.json,b.json,...`: each constant (and each size of the curve) the median over sets measured for
    the same run, with its spread (min, median, max, (max - min) / median): how far the machine itself moved."""
    if len(sets) < 2:
        raise UserError("--pool: give at least two constants files (comma-separated)")
    first = sets[0]
    for name, d in zip(names, sets):
        if "constants" not in d or d.get("target") != "this":
            raise UserError(f"--pool: {name} is not a constants file of `python -m humanline_cli.lab.constants`")
        if _run_of(d) != _run_of(first):
            raise UserError(f"--pool: {name} was measured for another run than {names[0]} (model, threads, "
                            f"precision or overrides differ)")
        # other inputs: the curves' sizes differ (a peak would be a smaller call's) and the spread means nothing
        if d.get("inputs") != first.get("inputs") or _sizes(d) != _sizes(first):
            raise UserError(f"--pool: {name} was measured with other inputs than {names[0]} ("
                            f"{_inputs(d)} vs {_inputs(first)}); pool sets of the same --prompts and --steps")
    for i, (name, d) in enumerate(zip(names, sets)):
        for other, e in zip(names[:i], sets[:i]):
            if d.get("source") == e.get("source") and d.get("constants") == e.get("constants"):
                raise UserError(f"--pool: {name} is the same measurement as {other}; pool distinct sets")
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
            "source": f"median of {len(sets)} sets of `python -m humanline_cli.lab.constants` measured on "
                      f"{first.get('host')} from {times[0] or '?'} to {times[-1] or '?'} ({', '.join(names)})",
            "constants": pooled, "spread": spread, "pooled_from": names,
            "loadavg": [[d.get("loadavg_before"), d.get("loadavg_after")] for d in sets]}


def _run_of(d: dict) -> tuple:
    """What a set was measured for; a set from before `precision` was recorded ran fp32 (the CPU's default)."""
    return d.get("model"), d.get("threads"), d.get("precision", "fp32"), d.get("overrides")


def _sizes(d: dict) -> list[int]:
    return sorted(int(m) for m, _ in d["constants"].get("sample_curve", ()))


def _inputs(d: dict) -> str:
    shown = [f"{k}={v}" for k, v in (d.get("inputs") or {}).items()]
    return ", ".join([*shown, f"curve at {', '.join(map(str, _sizes(d))) or 'no'} sequences"])


def _spread(vals: list[float]) -> dict:
    med = statistics.median(vals)
    rel = (max(vals) - min(vals)) / med if med and math.isfinite(med) else 0.0
    return {"min": min(vals), "median": med, "max": max(vals), "spread": rel, "values": vals}


def print_pooled(res: dict, console) -> None:
    import pandas as pd

    table = pd.DataFrame({k: {"min": f"{v['min']:.5g}", "median": f"{v['median']:.5g}", "max": f"{v['max']:.5g}",
                              "(max-min)/median": f"{v['spread']:.1%}"} for k, v in res["spread"].items()}).T
    console.print(f"constants pooled: {res['source']}\n{table.to_string()}", highlight=False, markup=False)


def read_pool(pool: str, overrides: list[str]) -> dict:
    if overrides:
        raise UserError(f"--pool: takes no overrides (got {' '.join(overrides)})")
    names = [n for n in pool.split(",") if n]
    sets = []
    for n in names:
        try:
            sets.append(json.loads(Path(n).read_text()))
        except (OSError, ValueError) as e:
            raise UserError(f"--pool: cannot read {n} ({type(e).__name__}: {e})") from None
    return pool_constants(sets, [Path(n).name for n in names])


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    p = argparse.ArgumentParser(prog="python -m humanline_cli.lab.constants", description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", help="Hydra overrides of the online run measured (experiment=..., ...)")
    p.add_argument("--prompts", type=int, default=64, help="prompts of the largest timed generation call")
    p.add_argument("--steps", type=int, default=12, help="training steps of each timed mini-run")
    p.add_argument("--pool", default=None, metavar="A,B,...",
                   help="instead of measuring: one constants file from several measured sets (comma-separated)")
    p.add_argument("--out", type=Path, default=None, help="the JSON written (default runs/bench/constants-*.json)")
    a = p.parse_args(argv)
    console = Console()
    os.environ.setdefault("WANDB_SILENT", "true")  # the mini-runs' wandb says nothing on the console

    def run() -> tuple[dict, str, object]:
        if a.prompts < 1 or a.steps < 1:  # sizes of what is measured: 0 would measure nothing
            raise UserError(f"constants: --prompts and --steps must be >= 1, got {a.prompts} and {a.steps}")
        if a.pool:
            return read_pool(a.pool, a.overrides), "constants-pooled-", print_pooled
        return measure(a.overrides, console, a.steps, a.prompts), "constants-", print_constants

    return measure_and_write("constants", run, a.out, console)


if __name__ == "__main__":
    raise SystemExit(main())
