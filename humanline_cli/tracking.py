"""Run outputs: metrics.jsonl (one JSON object per logged step), summary.json, and a wandb run.

wandb is optional at run time: any wandb failure is reported once and training continues.
Secrets (keys named like api_key/token/secret/password) are never put into the logged config.
"""
from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

SECRET = re.compile(r"(api[_-]?key|token|secret|password)", re.I)


def scrub(obj):
    if isinstance(obj, dict):
        return {k: ("***" if SECRET.search(str(k)) else scrub(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [scrub(v) for v in obj]
    return obj


def write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


class Tracker:
    def __init__(self, run_dir: Path, config: dict, wandb_cfg: dict, name: str):
        self.run_dir = run_dir
        self.metrics_path = run_dir / "metrics.jsonl"
        self._f = open(self.metrics_path, "a")
        self.wandb = None
        mode = wandb_cfg.get("mode") or "offline"
        if mode == "disabled":
            return
        try:
            import wandb

            self.wandb = wandb.init(project=wandb_cfg.get("project"), entity=wandb_cfg.get("entity"),
                                    mode=mode, dir=str(run_dir), name=name, config=scrub(config),
                                    tags=list(wandb_cfg.get("tags") or []), reinit="finish_previous")
        except Exception as e:  # a wandb failure never kills training
            warnings.warn(f"wandb disabled for this run: {type(e).__name__}: {e}")
            self.wandb = None

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": step, **metrics}
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()
        self._wandb_call("log", metrics, step=step)

    def log_histogram(self, step: int, counts: list[int]) -> None:
        """Token log-ratio histogram (logratios.jsonl): underflow, 60 bins over [-3, 3], overflow."""
        with open(self.run_dir / "logratios.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "lo": -3.0, "hi": 3.0, "counts": counts}) + "\n")

    def summary(self, summary: dict) -> None:
        write_json_atomic(self.run_dir / "summary.json", summary)
        if self.wandb is not None:
            try:
                flat = {}
                _flatten(summary, "", flat)
                self.wandb.summary.update(flat)
            except Exception as e:
                warnings.warn(f"wandb summary failed: {e}")

    def _wandb_call(self, method: str, *args, **kwargs) -> None:
        if self.wandb is None:
            return
        try:
            getattr(self.wandb, method)(*args, **kwargs)
        except Exception as e:
            warnings.warn(f"wandb disabled after error: {type(e).__name__}: {e}")
            self.wandb = None

    def finish(self, exit_code: int = 0) -> None:
        self._f.close()
        if self.wandb is not None:
            try:
                self.wandb.finish(exit_code=exit_code)
            except Exception as e:
                warnings.warn(f"wandb finish failed: {e}")
            self.wandb = None


def _flatten(d: dict, prefix: str, out: dict) -> None:
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            _flatten(v, key + ".", out)
        elif isinstance(v, (int, float, str, bool)) or v is None:
            out[key] = v


class NullTracker:
    """What ranks other than 0 log to: nothing (rank 0 writes every output)."""

    def log(self, step: int, metrics: dict) -> None:
        pass

    def log_histogram(self, step: int, counts: list[int]) -> None:
        pass

    def summary(self, summary: dict) -> None:
        pass

    def finish(self, exit_code: int = 0) -> None:
        pass
