"""The cost model against finished runs: each regime's wall-clock predicted (lab/predict.py) from the work its runs
counted (samples.jsonl calls, metrics.jsonl `tokens_processed`, steps, the reference's syncs by the method's rule),
beside the phases they measured (summary.json wall_clock_s; `other` is the loop outside the timed phases, `loop` the
total less what the model leaves out). Under asynchronous rounds `sample` is the sampler process's own time,
overlapped, and `wait_for_sample` the trainer's idle time. Writes predicted.csv and predicted.md (with the report's
matched-quality table and each target's predicted seconds to the target score).

    python -m humanline_cli.lab.speed DIR --target constants.json --target h100x8 [--gpu-check gpu_check.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import pandas as pd

from humanline_cli.core.corrections import CorrectionConfig, CorrectionSpec
from humanline_cli.lab.predict import Target, Work, predict, target_from_json, within
from humanline_cli.lab.targets import ASSUMED, SHAPES, Shape, gpu_target, mfu_from_gpu_check
from humanline_cli.mdtable import md_table
from humanline_cli.report import matched
from humanline_cli.report.cost import calls_of
from humanline_cli.report.frame import LEFT_OUT, humanline_spec, load, seconds, write_csv
from humanline_cli.report.groups import collapse_duplicates, label
from humanline_cli.report.regimes import with_regimes

TIMED = ("sample", "push", "label", "train", "sync")
SHOWN = ("sample", "train", "sync", "push", "label", "other", "wait_for_sample", "loop")
MEASURED_COLUMNS = ("sample", "train", "sync", "other", "wait_for_sample", "loop")
PREDICTED_COLUMNS = ("sample", "push", "train", "sync", "label", "loop")
RAN_IN = {"float32": "fp32", "bfloat16": "bf16", "float64": "fp64"}  # summary.json's precision.compute
CHECKED_SHARE = 0.05  # phases below this share of the measured loop are shown but not held to the tolerance


def correction_spec(cfg: dict | None) -> object:
    """core's CorrectionSpec of a flat config: its correction.* keys, the schema's defaults where unset (none for a
    run saved before the key existed)."""
    cfg = cfg or {}
    return CorrectionSpec.from_config(CorrectionConfig(**{f.name: cfg[f"correction.{f.name}"]
                                                          for f in fields(CorrectionConfig)
                                                          if f"correction.{f.name}" in cfg}))


def train_tokens(metrics: list[dict], steps: int) -> float | None:
    """Forward tokens of all steps; with train.log_every > 1 the logged steps' mean times the steps."""
    rows = {r["step"]: r["tokens_processed"] for r in metrics if "tokens_processed" in r and "step" in r}
    if not rows:
        return None
    return float(sum(rows.values())) if len(rows) >= steps else statistics.fmean(rows.values()) * steps


def reference_syncs(spec, regime: str, steps: int, rounds: int, correction=None) -> int:
    """How often the reference takes the policy's weights (or, under correction=trdpo, a mix of them), by the
    method's rule (core ReferenceRule)."""
    from humanline_cli.core.humanline import ReferenceRule

    rule = ReferenceRule.from_spec(spec, regime, correction)
    moves = sum(rule.before_optimizer_step(s) or rule.after_optimizer_step(s) for s in range(1, steps + 1))
    return moves + (rounds if rule.reset_each_round else 0)


def run_work(run, matmul_params: float, weight_bytes: float) -> Work | None:
    """The counted work of one complete run, None when it did not record it (older runs)."""
    from humanline_cli.core.reference import reference_moves

    calls, steps = calls_of(run.path), int(run.summary.get("steps") or 0)
    tokens = train_tokens(run.metrics, steps)
    if calls is None or tokens is None or not steps:
        return None
    cfg = run.config or {}
    regime = str(cfg.get("data.regime", run.data))
    spec, correction = humanline_spec(cfg, run.humanline), correction_spec(cfg)
    cached = not reference_moves(spec, regime, correction) and bool(cfg.get("train.reference_cache", False))
    return Work(params=matmul_params, weight_bytes=weight_bytes, calls=calls, steps=steps, train_tokens=tokens,
                reference_forward=not cached, gradient_checkpointing=bool(cfg.get("train.gradient_checkpointing")),
                syncs=reference_syncs(spec, regime, steps, len(calls), correction),
                async_lag=int(cfg.get("data.async_lag") or 0) if regime == "online" else 0)


def loop_and_other(times: dict, wall: float, lagged: bool) -> tuple[float, float]:
    """The loop's wall-clock (`wall` less what the model leaves out) and its time outside the timed phases; under
    asynchronous rounds `sample` overlaps the loop and `wait_for_sample` is part of it."""
    loop = wall - seconds(times, LEFT_OUT)
    keys = [k for k in TIMED if not (lagged and k == "sample")] + (["wait_for_sample"] if lagged else [])
    return loop, max(loop - seconds(times, keys), 0.0)


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
        raise ValueError(f"--target {word}: no such file")
    if p.is_dir():
        raise ValueError(f"--target {word}: is a directory, not a constants file from "
                         "`python -m humanline_cli.lab.constants`")
    if not p.is_file():
        raise ValueError(f"--target {word!r}: neither h100, h200 (optionally xN) nor a constants file from "
                         f"`python -m humanline_cli.lab.constants`")
    try:
        d = json.loads(p.read_text())
        target_from_json(d)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--target {word}: not a constants file ({type(e).__name__}: {e})") from None
    return TargetSpec(f"{d.get('target', 'this')} ({p.name})", constants=d)  # two constants files stay apart


def target_for(run, spec: TargetSpec, constants: list[dict], work_calls: tuple) -> tuple[Target, Shape] | None:
    """The target's constants for this run's model (GPU targets depend on the model's shape and context)."""
    if (d := spec.constants) is not None:
        return (target_from_json(d), Shape(d["model"], d["params"], d["params"], 0.0, "bench constants")
                ) if d.get("model") == run.summary.get("model") else None
    shape = SHAPES.get(run.summary.get("model")) or next(
        (Shape(d["model"], d["params"], d["params"], 0.0, "parameters from the constants file; KV cache not counted")
         for d in constants if d.get("model") == run.summary.get("model")), None)
    if shape is None:
        return None
    seqs = sum(c.sequences for c in work_calls)
    ctx = (sum(c.tokens for c in work_calls) / seqs / 2) if seqs else 0.0
    t = gpu_target(spec.gpu, shape, spec.gpus, ctx, ASSUMED["verifier_s_per_seq"], spec.mfu, spec.mfu_source)
    return t, shape


def speed_rows(runs: pd.DataFrame, specs: list[TargetSpec]) -> tuple[pd.DataFrame, list[str], dict]:
    """predicted.csv (per target, regime and phase: mean predicted and, on a constants target, measured seconds,
    and the loop's speedups over online), notes on left-out runs, and each target's sources."""
    complete = list(runs[runs.status == "complete"].itertuples())
    constants = [s.constants for s in specs if s.constants is not None]
    per_run, notes, sources = [], [], {}
    for spec in specs:
        skipped, other_setting = 0, []
        for r in complete:
            why = constants_mismatch(spec.constants, r) if spec.constants is not None else None
            if why is not None:  # constants of another setting would predict another machine's speed
                other_setting.append(f"{r.path.name} ({why})")
                continue
            calls = calls_of(r.path)
            tf = target_for(r, spec, constants, calls) if calls is not None else None
            bpp = spec.constants.get("bytes_per_param", 4) if spec.constants is not None else 2  # GPU: bf16
            work = run_work(r, tf[1].matmul_params, bpp * tf[1].params) if tf else None
            if work is None:
                skipped += 1
                continue
            t = tf[0]
            sources[spec.name] = t.source + "".join(f"; {k} {v}" for k, v in t.notes.items()) + \
                spread_note(spec.constants)
            meas = {}
            if spec.constants is not None:
                w = r.summary.get("wall_clock_s") or {}
                lagged = "wait_for_sample" in w
                meas = {k: float(w.get(k, 0.0) or 0.0) for k in TIMED + (("wait_for_sample",) if lagged else ())}
                meas["loop"], meas["other"] = loop_and_other(w, float(w.get("total", 0.0)), lagged)
            per_run += [{"target": spec.name, "estimated": t.estimated, "task": r.task, "objective": r.objective,
                         "regime": r.regime, "run": r.Index, "phase": k, "predicted_s": v, "measured_s": meas.get(k)}
                        for k, v in {**dict.fromkeys(meas), **predict(work, t)}.items()]
        if skipped:
            notes.append(f"{spec.name}: {skipped} complete run(s) left out (no per-completion `tokens` in samples.jsonl "
                         f"or no `tokens_processed` in metrics.jsonl: recorded before they were, or another model "
                         f"than the constants file's)")
        if other_setting:
            notes.append(f"{spec.name}: {len(other_setting)} complete run(s) left out, measured for another setting "
                         f"than the constants file's: {', '.join(other_setting[:3])}"
                         + (f" and {len(other_setting) - 3} more" if len(other_setting) > 3 else ""))
    return predicted_frame(pd.DataFrame(per_run)), notes, sources


def predicted_frame(per_run: pd.DataFrame) -> pd.DataFrame:
    """Per-run phases -> per (target, task, objective, regime) and phase the mean over its runs (a phase a run
    lacks counts as 0 there), predicted / measured, and on the loop the speedups over online."""
    columns = ["target", "estimated", "task", "objective", "regime", "n_runs", "phase", "predicted_s", "measured_s",
               "predicted_over_measured", "predicted_speedup_vs_online", "measured_speedup_vs_online"]
    if per_run.empty:
        return pd.DataFrame(columns=columns)
    keys, values = ["target", "estimated", "task", "objective", "regime"], ["predicted_s", "measured_s"]
    per_run = per_run[per_run.phase.isin(SHOWN)].astype({v: float for v in values})
    out = per_run.groupby([*keys, "phase"], sort=False)[values].sum(min_count=1).reset_index()
    out["n_runs"] = out.set_index(keys).index.map(per_run.groupby(keys, sort=False)["run"].nunique())
    out[values] = out[values].div(out.n_runs, axis=0)
    out = out.assign(_g=out.groupby(keys, sort=False).ngroup(), _p=out.phase.map(SHOWN.index)).sort_values(["_g", "_p"])
    out["predicted_over_measured"] = out.predicted_s / out.measured_s.where(out.measured_s != 0)
    online = out[(out.phase == "loop") & (out.regime == "online")].set_index(["target", "task", "objective"])
    for col, of in (("predicted_speedup_vs_online", "predicted_s"), ("measured_speedup_vs_online", "measured_s")):
        base = out.set_index(["target", "task", "objective"]).index.map(online[of])
        out[col] = (base / out[of].where(out[of] != 0)).where(out.phase == "loop")
    return out[columns].astype(object).where(out[columns].notna(), None).reset_index(drop=True)


def _s(x) -> str:
    return "–" if x is None else (f"{x:.3g}" if x < 100 else f"{x:.0f}")


def _cell(p: dict, m: dict, k: str) -> str:
    """predicted / measured (ratio), the ratio marked ! outside 0.85-1.15 on a phase held to the tolerance."""
    pk, mk = p.get(k), m.get(k)
    if pk is None and mk is None:
        return "–"
    held = pk is not None and mk and (k == "loop" or mk >= CHECKED_SHARE * m["loop"])
    mark = " !" if held and not within(pk, mk) else ""
    return f"{_s(pk)} / {_s(mk)}" + (f" ({pk / mk:.2f}{mark})" if pk is not None and mk else "")


def markdown(rows: pd.DataFrame, notes: list[str], sources: dict) -> list[str]:
    """Per target a table of seconds by phase: predicted / measured (ratio) on a constants target, a ratio outside
    0.85-1.15 on a phase holding CHECKED_SHARE of the loop marked !; predicted alone on a GPU target."""
    if rows.empty:
        return ["No run recorded its counted work (per-completion tokens and per-step forward tokens)."] + notes
    out = []
    for target, t in rows.groupby("target", sort=False):
        estimate = " (ESTIMATE: built on public figures and assumptions)" if t.estimated.iloc[0] else ""
        out += [f"**Target {target}**{estimate}: {sources.get(target, '')}", ""]
        body, has_measured = [], t.measured_s.notna().any()
        for key, g in t.groupby(["task", "objective", "regime", "n_runs"], sort=False):
            ph = g.set_index("phase")
            p, m = ph.predicted_s.to_dict(), ph.measured_s.to_dict()
            sp, sm = ph.at["loop", "predicted_speedup_vs_online"], ph.at["loop", "measured_speedup_vs_online"]
            speed = ("–" if sp is None else f"{sp:.2f}x") + ("" if sm is None else f" ({sm:.2f}x)")
            cells = [_cell(p, m, k) for k in MEASURED_COLUMNS] if has_measured else [_s(p.get(k)) for k in PREDICTED_COLUMNS]
            body.append((*key, *cells, speed))
        out += ["Seconds by phase, predicted / measured (ratio); ratios outside 0.85-1.15 on a phase holding at "
                f"least {CHECKED_SHARE:.0%} of the loop are marked !; loop = the training loop's wall-clock "
                "(setup, evaluation, saving left out). Speedup = online's loop over the regime's." if has_measured else
                "Predicted seconds by phase (no measurement on this target). Speedup = online's loop over the "
                "regime's, at the same counted work (the runs' own steps, calls and tokens).", "",
                *md_table(["task", "objective", "regime", "runs",
                           *((k.replace("_", " ") for k in MEASURED_COLUMNS) if has_measured else PREDICTED_COLUMNS),
                           "speedup vs online" + (", predicted (measured)" if has_measured else "")], body), ""]
    return out + notes


def constants_mismatch(d: dict, run) -> str | None:
    """How the run's resolved config differs from the setting a constants file was measured for (its `threads`,
    its precision and its dotted `key=value` overrides the run's config also holds), or None when it does not."""
    import yaml

    ran = RAN_IN.get(((run.summary or {}).get("precision") or {}).get("compute"))
    measured_in = d.get("precision", "fp32")  # sets from before it was recorded were measured in fp32
    if ran is not None and ran != measured_in:
        return (f"it computed in {ran}, the constants were measured in {measured_in}: measure a {ran} set with "
                f"backend.precision={ran} among the constants' overrides")
    cfg = run.config or {}
    checks = [("threads", d["threads"])] if "threads" in d else []
    for o in d.get("overrides") or ():
        key, sep, value = str(o).partition("=")
        key = key.lstrip("+~")
        if sep and "." in key and key != "backend.precision":  # compared above by what each computed in
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


def predicted_to_target(rows: pd.DataFrame, loops: dict) -> pd.DataFrame:
    """Per target (target name -> {(task, objective, regime): predicted loop seconds of the whole run}) a column of
    matched.matched_rows' predicted seconds to the target score: the run's loop prorated by the median steps to it."""
    def prorated(by: dict, r) -> str | None:
        loop = by.get((r.task, r.objective, r.regime))
        v = None if loop is None or r.steps_to is None or not r.steps else loop * r.steps_to / r.steps
        return None if v is None or v != v else f"{v:.4g}"

    return pd.DataFrame({f"predicted s on {t}": [prorated(by, r) for r in rows.itertuples()] for t, by in loops.items()},
                        index=rows.index, dtype=object)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m humanline_cli.lab.speed", description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path, help="a sweep dir or runs dir (searched recursively for run dirs)")
    p.add_argument("--out", type=Path, default=None, help="where to write predicted.csv/.md (default: DIR)")
    p.add_argument("--target", action="append", default=[], metavar="T", required=True,
                   help="predict each regime's wall-clock on T: a constants file of `python -m "
                        "humanline_cli.lab.constants` (this machine, measured) or h100, h200, h100x8, h200x8 (public "
                        "figures; estimates); repeatable")
    p.add_argument("--gpu-check", type=Path, default=None, metavar="FILE",
                   help="gpu_check.json of `just gpu-check`: its measured MFU replaces the assumed one on GPU targets")
    p.add_argument("--accuracy", type=float, default=None, help="the matched-quality target score (as the report's)")
    a = p.parse_args(argv)
    try:
        gpu_check = json.loads(a.gpu_check.read_text()) if a.gpu_check else None
        targets = [parse_target(t, gpu_check) for t in a.target]
        if not a.dir.is_dir():
            raise ValueError(f"no such directory: {a.dir}")
    except (OSError, ValueError) as e:
        print(f"humanline: error: {e}", file=sys.stderr)
        return 2
    runs = load(a.dir)
    complete = runs[runs.status == "complete"] if len(runs) else runs
    if complete.empty:
        print(f"humanline: error: {a.dir}: no complete run dirs", file=sys.stderr)
        return 2
    complete = with_regimes(label(collapse_duplicates(complete)[0])[0])
    rows, notes, sources = speed_rows(complete, targets)
    loops: dict = {}
    for r in rows[rows.phase == "loop"].itertuples():
        loops.setdefault(r.target, {})[(r.task, r.objective, r.regime)] = r.predicted_s
    mrows = matched.matched_rows(complete, a.accuracy)
    out = a.out or a.dir
    out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out / "predicted.csv", 8)
    text = "\n".join(["# Predicted wall-clock (cost model)", "", *markdown(rows, notes, sources), "",
                      "## Speedup at matched quality", "",
                      *matched.markdown(mrows, predicted_to_target(mrows, loops)), ""])
    (out / "predicted.md").write_text(text)
    print(text)
    print(f"wrote {out / 'predicted.csv'}, {out / 'predicted.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
