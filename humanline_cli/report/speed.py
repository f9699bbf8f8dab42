"""`humanline report DIR --target T`: each regime's wall-clock predicted by the cost model (report/predict.py)
from the work its runs counted, beside the wall-clock they measured.

Per complete run, the counted work: generation calls from samples.jsonl (one line per completion, its round
and its `tokens`), optimizer steps from summary.json, the forward tokens of every step from metrics.jsonl
(`tokens_processed`; with train.log_every > 1 the logged steps' mean times the steps), reference syncs and
asynchronous lag from the resolved config. Targets: a constants file of `humanline bench constants=true`
(measured: `this`), or `h100` / `h200` (public figures and assumptions, report/targets.py; with `--gpu-check
FILE` its measured MFU), at 1 GPU or `h100x8`.

Measured phases come from summary.json's wall_clock_s: sample, push, label, train, sync as timed; `other` is the
loop's time outside them (the total less setup, evaluation, saving, checkpoints and the sampler process's
start-up, which the model leaves out, less the timed phases); `loop` is that total less the left-out parts.
Under asynchronous rounds the phases overlap: their `sample` is the sampler process's own time, `wait_for_sample`
the trainer's idle time, and `loop` the wall-clock.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from humanline_cli.report.cost import calls_of
from humanline_cli.report.frame import md_table
from humanline_cli.report.predict import Target, Work, predict, target_from_json
from humanline_cli.report.targets import ASSUMED, SHAPES, Shape, gpu_target, mfu_from_gpu_check

LEFT_OUT = ("setup", "eval", "save", "checkpoint", "sampler_start")
TIMED = ("sample", "push", "label", "train", "sync")
SHOWN = ("sample", "train", "sync", "push", "label", "other", "wait_for_sample", "loop")
CHECKED_SHARE = 0.05  # phases below this share of the measured loop are shown but not held to the tolerance


class SpeedError(ValueError):
    pass


def train_tokens(metrics: list[dict], steps: int) -> float | None:
    rows = {r["step"]: r["tokens_processed"] for r in metrics if "tokens_processed" in r and "step" in r}
    if not rows:
        return None
    return float(sum(rows.values())) if len(rows) >= steps else statistics.fmean(rows.values()) * steps


def reference_syncs(spec, regime: str, steps: int, rounds: int) -> int:
    """How often the reference takes the policy's weights over `steps` optimizer steps and `rounds` sampling
    rounds, by the method's own rule (core ReferenceRule) for a humanline spec and data regime."""
    from humanline_cli.core.humanline import ReferenceRule

    rule = ReferenceRule.from_spec(spec, regime)
    return sum(map(rule.before_optimizer_step, range(1, steps + 1))) + (rounds if rule.reset_each_round else 0)


def run_work(run, matmul_params: float, weight_bytes: float) -> Work | None:
    """The counted work of one complete run (a runs-frame row), None when it did not record it (older runs).
    When the reference moves, and so how many syncs the run made, is the method's rule (core ReferenceRule)."""
    from humanline_cli.core.humanline import HumanlineSpec
    from humanline_cli.core.reference import reference_moves

    calls = calls_of(run.path)
    steps = int(run.summary.get("steps") or 0)
    tokens = train_tokens(run.metrics, steps)
    if calls is None or tokens is None or not steps:
        return None
    cfg = run.config or {}
    regime = str(cfg.get("data.regime", run.data))  # run.data names stale rounds apart (stale-64)
    spec = HumanlineSpec(sync=bool(run.humanline and cfg.get("hl.sync", True)),
                         sync_every=max(int(cfg.get("hl.sync_every") or 1), 1))
    syncs = reference_syncs(spec, regime, steps, len(calls))
    cached = not reference_moves(spec, regime) and bool(cfg.get("train.reference_cache", False))
    return Work(params=matmul_params, weight_bytes=weight_bytes, calls=calls, steps=steps, train_tokens=tokens,
                reference_forward=not cached, gradient_checkpointing=bool(cfg.get("train.gradient_checkpointing")),
                syncs=syncs, async_lag=int(cfg.get("data.async_lag") or 0) if regime == "online" else 0)


def loop_and_other(seconds: dict, wall: float, lagged: bool) -> tuple[float, float]:
    """The training loop's wall-clock (`wall` less the parts the model leaves out) and its time outside the timed
    phases. Under asynchronous rounds `sample` is the sampler process's own time, overlapped with the loop and not
    part of it, and `wait_for_sample` is the trainer's idle time, which is."""
    loop = wall - sum(float(seconds.get(k, 0.0) or 0.0) for k in LEFT_OUT)
    keys = [k for k in TIMED if not (lagged and k == "sample")] + (["wait_for_sample"] if lagged else [])
    trainer = sum(float(seconds.get(k, 0.0) or 0.0) for k in keys)
    return loop, max(loop - trainer, 0.0)


def measured(summary: dict) -> dict:
    w = summary.get("wall_clock_s") or {}
    lagged = "wait_for_sample" in w  # asynchronous: sample ran in its own process, overlapped
    out = {k: float(w.get(k, 0.0) or 0.0) for k in TIMED}
    if lagged:
        out["wait_for_sample"] = float(w["wait_for_sample"])
    out["loop"], out["other"] = loop_and_other(w, float(w.get("total", 0.0)), lagged)
    return out


# ------------------------------------------------------------------ targets
@dataclass(frozen=True)
class TargetSpec:
    """What --target named: a constants file (its model's P) or a GPU kind and count."""

    name: str
    constants: dict | None = None   # bench constants JSON
    gpu: str | None = None
    gpus: int = 1
    mfu: float | None = None
    mfu_source: str | None = None


def parse_target(word: str, gpu_check: dict | None = None) -> TargetSpec:
    low = word.lower()
    kind, _, count = low.partition("x")
    if kind in ("h100", "h200") and (not count or count.isdigit()):
        mfu = mfu_from_gpu_check(gpu_check) if gpu_check else None
        return TargetSpec(low, gpu=kind, gpus=int(count or 1), mfu=mfu,
                          mfu_source="gpu_check.json, median of its step rows" if mfu is not None else None)
    p = Path(word)
    if not p.exists() and (p.suffix or "/" in word):  # meant as a file: say it is missing, not what else is valid
        raise SpeedError(f"--target {word}: no such file")
    if p.is_dir():
        raise SpeedError(f"--target {word}: is a directory, not a constants file from `humanline bench constants=true`")
    if not p.is_file():
        raise SpeedError(f"--target {word!r}: neither h100, h200 (optionally xN) nor a constants file from "
                         f"`humanline bench constants=true`")
    try:
        d = json.loads(p.read_text())
        target_from_json(d)
    except (ValueError, KeyError, TypeError) as e:
        raise SpeedError(f"--target {word}: not a constants file ({type(e).__name__}: {e})") from None
    return TargetSpec(f"{d.get('target', 'this')} ({p.name})", constants=d)  # two constants files stay apart


def target_for(run, spec: TargetSpec, constants: list[dict], work_calls: tuple) -> tuple[Target, Shape] | None:
    """The target's constants for this run's model (GPU targets depend on the model's shape and context)."""
    if spec.constants is not None:
        d = spec.constants
        if d.get("model") != run.summary.get("model"):
            return None
        return target_from_json(d), Shape(d["model"], d["params"], d["params"], 0.0, "bench constants")
    shape = SHAPES.get(run.summary.get("model"))
    if shape is None:
        for d in constants:
            if d.get("model") == run.summary.get("model"):
                shape = Shape(d["model"], d["params"], d["params"], 0.0, "parameters from the constants file; "
                              "KV cache not counted")
    if shape is None:
        return None
    seqs = sum(c.sequences for c in work_calls)
    ctx = (sum(c.tokens for c in work_calls) / seqs / 2) if seqs else 0.0
    t = gpu_target(spec.gpu, shape, spec.gpus, ctx, ASSUMED["verifier_s_per_seq"], spec.mfu, spec.mfu_source)
    return t, shape


# ------------------------------------------------------------------ rows
# A row per target and (task, objective, regime): whether the target is an estimate, the runs counted, and the mean
# predicted and (on `this`, else None) measured seconds by phase.
ROW = ("target", "estimated", "task", "objective", "regime", "n_runs", "predicted", "measured")


def speed_rows(runs: pd.DataFrame, specs: list[TargetSpec]) -> tuple[pd.DataFrame, list[str], dict]:
    """Per target and (task, objective, regime): predicted and (on `this`) measured seconds by phase; notes on
    left-out runs; each target's sources (its constants and where they come from)."""
    complete = list(runs[runs.status == "complete"].itertuples())
    constants = [s.constants for s in specs if s.constants is not None]
    rows, notes, sources = [], [], {}
    for spec in specs:
        by: dict[tuple, list] = {}
        skipped, other_setting = 0, []
        for r in complete:
            why = constants_mismatch(spec.constants, r) if spec.constants is not None else None
            if why is not None:  # constants of another setting would predict another machine's speed
                other_setting.append(f"{r.path.name} ({why})")
                continue
            calls = calls_of(r.path)
            if calls is None:
                skipped += 1
                continue
            tf = target_for(r, spec, constants, calls)
            if tf is None:
                skipped += 1
                continue
            t, shape = tf
            sources[spec.name] = t.source + "".join(f"; {k} {v}" for k, v in t.notes.items()) + \
                spread_note(spec.constants)
            bpp = spec.constants.get("bytes_per_param", 4) if spec.constants is not None else 2  # GPU targets: bf16
            work = run_work(r, shape.matmul_params, bpp * shape.params)
            if work is None:
                skipped += 1
                continue
            by.setdefault((r.task, r.objective, r.regime), []).append((predict(work, t), measured(r.summary), t))
        if skipped:
            notes.append(f"{spec.name}: {skipped} complete run(s) left out (no per-completion `tokens` in samples.jsonl "
                         f"or no `tokens_processed` in metrics.jsonl: recorded before they were, or another model "
                         f"than the constants file's)")
        if other_setting:
            notes.append(f"{spec.name}: {len(other_setting)} complete run(s) left out, measured for another setting "
                         f"than the constants file's: {', '.join(other_setting[:3])}"
                         + (f" and {len(other_setting) - 3} more" if len(other_setting) > 3 else ""))
        for (task, obj, regime), items in by.items():
            pred = _mean_phases([p for p, _, _ in items])
            meas = _mean_phases([m for _, m, _ in items]) if spec.constants is not None else None
            rows.append((spec.name, items[0][2].estimated, task, obj, regime, len(items), pred, meas))
    return pd.DataFrame(rows, columns=ROW, dtype=object), notes, sources


def constants_mismatch(d: dict, run) -> str | None:
    """How the run's resolved config differs from the setting a constants file was measured for (its `threads`
    and its dotted `key=value` overrides the run's config also holds), or None when it does not."""
    import yaml

    cfg = run.config or {}
    checks = [("threads", d["threads"])] if "threads" in d else []
    for o in d.get("overrides") or ():
        key, sep, value = str(o).partition("=")
        key = key.lstrip("+~")
        if sep and "." in key:
            try:
                checks.append((key, yaml.safe_load(value)))
            except yaml.YAMLError:
                checks.append((key, value))
    for key, measured_for in checks:
        if key in cfg and cfg[key] != measured_for:
            return f"{key}={cfg[key]}, the constants' {measured_for}"
    return None


def spread_note(constants: dict | None) -> str:
    """A pooled constants file's spread over its sets, for the constants the loop's phases rest on."""
    spread = (constants or {}).get("spread") or {}
    keys = [k for k in spread
            if k in ("train_flops_per_s", "other_step_s", "other_s_per_token", "call_fixed_s", "label_s_per_seq")
            or k.startswith(("sample_curve@", "async_", "sample_loop"))]
    if not keys:
        return ""
    return ("; spread of each constant over the sets, (max - min) / median: "
            + ", ".join(f"{k} {spread[k]['spread']:.0%}" for k in keys))


def _mean_phases(dicts: list[dict]) -> dict:
    keys = {k for d in dicts for k in d}
    return {k: statistics.fmean(d.get(k, 0.0) for d in dicts) for k in keys}


def _online(rows: list, row):
    """Online's row of the same target, task and objective, None without one."""
    return next((r for r in rows if (r.target, r.task, r.objective, r.regime) == (row.target, row.task, row.objective,
                                                                                  "online")), None)


def checked(row, tolerance: float = 0.15) -> dict:
    """Phase -> predicted / measured for phases holding >= CHECKED_SHARE of the measured loop (and the loop)."""
    if row.measured is None:
        return {}
    loop = row.measured.get("loop", 0.0)
    out = {}
    for k in SHOWN:
        m = row.measured.get(k)
        if k in row.predicted and m and (k == "loop" or m >= CHECKED_SHARE * loop):
            out[k] = row.predicted[k] / m
    return out


def predicted_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """predicted.csv: one row per target, regime and phase, predicted beside measured, and the loop's speedups."""
    rows, out = list(rows.itertuples()), []
    for r in rows:
        on = _online(rows, r)
        for k in SHOWN:
            if k not in r.predicted and not (r.measured and k in r.measured):
                continue
            p, m = r.predicted.get(k), (r.measured or {}).get(k)
            sp = on.predicted["loop"] / r.predicted["loop"] if on and k == "loop" and r.predicted["loop"] else None
            sm = (on.measured["loop"] / r.measured["loop"] if on and on.measured and r.measured and k == "loop"
                  and r.measured["loop"] else None)
            out.append((r.target, r.estimated, r.task, r.objective, r.regime, r.n_runs, k, p, m,
                        p / m if p is not None and m else None, sp, sm))
    return pd.DataFrame(out, dtype=object, columns=[
        "target", "estimated", "task", "objective", "regime", "n_runs", "phase", "predicted_s", "measured_s",
        "predicted_over_measured", "predicted_speedup_vs_online", "measured_speedup_vs_online"])


def _s(x) -> str:
    return "–" if x is None else (f"{x:.3g}" if x < 100 else f"{x:.0f}")


def _measured_cell(r, k: str, chk: dict) -> str:
    """predicted / measured (ratio), the ratio marked ! outside 0.85-1.15 on a checked phase."""
    p, m = r.predicted.get(k), r.measured.get(k)
    if p is None and m is None:
        return "–"
    mark = " !" if k in chk and abs(chk[k] - 1) > 0.15 else ""
    return f"{_s(p)} / {_s(m)}" + (f" ({p / m:.2f}{mark})" if p is not None and m else "")


def markdown(rows: pd.DataFrame, notes: list[str], sources: dict) -> list[str]:
    rows = list(rows.itertuples())
    if not rows:
        return ["No run recorded its counted work (per-completion tokens and per-step forward tokens)."] + notes
    out = []
    for target in dict.fromkeys(r.target for r in rows):
        rs = [r for r in rows if r.target == target]
        est = rs[0].estimated
        out += [f"**Target {target}**{' (ESTIMATE: built on public figures and assumptions)' if est else ''}: "
                f"{sources.get(target, '')}", ""]
        speedups = []
        for r in rs:
            on = _online(rows, r)
            speedups.append((f"{on.predicted['loop'] / r.predicted['loop']:.2f}x" if on else "–")
                            + (f" ({on.measured['loop'] / r.measured['loop']:.2f}x)" if on and on.measured else ""))
        if rs[0].measured is not None:
            phases = ("sample", "train", "sync", "other", "wait_for_sample", "loop")
            out += ["Seconds by phase, predicted / measured (ratio); ratios outside 0.85-1.15 on a phase holding at "
                    f"least {CHECKED_SHARE:.0%} of the loop are marked !; loop = the training loop's wall-clock "
                    "(setup, evaluation, saving left out). Speedup = online's loop over the regime's.", "",
                    *md_table(["task", "objective", "regime", "runs", "sample", "train", "sync", "other",
                               "wait for sample", "loop", "speedup vs online, predicted (measured)"],
                              [(r.task, r.objective, r.regime, r.n_runs,
                                *(_measured_cell(r, k, checked(r)) for k in phases), sp)
                               for r, sp in zip(rs, speedups)])]
        else:
            phases = ("sample", "push", "train", "sync", "label", "loop")
            out += ["Predicted seconds by phase (no measurement on this target). Speedup = online's loop over the "
                    "regime's, at the same counted work (the runs' own steps, calls and tokens).", "",
                    *md_table(["task", "objective", "regime", "runs", *phases, "speedup vs online"],
                              [(r.task, r.objective, r.regime, r.n_runs, *(_s(r.predicted.get(k)) for k in phases), sp)
                               for r, sp in zip(rs, speedups)])]
        out.append("")
    return out + notes
