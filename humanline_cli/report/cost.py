"""`humanline report`: what each regime's training cost in generation, at matched training units.

Every run of a study trains the same number of units (steps x batch size); what differs is how its data was
generated while it trained. Per run, from the files it wrote:
- sampled sequences: completions the sampler generated during the run (lines of samples.jsonl, one per
  completion; 0 for offline data, whose file was sampled once before any run);
- generation calls: the rounds (`online/round` at the end), each one batched request to the sampler;
- weight pushes: one per round (the policy's weights sent to the sampler before it samples; on a GPU, the
  NCCL broadcast or in-place reload that stale rounds do K times less often);
- sequences per call: the batch a generation call gets (bigger is cheaper per sequence on a GPU);
- generated tokens (all calls) and the longest completion per call (mean over calls of each call's longest):
  a call's decoding runs as many steps as its longest completion, so a few long replies make a call
  latency-bound (report/predict.py); blank for runs recorded before samples.jsonl carried each completion's
  `tokens`.
Rows pool the seeds of one regime (the sweep's `regime=` name, else the report family and its label) by the
mean; ratios are against online of the same objective. These counts are exact and machine-independent, so
they say where a GPU run's speedup would come from even where this CPU's wall-clock cannot show it.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pandas as pd

from humanline_cli.report.frame import md_table
from humanline_cli.report.predict import Call

CSV_COLUMNS = ("task", "objective", "regime", "n_runs", "units_trained", "sampled_sequences", "generation_calls",
               "weight_pushes", "sequences_per_call", "pushes_vs_online", "sequences_vs_online", "generated_tokens",
               "longest_completion_per_call")


def calls_of(run_path: Path) -> tuple | None:
    """predict.Call per generation round from samples.jsonl (one line per completion, with its round and
    `tokens`); () without samples; None when its lines lack `tokens` (a run recorded before they were written)."""
    f = Path(run_path) / "samples.jsonl"
    if not f.is_file():
        return ()
    rounds: dict[int, list[int]] = {}
    with open(f) as fh:
        for line in fh:
            if not line.strip():
                continue
            row = json.loads(line)
            if "tokens" not in row:
                return None
            rounds.setdefault(int(row["round"]), []).append(int(row["tokens"]))
    return tuple(Call(len(v), sum(v), max(v)) for _, v in sorted(rounds.items()))


def run_cost(path: Path, summary: dict) -> dict:
    """A complete run's generation counts, read from its summary.json and samples.jsonl. Pushes: the online source
    pushes (or snapshots, under async) once per round."""
    calls = int((summary.get("final_train_metrics") or {}).get("online/round") or 0)
    samples = Path(path) / "samples.jsonl"
    sequences = sum(1 for line in open(samples, "rb") if line.strip()) if samples.is_file() else 0
    counted = calls_of(path)
    tokens = sum(c.tokens for c in counted) if counted else (0 if counted == () else None)
    return {"units_trained": int(summary.get("steps") or 0) * int(summary.get("batch_size") or 0),
            "sampled_sequences": sequences, "generation_calls": calls, "weight_pushes": calls,
            "generated_tokens": tokens,
            "longest_completion_per_call": statistics.fmean(c.longest for c in counted) if counted else None}


def _mean(s: pd.Series) -> float | None:
    """The mean over a regime's runs, None when any run lacks the count (recorded before it was)."""
    return None if s.isna().any() else float(s.mean())


def cost_rows(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per (task, objective, regime) of the complete runs (CSV_COLUMNS), in first-seen order: the mean
    over its runs of each count, and its pushes and sequences against online of the same objective."""
    if runs.empty:
        return pd.DataFrame(columns=CSV_COLUMNS)
    per = pd.DataFrame([run_cost(r.path, r.summary) for r in runs.itertuples()], index=runs.index, dtype=float)
    per[["task", "objective", "regime"]] = runs[["task", "objective", "regime"]]
    by = per.groupby(["task", "objective", "regime"], sort=False)
    out = by.agg(_mean).reset_index().astype(object)
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

    def f(x, spec: str) -> str:
        return "–" if x is None or x != x else spec.format(x)

    return ["Generation during training, at matched training units (mean over the regime's runs; ratios against "
            "online of the same objective). Offline data was sampled once before the runs and is not counted.", "",
            *md_table(["task", "objective", "regime", "runs", "units trained", "sampled sequences", "generation calls",
                       "weight pushes", "sequences per call", "pushes vs online", "generated tokens",
                       "longest completion per call"],
                      [(r.task, r.objective, r.regime, r.n_runs, f(r.units_trained, "{:.0f}"),
                        f(r.sampled_sequences, "{:.0f}"), f(r.generation_calls, "{:.1f}"), f(r.weight_pushes, "{:.1f}"),
                        f(r.sequences_per_call, "{:.0f}"), f(r.pushes_vs_online, "{:.3f}x"),
                        f(r.generated_tokens, "{:.0f}"), f(r.longest_completion_per_call, "{:.1f}"))
                       for r in rows.itertuples()])]
