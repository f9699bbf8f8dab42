"""Reading run dirs for `humanline report` (and the regime map): one `Run` per directory holding
`.hydra/config.yaml`, `summary.json`, `failed.json` or `metrics.jsonl`, labelled from its resolved config
and its summary; complete, failed (with the reason) or incomplete (with the last logged step)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

MARKERS = ("summary.json", "failed.json", "metrics.jsonl")


@dataclass
class Run:
    path: Path
    status: str  # complete | failed | incomplete
    task: str = "?"
    objective: str = "?"
    data: str = "?"
    humanline: bool = False
    seed: object = None
    reason: str = ""
    summary: dict = field(default_factory=dict)
    metrics: list = field(default_factory=list)
    logratios: list = field(default_factory=list)
    config: dict | None = None  # resolved .hydra/config.yaml flattened to dotted keys; None if absent/unreadable
    raw: dict = field(default_factory=dict)  # the same keys unresolved (interpolation text), to see derived keys
    variant: str = ""  # what tells this run's group apart from others at the same table position (set by aggregate)
    fingerprint: str = ""  # sha256 of the run's outputs (summary.json, metrics.jsonl): equal for a copied run dir

    @property
    def family(self) -> str:
        return ("humanline-" if self.humanline else "") + str(self.data)



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


def _read_jsonl(path: Path) -> list[dict]:
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


def _read_json(path: Path):
    try:
        return json.loads(path.read_text()), None
    except (OSError, ValueError) as e:
        return None, f"unreadable {path.name}: {type(e).__name__}: {e}"


def _flatten(tree, prefix="", out=None) -> dict:
    out = {} if out is None else out
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            _flatten(v, f"{prefix}{k}.", out)
        else:
            out[f"{prefix}{k}"] = v
    return out


def read_config(path: Path) -> tuple[dict, dict] | None:
    """(resolved, raw) flat dotted-key views of a Hydra config.yaml, or None if unreadable.

    Hydra saves the config with its interpolations (`${task.offline.path}`); each leaf is resolved on its own so
    one that cannot be resolved here (a `${hydra:...}` resolver, a missing env var) keeps its text instead of
    costing the whole config. Lists stay single values."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    try:
        cfg = OmegaConf.load(path)
    except Exception:  # an unreadable config only costs the grouping (the run falls back to summary labels)
        return None
    if not isinstance(cfg, DictConfig):
        return None
    raw = _flatten(OmegaConf.to_container(cfg, resolve=False))
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


def data_family(regime: str, cfg: dict) -> str:
    """The data part of a run's family: the regime, except for online rounds that are off-policy by design,
    each a baseline of its own, compared with (synchronous, lag-0) online and with humanline on the same rounds:
    - `stale-K`: rounds that serve K > 1 optimizer steps per generation (data.generate_every=K; the authors'
      math "offline");
    - `async-L`: rounds sampled L > 0 rounds ahead by the sampler process (data.async_lag=L), so never
      averaged with another lag; both at once: `stale-K-async-L`."""
    if regime != "online":
        return regime
    k, lag = cfg.get("data.generate_every"), cfg.get("data.async_lag")
    parts = ([f"stale-{k}"] if isinstance(k, int) and k > 1 else []) + ([f"async-{lag}"] if isinstance(lag, int)
                                                                         and lag > 0 else [])
    return "-".join(parts) or regime


def _label_from_config(run: Run) -> None:
    path = run.path / ".hydra" / "config.yaml"
    got = read_config(path) if path.is_file() else None
    if got is None:
        return
    run.config, run.raw = got
    cfg = run.config
    run.objective = str(cfg.get("objective.name") or run.objective)
    run.data = data_family(str(cfg.get("data.regime") or run.data), cfg)
    run.task = str(cfg.get("task.name") or run.task)
    run.seed = cfg["seed"] if cfg.get("seed") is not None else run.seed
    run.humanline = cfg.get("humanline") is True  # only present when the user passed +humanline=true


def outputs_fingerprint(path: Path) -> str:
    """What a run produced, by content: a copy of a run dir has the same fingerprint, a rerun of the same
    config and seed (its own wall-clock in metrics.jsonl and summary.json) another one."""
    import hashlib

    h = hashlib.sha256()
    for name in ("summary.json", "metrics.jsonl"):
        f = path / name
        h.update(name.encode() + b"\0" + (f.read_bytes() if f.is_file() else b"") + b"\0")
    return h.hexdigest()


def load_run(path: Path) -> Run:
    run = Run(path=path, status="incomplete")
    run.fingerprint = outputs_fingerprint(path)
    _label_from_config(run)
    run.metrics = _read_jsonl(path / "metrics.jsonl")
    run.logratios = _read_jsonl(path / "logratios.jsonl")
    if (path / "summary.json").is_file():
        s, err = _read_json(path / "summary.json")
        if isinstance(s, dict) and s.get("status") == "complete":
            run.status, run.summary = "complete", s
            run.objective, run.data, run.task = str(s.get("objective")), str(s.get("data")), str(s.get("task"))
            run.data = data_family(run.data, run.config or {})
            run.humanline, run.seed = bool(s.get("humanline")), s.get("seed")
            return run
        run.status = "failed"
        run.reason = err or f"summary.json has status {s.get('status') if isinstance(s, dict) else s!r}"
    if (path / "failed.json").is_file():
        f, err = _read_json(path / "failed.json")
        run.status = "failed"
        run.reason = err or str((f or {}).get("error") or "failed.json without an error message")
    elif run.status == "incomplete":
        steps = [r["step"] for r in run.metrics if isinstance(r.get("step"), (int, float))]
        last = f"; last logged step {int(max(steps))}" if steps else "; no steps logged"
        run.reason = "incomplete: no summary.json or failed.json (crashed, killed or still running)" + last
    return run
