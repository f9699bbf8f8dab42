"""What each regime's training cost in generation at matched training units (steps x batch size), per run from
samples.jsonl (one line per completion, its round and `tokens`) and summary.json, pooled per regime by the mean
with ratios against online of the same objective: exact, machine-independent counts of where a speedup comes from.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from humanline_cli.mdtable import md_frame
from humanline_cli.report.frame import read_jsonl

CSV_COLUMNS = ("task", "objective", "regime", "n_runs", "units_trained", "sampled_sequences", "generation_calls",
               "weight_pushes", "sequences_per_call", "pushes_vs_online", "sequences_vs_online", "generated_tokens",
               "longest_completion_per_call")


@dataclass(frozen=True)
class Call:
    """One generation call, counted (the cost model in lab/predict.py prices it)."""

    sequences: int   # m: completions the call generates
    tokens: int      # G: their generated tokens
    longest: int     # L: the longest completion, tokens


def calls_of(run_path: Path) -> tuple | None:
    """predict.Call per round from samples.jsonl; () without samples; None when its lines lack `tokens`."""
    rows = pd.DataFrame(read_jsonl(Path(run_path) / "samples.jsonl"))
    if rows.empty:
        return ()
    if "tokens" not in rows or rows["tokens"].isna().any():
        return None
    by = rows.astype({"round": int, "tokens": int}).groupby("round")["tokens"]
    return tuple(Call(int(n), int(g), int(m)) for n, g, m in zip(by.size(), by.sum(), by.max()))


def run_cost(path: Path, summary: dict) -> dict:
    """A complete run's generation counts; one weight push (or snapshot) per round."""
    calls = int((summary.get("final_train_metrics") or {}).get("online/round") or 0)
    counted = calls_of(path)
    return {"units_trained": int(summary.get("steps") or 0) * int(summary.get("batch_size") or 0),
            "sampled_sequences": len(read_jsonl(Path(path) / "samples.jsonl")),
            "generation_calls": calls, "weight_pushes": calls,
            "generated_tokens": sum(c.tokens for c in counted) if counted is not None else None,
            "longest_completion_per_call": float(np.mean([c.longest for c in counted])) if counted else None}


def cost_rows(runs: pd.DataFrame) -> pd.DataFrame:
    if runs.empty:
        return pd.DataFrame(columns=CSV_COLUMNS)
    per = pd.DataFrame([run_cost(r.path, r.summary) for r in runs.itertuples()], index=runs.index, dtype=float)
    per[["task", "objective", "regime"]] = runs[["task", "objective", "regime"]]
    by = per.groupby(["task", "objective", "regime"], sort=False)
    # a run recorded before a count was written leaves the regime's mean empty
    out = by.agg(lambda s: None if s.isna().any() else float(s.mean())).reset_index().astype(object)
    out.insert(3, "n_runs", by.size().to_numpy())
    out["sequences_per_call"] = [s / c if c else None for s, c in zip(out.sampled_sequences, out.generation_calls)]
    online = out[out.regime == "online"].set_index(["task", "objective"])
    for col, of in (("pushes_vs_online", "weight_pushes"), ("sequences_vs_online", "sampled_sequences")):
        base = [online[of].get((t, o)) for t, o in zip(out.task, out.objective)]
        out[col] = [v / b if b else None for v, b in zip(out[of], base)]
    return out[list(CSV_COLUMNS)]


def markdown(rows: pd.DataFrame) -> list[str]:
    if rows.empty:
        return ["No complete runs."]
    fmt = {"units_trained": "{:.0f}", "sampled_sequences": "{:.0f}", "generation_calls": "{:.1f}",
           "weight_pushes": "{:.1f}", "sequences_per_call": "{:.0f}", "pushes_vs_online": "{:.3f}x",
           "generated_tokens": "{:.0f}", "longest_completion_per_call": "{:.1f}"}
    return ["Generation during training, at matched training units (mean over the regime's runs; ratios against "
            "online of the same objective). Offline data was sampled once before the runs and is not counted.", "",
            *md_frame(rows.drop(columns="sequences_vs_online").rename(columns={"n_runs": "runs"}), fmt)]
