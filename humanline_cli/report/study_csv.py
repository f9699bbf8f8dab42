"""A study's runs as one small CSV kept in the repo (run dirs are not), and back: `export` writes one row per run
dir of a study with what a reader checks by eye (final and per-evaluation greedy and sampled accuracy, wall-clock
per phase, the config's hash, the commit the run started on) and what `humanline report --from-csv` needs to
rebuild the study's tables from the CSV alone: the config keys that tell its runs apart (with the keys the report
reads and those they interpolate), the summary's scores and clocks, the evaluation points, the generation calls
and each run's per-prompt eval scores. `materialise` writes those back as run dirs the report reads as usual.

Left out: the training logs between evaluations and logratios.jsonl, so the plots drawn from them are not rebuilt.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pandas as pd
import yaml

from humanline_cli.atomic import write_text_atomic
from humanline_cli.errors import UserError
from humanline_cli.report.cost import calls_of
from humanline_cli.report.frame import COMPUTE_KEY, CURVE, clock_steps, find_run_dirs, load_run, read_jsonl
from humanline_cli.report.gap_closed import SAMPLES
from humanline_cli.report.groups import INTERPOLATION, canon, comparable_config, under
from humanline_cli.report.regimes import listed_regimes, regime_of
from humanline_cli.train.failures import write_failed

# config keys every row keeps: what labels a run's family, regime and humanline setting
ALWAYS = ("seed", "task.name", "objective.name", "data.regime", "data.generate_every", "data.async_lag", "humanline",
          "hl", "regime_meta")
PLACE_KEYS = ("hydra", "wandb", "world_cache", "resume", "threads")  # where and how a run ran, never what it is
SELECTORS = ("name", "regime", "kind")  # a subtree's chosen option, which scopes its other keys
SUMMARY = ("status", "objective", "data", "humanline", "task", "model", "seed", "steps", "batch_size", "batch_unit",
           "eval", "wall_clock_s", "git_commit", "git_dirty", "started_at", "machine")
EVAL_KEYS = tuple(key for key, _ in CURVE.values())
COLUMNS = ("run", "status", "reason", "regime", "seed", "config_hash", "git_commit", "git_dirty", "started_at", "machine",
           "greedy_final", "sampled_final", "greedy_start", "sampled_start", "evals", "wall_clock_s", "config", "raw",
           "summary", "metrics", "calls", *(f"{mode}_scores" for mode in ("greedy", "sampled")))
MODES = {"greedy": "greedy accuracy", "sampled": "accuracy"}


def _dumps(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def config_hash(config: dict | None) -> str | None:
    """sha256 (12 hex) of a run's resolved config less its seed and the keys that never change results (and
    less the dtype it computed in, which its summary.json gives, not its config)."""
    if config is None:
        return None
    config = {k: v for k, v in config.items() if k != COMPUTE_KEY}
    return hashlib.sha256(_dumps(comparable_config(config)).encode()).hexdigest()[:12]


def kept_keys(configs: list[dict], raws: list[dict] = ()) -> set[str]:
    """The keys that differ between the runs (absent counts), ALWAYS's, the keys those interpolate in the raw
    configs `raws` (a kept `${train.steps}` must resolve from the CSV alone, or the run's family reads wrong), and
    each kept subtree's option selector."""
    flat = [c for c in configs if c is not None]
    keys = {k for c in flat for k in c}
    kept = {k for k in keys if len({canon(c.get(k, "<absent>")) for c in flat}) > 1 or under(k, ALWAYS)}
    kept = {k for k in kept if not under(k, PLACE_KEYS)}
    while True:  # an interpolated key may itself interpolate another
        refs = {r for raw in raws if raw for k in kept for r in INTERPOLATION.findall(str(raw.get(k, "")))}
        more = {k for k in keys if under(k, tuple(refs))} - kept
        if not more:
            break
        kept |= more
    kept |= {f"{k.split('.')[0]}.{s}" for k in kept for s in SELECTORS if f"{k.split('.')[0]}.{s}" in keys}
    return kept


def _metrics_rows(rows: list[dict]) -> list[dict]:
    """The evaluation rows (step, wall_s, scores), the train rows (wall_s and phase clocks) of clock_steps (the
    clocks at an evaluation between two logged steps: frame.clocks) and the last logged step: what run_points and
    an incomplete run's reason read."""
    evals = [{k: r[k] for k in ("step", "wall_s", *EVAL_KEYS) if k in r} for r in rows
             if "step" in r and any(k in r for k in EVAL_KEYS)]
    steps = {r["step"] for r in evals}
    train = [{k: v for k, v in r.items() if k in ("step", "wall_s") or k.startswith("time/")} for r in rows
             if r.get("step") in clock_steps(rows) and "time/train" in r]
    last = max((r["step"] for r in rows if isinstance(r.get("step"), (int, float))), default=None)
    tail = [{"step": last}] if last is not None and last not in steps else []
    return train + evals + tail


def _scores(path: Path, mode: str) -> str:
    rows = [r for r in read_jsonl(path / SAMPLES[MODES[mode]]) if r.get("policy_score") is not None]
    if not rows:
        return ""
    digest = hashlib.sha256("\n".join(str(r["prompt"]) for r in rows).encode()).hexdigest()[:8]
    return digest + ":" + _dumps([float(r["policy_score"]) for r in rows]).replace(".0,", ",").replace(".0]", "]")


def run_row(root: Path, run: dict, kept: set[str]) -> dict:
    s, cfg, raw = run["summary"], run["config"], run["raw"] or {}
    ev = s.get("eval") or {}
    evals = [{"step": r["step"], "greedy": r.get("eval/greedy/accuracy"), "sampled": r.get("eval/accuracy")}
             for r in run["metrics"] if "step" in r and ("eval/greedy/accuracy" in r or "eval/accuracy" in r)]
    calls = calls_of(run["path"])
    return {"run": run["path"].relative_to(root).as_posix(), "status": run["status"], "reason": run["reason"],
            "regime": regime_of(run["path"]) or "", "seed": run["seed"], "config_hash": config_hash(cfg),
            "git_commit": s.get("git_commit"), "git_dirty": s.get("git_dirty"), "started_at": s.get("started_at"),
            "machine": _dumps(s["machine"]) if s.get("machine") else "",
            "greedy_final": (ev.get("greedy") or {}).get("accuracy"), "sampled_final": ev.get("accuracy"),
            "greedy_start": (ev.get("greedy") or {}).get("start_accuracy"), "sampled_start": ev.get("start_accuracy"),
            "evals": _dumps(evals), "wall_clock_s": _dumps(s.get("wall_clock_s") or {}),
            "config": "" if cfg is None else _dumps({k: v for k, v in cfg.items() if k in kept}),
            "raw": _dumps({k: v for k, v in raw.items() if k in kept and canon(v) != canon((cfg or {}).get(k))}),
            "summary": _dumps({**{k: s[k] for k in SUMMARY if k in s}, "final_train_metrics": {
                k: v for k, v in (s.get("final_train_metrics") or {}).items() if k == "online/round"}}) if s else "",
            "metrics": _dumps(_metrics_rows(run["metrics"])),
            "calls": _dumps({"sequences": len(read_jsonl(run["path"] / "samples.jsonl"))} if calls is None else
                            {"calls": [[c.sequences, c.tokens, c.longest] for c in calls]}),
            **{f"{m}_scores": _scores(run["path"], m) for m in MODES}}


def export(root: Path, path: Path, append: bool = False) -> int:
    """Every run dir under `root` as a row of `path` (in the sweep's regime order where multirun.yaml lists it);
    returns the number of rows written. With `append`, `path`'s rows are kept as they are (runs from run dirs
    that are gone, e.g. made on another machine) and only `root`'s complete runs it lacks as complete are added,
    or replace a row that started on a dirty checkout with a clean start of the same run (_appended)."""
    root = Path(root)
    runs = [load_run(d) for d in find_run_dirs(root)]
    if not runs:
        raise UserError(f"no run dirs under {root} to export")
    if append and Path(path).is_file():
        return _appended(root, runs, Path(path))
    if append:  # a file still to start keeps complete runs only, as every later append does
        runs = [r for r in runs if r["status"] == "complete"]
        if not runs:
            return 0
    listed = listed_regimes(root)
    runs.sort(key=lambda r: (listed.index(regime_of(r["path"])) if regime_of(r["path"]) in listed else len(listed),
                             str(r["path"])))
    kept = kept_keys([r["config"] for r in runs], [r["raw"] for r in runs])
    rows = pd.DataFrame([run_row(root, r, kept) for r in runs], columns=list(COLUMNS), dtype=object)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(Path(path), rows.to_csv(index=False, lineterminator="\n"))
    return len(rows)


def _appended(root: Path, runs: list[dict], path: Path) -> int:
    """`path`'s rows, verbatim, and `root`'s complete runs that are not complete rows of it, in the file's regime
    order, then seed. A complete row that started on a dirty checkout gives way to a run of its name that started
    clean (a study's check excludes the one and counts the other: the rerun `lab/study_parts` makes).
    A new row keeps the config keys the file's rows keep, so it reads like them; refused where
    these runs differ in a key the file's rows do not keep, or where a run's config hash differs from the file's
    runs of its regime (the same regime made by other code or settings is not one study)."""
    old = read_table(path, name="--export-csv")
    rows = old.to_dict("records")
    dirty = {r["run"]: r["git_dirty"] == "True" for r in rows if r["status"] == "complete"}
    new = [r for r in runs if r["status"] == "complete" and _lacked(dirty, r["path"].relative_to(root).as_posix(), r)]
    if not new:
        return 0
    old_keys = {k for r in rows if r["config"] for k in json.loads(r["config"])}
    kept = kept_keys([r["config"] for r in new], [r["raw"] for r in new])
    if rows and kept - old_keys:
        raise UserError(f"--export-csv {path}: these runs differ in config keys its rows do not keep "
                        f"({', '.join(sorted(kept - old_keys))}); export every run dir together instead")
    hashes = {}
    for r in rows:
        hashes.setdefault(r["regime"], set()).add(r["config_hash"])
    added = [run_row(root, r, old_keys if rows else kept) for r in new]
    for r in added:
        if r["regime"] in hashes and r["config_hash"] not in hashes[r["regime"]]:
            raise UserError(f"--export-csv {path}: run {r['run']} has config hash {r['config_hash']}, its regime "
                            f"{r['regime']!r} there has {', '.join(sorted(hashes[r['regime']]))}")
    names = {r["run"] for r in added}
    rows = [r for r in rows if r["run"] not in names] + added
    order = list(dict.fromkeys([*old["regime"], *listed_regimes(root), *(r["regime"] for r in added)]))
    rows.sort(key=lambda r: (order.index(r["regime"]), int(r["seed"]) if str(r["seed"]).lstrip("-").isdigit()
                             else float("inf"), r["run"]))
    table = pd.DataFrame(rows, columns=list(COLUMNS), dtype=object)
    write_text_atomic(path, table.to_csv(index=False, lineterminator="\n"))
    return len(added)


def _lacked(dirty: dict[str, bool], name: str, run: dict) -> bool:
    """Whether a complete run named `name` belongs in a file whose complete rows started dirty as `dirty` says."""
    return name not in dirty or (dirty[name] and run["summary"].get("git_dirty") is False)


def _nested(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def _samples(calls: list) -> list[dict]:
    """samples.jsonl rows whose rounds have the recorded count, token sum and longest completion."""
    rows = []
    for i, (n, total, longest) in enumerate(calls, start=1):
        rest, k = total - longest, n - 1
        q, extra = divmod(rest, k) if k else (0, 0)
        rows += [{"round": i, "tokens": t} for t in [longest] + [q + 1] * extra + [q] * (k - extra)]
    return rows


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def read_table(csv_path: Path, needed=COLUMNS, name: str = "") -> pd.DataFrame:
    """A study CSV as text cells (an empty cell is ""), checked for the columns `needed`; a UserError naming the file
    (after `name`, the option that gave it) where it is unreadable or lacks one."""
    where = f"{name} {csv_path}".strip()
    try:
        table = pd.read_csv(csv_path, dtype=str, keep_default_na=False)
    except (OSError, ValueError, pd.errors.ParserError) as e:
        raise UserError(f"{where}: not a study CSV ({type(e).__name__}: {e})") from None
    missing = [c for c in needed if c not in table.columns]
    if missing:
        raise UserError(f"{where}: not a study CSV of `humanline report --export-csv` "
                        f"(missing columns: {', '.join(missing)})")
    return table


def materialise(csv_path: Path, into: Path) -> Path:
    """The CSV's runs as run dirs under `into` (with multirun.yaml listing the regimes in the CSV's order)."""
    table = read_table(csv_path, name="--from-csv")
    for r in table.to_dict("records"):
        d = Path(into) / r["run"]
        (d / ".hydra").mkdir(parents=True)
        if r["config"]:
            cfg = {**json.loads(r["config"]), **json.loads(r["raw"])}
            (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump(_nested(cfg), sort_keys=False))
        if r["regime"]:
            (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"regime={r['regime']}"]))
        if r["summary"]:
            (d / "summary.json").write_text(r["summary"])
        if r["status"] == "failed" and not r["summary"]:
            write_failed(d, {"status": "failed", "error": r["reason"]})
        _write_jsonl(d / "metrics.jsonl", json.loads(r["metrics"]))
        calls = json.loads(r["calls"])  # a run without per-completion tokens: as many rows, none counted
        _write_jsonl(d / "samples.jsonl", _samples(calls["calls"]) if "calls" in calls else
                     [{"round": 0}] * calls["sequences"])
        for mode, metric in MODES.items():
            if r[f"{mode}_scores"]:
                digest, scores = r[f"{mode}_scores"].split(":", 1)
                _write_jsonl(d / SAMPLES[metric], [{"prompt": f"{digest}:{i}", "policy_score": x}
                                                   for i, x in enumerate(json.loads(scores))])
    regimes = list(dict.fromkeys(x for x in table["regime"] if x))
    if regimes:
        (Path(into) / "multirun.yaml").write_text(yaml.safe_dump(
            {"hydra": {"sweeper": {"params": {"regime": ",".join(regimes)}}}}))
    return Path(into)
