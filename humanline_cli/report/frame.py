"""Run dirs as data frames, what every table and plot of `humanline report` is computed from: `load(root)` gives
one row per run dir (status and reason, labels, its summary flattened, its resolved config flattened under `cfg.`,
and the config, metrics and log-ratio rows themselves); `points(runs)` the long frame every score is read from: one
row per run, evaluation point (the start, every mid-run evaluation, the final one) and metric, with its step,
wall-clock, work and loop seconds.
"""
from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
from pathlib import Path

import pandas as pd

MARKERS = ("summary.json", "failed.json", "metrics.jsonl")
# The score a comparison reads, best first: greedy accuracy where runs recorded it, else sampled, else win rate.
METRICS = {"greedy accuracy": "eval.greedy.accuracy", "accuracy": "eval.accuracy", "win rate": "eval.win_rate"}
# Each score's key in metrics.jsonl and at the start (None: a policy against itself, 0.5).
CURVE = {"greedy accuracy": ("eval/greedy/accuracy", "eval.greedy.start_accuracy"),
         "accuracy": ("eval/accuracy", "eval.start_accuracy"), "win rate": ("eval/win_rate", None),
         "reward": ("eval/reward_mean", "eval.start_reward_mean"),
         "sampled accuracy": ("eval/sampled/accuracy", "eval.sampled.start_accuracy")}
# each score at the end of the run, in summary.json
FINAL = {**METRICS, "reward": "eval.reward_mean", "sampled accuracy": "eval.sampled.accuracy"}
WORK = ("train", "sample", "label", "sync", "push")  # phases that are the cost of learning
LEFT_OUT = ("setup", "eval", "save", "checkpoint", "sampler_start")  # the loop's seconds leave these out
TIMES = ["step", "wall_s", "work_s", "loop_s"]
POINTS = ["run", "point", *TIMES, "metric", "value"]  # the long frame of evaluation points


def find_run_dirs(root: Path) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        d = Path(dirpath)
        if (d / ".hydra" / "config.yaml").is_file() or any(m in filenames for m in MARKERS):
            found.append(d)
            dirnames[:] = []  # a run's own subdirs (model/, wandb/) are not runs
        else:
            dirnames[:] = sorted(n for n in dirnames if n not in ("wandb", "__pycache__") and not n.startswith(".git"))
    return sorted(found)


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                obj = json.loads(line)
            except ValueError:
                continue  # a half-written last line from a crashed run
            if isinstance(obj, dict):
                rows.append(obj)
    return rows


def common_metric(summaries) -> str:
    """The score runs compared together read: the one they all chose (metric_of), else the win rate."""
    names = set(map(metric_of, summaries))
    return names.pop() if len(names) == 1 else "win rate"


def _read_json(path: Path):
    try:
        return json.loads(path.read_text()), None
    except (OSError, ValueError) as e:
        return None, f"unreadable {path.name}: {type(e).__name__}: {e}"


def read_config(path: Path) -> tuple[dict, dict] | None:
    """(resolved, raw) flat dotted-key views of a Hydra config.yaml, or None if unreadable. Each leaf resolves on
    its own, so one that cannot here (`${hydra:...}`, a missing env var) keeps its text. Lists stay values."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    try:
        cfg = OmegaConf.load(path)
    except Exception:  # an unreadable config only costs the grouping (the run falls back to summary labels)
        return None
    if not isinstance(cfg, DictConfig):
        return None
    raw = pd.json_normalize(OmegaConf.to_container(cfg, resolve=False)).iloc[0].to_dict()
    flat = {}

    def walk(node, prefix):
        for key in node:
            name = f"{prefix}{key}"
            try:
                v = node[key]
            except Exception:
                flat[name] = raw.get(name, "???")
                continue
            if isinstance(v, DictConfig) and len(v):
                walk(v, name + ".")
            elif isinstance(v, (DictConfig, ListConfig)):
                try:
                    flat[name] = OmegaConf.to_container(v, resolve=True)
                except Exception:
                    flat[name] = OmegaConf.to_container(v, resolve=False)
            else:
                flat[name] = v

    walk(cfg, "")
    return flat, raw


COMPUTE_KEY = "backend.compute_dtype"  # the dtype a complete run computed in (summary.json `precision.compute`)


def data_family(regime: str, cfg: dict) -> str:
    """The data part of a run's family: the regime, except online rounds that are off-policy by design, each a
    baseline of its own: `stale-K` (K > 1 steps per generation), `async-L` (sampled L > 0 rounds ahead), or both."""
    if regime != "online":
        return regime
    k, lag = cfg.get("data.generate_every"), cfg.get("data.async_lag")
    parts = ([f"stale-{k}"] if isinstance(k, int) and k > 1 else []) + ([f"async-{lag}"] if isinstance(lag, int)
                                                                         and lag > 0 else [])
    return "-".join(parts) or regime


def load_run(path: Path) -> dict:
    """One run dir as a record: labels from its resolved config, overridden by a complete summary.json's."""
    # what the run produced, by content: a copy has the same fingerprint, a rerun of the same seed another
    fingerprint = hashlib.sha256(b"".join(n.encode() + b"\0" + ((path / n).read_bytes() if (path / n).is_file() else b"")
                                          + b"\0" for n in ("summary.json", "metrics.jsonl")))
    run = {"path": path, "status": "incomplete", "task": "?", "objective": "?", "data": "?", "humanline": False,
           "seed": None, "reason": "", "summary": {}, "config": None, "raw": {},
           "fingerprint": fingerprint.hexdigest(), "metrics": read_jsonl(path / "metrics.jsonl"),
           "logratios": read_jsonl(path / "logratios.jsonl")}
    got = read_config(path / ".hydra" / "config.yaml") if (path / ".hydra" / "config.yaml").is_file() else None
    if got is not None:
        cfg, run["raw"] = got
        run["config"] = cfg
        run.update(objective=str(cfg.get("objective.name") or "?"), task=str(cfg.get("task.name") or "?"),
                   data=data_family(str(cfg.get("data.regime") or "?"), cfg),
                   # humanline=true (+humanline=true) and correction=humanline are one switch
                   humanline=cfg.get("humanline") is True or cfg.get("correction.kind") == "humanline")
        if cfg.get("seed") is not None:
            run["seed"] = cfg["seed"]
    if (path / "summary.json").is_file():
        s, err = _read_json(path / "summary.json")
        if isinstance(s, dict) and s.get("status") == "complete":
            precision = s.get("precision")
            computed = precision.get("compute") if isinstance(precision, dict) else None
            if computed and run["config"] is not None:
                # backend.precision=auto (or null) resolves per machine: runs of one config that computed in
                # different dtypes start from different greedy answers, so they must not pool as seeds
                run["config"] = {**run["config"], COMPUTE_KEY: computed}
            run.update(status="complete", summary=s, objective=str(s.get("objective")), task=str(s.get("task")),
                       data=data_family(str(s.get("data")), run["config"] or {}), humanline=bool(s.get("humanline")),
                       seed=s.get("seed"))
            return run
        run["status"] = "failed"
        run["reason"] = err or f"summary.json has status {s.get('status') if isinstance(s, dict) else s!r}"
    if (path / "failed.json").is_file():
        f, err = _read_json(path / "failed.json")
        run["status"] = "failed"
        run["reason"] = err or str((f or {}).get("error") or "failed.json without an error message")
    elif run["status"] == "incomplete":
        steps = [r["step"] for r in run["metrics"] if isinstance(r.get("step"), (int, float))]
        last = f"; last logged step {int(max(steps))}" if steps else "; no steps logged"
        run["reason"] = "incomplete: no summary.json or failed.json (crashed, killed or still running)" + last
    return run


def frame(records: list[dict]) -> pd.DataFrame:
    """Records of load_run -> one row per run: the record, its family, its summary flattened, its config under cfg."""
    df = pd.DataFrame(records, dtype=object)  # seeds stay ints, a missing one None
    if df.empty:
        return df
    df["family"] = [("humanline-" if h else "") + str(d) for h, d in zip(df["humanline"], df["data"])]
    summary = pd.json_normalize([{k: v for k, v in s.items() if k not in df.columns} for s in df["summary"]])
    config = pd.json_normalize([c or {} for c in df["config"]], max_level=0).add_prefix("cfg.")
    return pd.concat([df, summary.set_index(df.index), config.set_index(df.index)], axis=1)


def load(root: Path) -> pd.DataFrame:
    return frame([load_run(d) for d in find_run_dirs(root)])


def num(value) -> float | None:
    """A finite number or None (a missing cell, NaN, a bool or text is no number)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        return None  # numbers.Real: numpy's scalars too, as a frame's cells are
    return float(value)


def metric_of(summary: dict) -> str:
    """The score a run's comparisons read: the first of METRICS it recorded ("none" if it has none)."""
    return next((name for name, key in METRICS.items() if num(get(summary, key)) is not None), "none")


def seconds(times: dict, keys) -> float:
    return float(sum(float(times.get(k, 0.0) or 0.0) for k in keys))


def humanline_spec(cfg: dict | None, on: bool) -> object:
    """core's HumanlineSpec of a flat config: humanline `on` and its hl.* knobs, the schema's defaults where unset."""
    from dataclasses import fields

    from humanline_cli.core.humanline import HumanlineSpec
    from humanline_cli.schema import HumanlineConfig

    cfg = cfg or {}
    hl = HumanlineConfig(**{f.name: cfg[f"hl.{f.name}"] for f in fields(HumanlineConfig) if f"hl.{f.name}" in cfg})
    return HumanlineSpec.from_config(bool(on), hl)


def loop_seconds(summary: dict) -> float:
    """The training loop's wall-clock: the total less setup, evaluation, saving, checkpoints, the sampler's start."""
    w = summary.get("wall_clock_s") or {}
    return float(w.get("total", 0.0)) - seconds(w, LEFT_OUT)


def get(tree: dict, dotted: str):
    for part in dotted.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def clock_steps(rows: list[dict]) -> set:
    """The steps whose train rows (wall_s, phase clocks) clocks reads and a study CSV keeps: every evaluation's
    and, for an evaluation whose step has no train row (train.log_every need not fall on it), the train rows
    logged last before and first after it."""
    evals = {r["step"] for r in rows if "step" in r and any(key in r for key, _ in CURVE.values())}
    logged = sorted({r["step"] for r in rows if "time/train" in r and isinstance(r.get("step"), (int, float))})
    around = {s for e in evals - set(logged) for s in (max((x for x in logged if x < e), default=None),
                                                       min((x for x in logged if x > e), default=None)) if s is not None}
    return evals | around


def _phases(row: dict) -> dict:
    return {k.removeprefix("time/"): v for k, v in row.items() if k.startswith("time/")}


def clocks(summary: dict, metrics: list[dict]) -> dict[str, tuple[list[float], list[float]]]:
    """A run's `work_s` (WORK phases so far) and `loop_s` (wall_s less the LEFT_OUT phases so far) against the
    step, each ([steps], [seconds]) to interpolate linearly (at_step): 0 at step 0, the train rows of clock_steps
    (those at and around each evaluation, what a study CSV keeps, so its runs read the same), the summary's at
    its last step. Train rows come every train.log_every steps, which need not fall on an evaluation's step (log
    every 10, evaluate every 32)."""
    known: dict[str, dict] = {"work_s": {0: 0.0}, "loop_s": {0: 0.0}}
    kept = clock_steps(metrics)
    for r in metrics:
        if "time/train" in r and r.get("step") in kept:
            times, step = _phases(r), int(r["step"])
            known["work_s"][step] = seconds(times, WORK)
            if num(r.get("wall_s")) is not None:
                known["loop_s"][step] = float(r["wall_s"]) - seconds(times, LEFT_OUT)
    if summary.get("wall_clock_s") and summary.get("steps"):
        end = int(summary["steps"])
        known["work_s"][end], known["loop_s"][end] = seconds(summary["wall_clock_s"], WORK), loop_seconds(summary)
    return {name: ([float(x) for x in sorted(at)], [at[x] for x in sorted(at)]) for name, at in known.items()}


def at_step(step: float, steps: list[float], values: list[float]) -> float | None:
    """A clock of `clocks` at `step`: its value there, linear between the two around it, None outside them (an
    incomplete run past its last logged train row)."""
    for i, x in enumerate(steps):
        if x == step:
            return values[i]
        if x > step:
            return None if i == 0 else values[i - 1] + (values[i] - values[i - 1]) * (step - steps[i - 1]) / (
                x - steps[i - 1])
    return None


def run_points(summary: dict, metrics: list[dict]) -> pd.DataFrame:
    """One run's evaluation points in long format, a row per point and recorded score: `point` (start at step 0
    and 0 s, every mid-run evaluation, final), `step`, `wall_s`, `work_s` (WORK phases so far) and `loop_s`
    (wall-clock less LEFT_OUT), a mid point's from the train row of its step, where train.log_every put none
    there from the run's clocks (linear between the train rows around it), then `metric` (of CURVE), `value`."""
    w = summary.get("wall_clock_s") or {}
    rows = [("start", 0, 0.0, 0.0, 0.0, {n: 0.5 if key is None else get(summary, key) for n, (_, key) in CURVE.items()})]
    train = {r["step"]: r for r in metrics if "time/train" in r}
    clock = None
    for r in metrics:
        if "step" in r and any(num(r.get(key)) is not None for key, _ in CURVE.values()):
            t = train.get(r["step"])
            if t is not None:
                loop = num(t.get("wall_s"))
                work, loop = seconds(_phases(t), WORK), None if loop is None else loop - seconds(_phases(t), LEFT_OUT)
            else:
                clock = clock or clocks(summary, metrics)
                work, loop = (at_step(r["step"], *clock[name]) for name in ("work_s", "loop_s"))
            rows.append(("mid", r["step"], num(r.get("wall_s")), work, loop,
                         {n: r.get(key) for n, (key, _) in CURVE.items()}))
    rows.append(("final", int(summary.get("steps") or 0), num(w.get("total")), seconds(w, WORK),
                 loop_seconds(summary) if w else None, {n: get(summary, key) for n, key in FINAL.items()}))
    out = pd.DataFrame([(*r[:5], n, num(v)) for r in rows for n, v in r[5].items()], columns=POINTS[1:])
    return out.dropna(subset=["value"]).astype(dict.fromkeys(TIMES, float)).reset_index(drop=True)


def points(runs: pd.DataFrame) -> pd.DataFrame:
    """Every run's evaluation points (run_points), `run` its index label in `runs`."""
    parts = [run_points(s, m).assign(run=i) for i, s, m in zip(runs.index, runs["summary"], runs["metrics"])]
    return pd.concat(parts, ignore_index=True)[POINTS] if parts else pd.DataFrame(columns=POINTS)


def curve(pts: pd.DataFrame, metric: str, *times: str) -> list[tuple]:
    """One run's points (rows of `points`) of one metric as [(*times, value)] where all were recorded, in order;
    the time is work_s unless `times` names others."""
    cols = [*(times or ("work_s",)), "value"]
    return list(pts.loc[pts.metric == metric, cols].dropna().astype(float).itertuples(index=False, name=None))


def column(runs: pd.DataFrame, key: str) -> pd.Series:
    """A summary or config field of every run as numbers (NaN where absent or not a number)."""
    if key not in runs:
        return pd.Series(float("nan"), index=runs.index)
    return pd.to_numeric(runs[key].map(lambda v: v if num(v) is not None else None), errors="coerce")


def write_csv(table: pd.DataFrame, path: Path, digits: int | dict | None = None) -> None:
    """A table as CSV: floats to `digits` significant digits (one for every column, or a column -> digits map;
    a column not in it as Python prints it), missing values empty."""
    out = table.astype(object)
    for c in out:
        d = digits.get(c) if isinstance(digits, dict) else digits
        out[c] = [None if isinstance(x, float) and x != x else format(x, f".{d}g") if d and isinstance(x, float)
                  else x for x in out[c]]
    out.to_csv(path, index=False, lineterminator="\r\n")  # as the csv module writes, so files stay byte-identical


def ci_text(ci: dict | None, fmt: str = ".3f") -> str:
    """`mean [lo, hi]` (stats.mean_ci), the mean alone without an interval, "–" for none."""
    if ci is None or ci.get("mean") is None:
        return "–"
    return format(ci["mean"], fmt) + ("" if ci.get("lo") is None else f" [{ci['lo']:{fmt}}, {ci['hi']:{fmt}}]")
