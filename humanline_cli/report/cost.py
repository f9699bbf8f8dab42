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

import csv
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from humanline_cli.report.predict import Call
from humanline_cli.report.regime_map import regime_label

CSV_COLUMNS = ("task", "objective", "regime", "n_runs", "units_trained", "sampled_sequences", "generation_calls",
               "weight_pushes", "sequences_per_call", "pushes_vs_online", "sequences_vs_online", "generated_tokens",
               "longest_completion_per_call")


@dataclass(frozen=True)
class RunCost:
    units: int
    sequences: int
    calls: int
    tokens: int | None = None             # generated tokens, all calls
    longest_per_call: float | None = None  # mean over calls of the call's longest completion (tokens)

    @property
    def pushes(self) -> int:
        return self.calls  # the online source pushes (or snapshots, under async) once per round


@dataclass(frozen=True)
class CostRow:
    task: str
    objective: str
    regime: str
    costs: tuple  # RunCost per seed

    def mean(self, attr: str) -> float | None:
        values = [getattr(c, attr) for c in self.costs]
        return None if any(v is None for v in values) or not values else statistics.fmean(values)

    @property
    def per_call(self) -> float | None:
        calls = self.mean("calls")
        return self.mean("sequences") / calls if calls else None


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


def run_cost(run) -> RunCost:
    """A complete run's generation counts, read from its summary.json and samples.jsonl."""
    s = run.summary
    units = int(s.get("steps") or 0) * int(s.get("batch_size") or 0)
    calls = int((s.get("final_train_metrics") or {}).get("online/round") or 0)
    samples = Path(run.path) / "samples.jsonl"
    sequences = 0
    if samples.is_file():
        with open(samples, "rb") as f:
            sequences = sum(1 for line in f if line.strip())
    counted = calls_of(run.path)
    if not counted:  # offline (no samples) or recorded before per-completion tokens
        return RunCost(units, sequences, calls, 0 if counted == () else None, None)
    return RunCost(units, sequences, calls, sum(c.tokens for c in counted),
                   statistics.fmean(c.longest for c in counted))


def cost_rows(runs: list) -> list[CostRow]:
    """One row per (task, objective, regime) of the complete runs, in first-seen order."""
    by: dict[tuple, list] = {}
    for r in runs:
        if r.status == "complete":
            by.setdefault((r.task, r.objective, regime_label(r)), []).append(run_cost(r))
    return [CostRow(t, o, name, tuple(cs)) for (t, o, name), cs in by.items()]


def _online(rows: list[CostRow], row: CostRow) -> CostRow | None:
    match = [r for r in rows if (r.task, r.objective, r.regime) == (row.task, row.objective, "online")]
    return match[0] if match else None


def _ratio(a: float, b: float | None) -> float | None:
    return a / b if b else None


def write_csv(rows: list[CostRow], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for r in rows:
            on = _online(rows, r)
            w.writerow([r.task, r.objective, r.regime, len(r.costs), f"{r.mean('units'):.8g}",
                        f"{r.mean('sequences'):.8g}", f"{r.mean('calls'):.8g}", f"{r.mean('pushes'):.8g}",
                        "" if r.per_call is None else f"{r.per_call:.8g}",
                        _fmt(_ratio(r.mean("pushes"), on and on.mean("pushes"))),
                        _fmt(_ratio(r.mean("sequences"), on and on.mean("sequences"))), _fmt(r.mean("tokens")),
                        _fmt(r.mean("longest_per_call"))])


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:.8g}"


def _num(x: float | None, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def markdown(rows: list[CostRow]) -> list[str]:
    if not rows:
        return ["No complete runs."]
    out = ["Generation during training, at matched training units (mean over the regime's runs; ratios against "
           "online of the same objective). Offline data was sampled once before the runs and is not counted.", "",
           "| task | objective | regime | runs | units trained | sampled sequences | generation calls | "
           "weight pushes | sequences per call | pushes vs online | generated tokens | longest completion per call |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        on = _online(rows, r)
        ratio = _ratio(r.mean("pushes"), on and on.mean("pushes"))
        out.append(f"| {r.task} | {r.objective} | {r.regime} | {len(r.costs)} | {r.mean('units'):.0f} | "
                   f"{r.mean('sequences'):.0f} | {r.mean('calls'):.1f} | {r.mean('pushes'):.1f} | "
                   f"{'–' if r.per_call is None else f'{r.per_call:.0f}'} | "
                   f"{'–' if ratio is None else f'{ratio:.3f}x'} | {_num(r.mean('tokens'), '.0f')} | "
                   f"{_num(r.mean('longest_per_call'), '.1f')} |")
    return out
