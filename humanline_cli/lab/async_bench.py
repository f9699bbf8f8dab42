"""`python -m humanline_cli.lab.async_bench --rounds N [--out FILE] [overrides]`: online rounds per second (one
optimizer step each) at data.async_lag=0 (sample, label, train in turn) against data.async_lag=1 (the sampler
process samples round r+1 while round r trains), and the bound an overlap could reach, max(sample + label + push,
train + sync) per round of the synchronous run. Rounds 2..N are timed. Each row gives the CPU and run-queue seconds
per round (trainer + sampler process): a large run-queue time means other work holds the cores and the bound (one
core each) is out of reach; the overlap is counted from the rounds' timestamps.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from humanline_cli.bench.clock import EndClock, StepClock, built, compose, train_loop
from humanline_cli.errors import UserError
from humanline_cli.lab.tool import measure_and_write
from humanline_cli.sampling.proc_clock import cpu_s, run_queue_s

SAMPLE_PHASES = ("sample", "label", "push")
TRAIN_PHASES = ("train", "sync")


def _spec(overrides: list[str], rounds: int, lag: int):
    user = [o for o in overrides if o.split("=")[0] not in ("data", "data.async_lag")]
    return compose(user, ("data=online", f"data.async_lag={lag}", "data.generate_every=1", f"train.steps={rounds}",
                          "train.log_every=1000000", "train.save_model=false", "train.checkpoint_every=0",
                          "eval.every=0", "eval.n_prompts=1"))


class PhaseClock(StepClock):
    """A StepClock that also records, as each step starts, the timer's phase seconds and this process's CPU and
    run-queue seconds so far."""

    def __init__(self, source, device, timer):
        super().__init__(source, device)
        self.timer, self.phases, self.cpu = timer, [], []

    def next_step(self, step: int):
        self.phases.append(dict(self.timer.seconds))
        self.cpu.append((cpu_s(), run_queue_s()))
        return super().next_step(step)


def _run(spec) -> dict:
    with built(spec) as (parts, timer, _):
        spec = parts.spec
        parts.source = clock = PhaseClock(parts.source, parts.backend.device, timer)
        tracker = EndClock(spec.train.steps, parts.backend.device)
        train_loop(parts, timer, tracker)
        end, end_cpu = dict(timer.seconds), (cpu_s(), run_queue_s())
        rounds = dict(clock.source.round_clock)  # an online source (_spec sets data=online)
    timed = spec.train.steps - 1
    seconds = tracker.end - clock.starts[1]
    delta = {k: end.get(k, 0.0) - clock.phases[1].get(k, 0.0) for k in end}
    (c0, q0), (c1, q1) = clock.cpu[1], end_cpu
    out = {"rounds_timed": timed, "seconds": seconds, "round_s": seconds / timed, "rounds_per_s": timed / seconds,
           "phase_s_per_round": {k: v / timed for k, v in sorted(delta.items()) if v},
           "trainer_cpu_s_per_round": (c1 - c0) / timed,
           "trainer_run_queue_s_per_round": (q1 - q0) / timed if q0 is not None and q1 is not None else None}
    if rounds:
        out.update(sampler_rounds(rounds, range(2, spec.train.steps + 1)))
        t0 = rounds[1]["began_at"]  # times relative to the first round's start, comparable across runs
        out["round_clock"] = {r: {k: v - t0 if k.endswith("_at") else v for k, v in c.items()}
                              for r, c in sorted(rounds.items())}
    return out


def sampler_rounds(rounds: dict[int, dict], timed: range) -> dict:
    """The sampler process's CPU and run-queue seconds per timed round, and the rounds r whose successor it began
    before the trainer began round r + 1, i.e. while round r trained."""
    queued = [rounds[r].get("run_queue_s") for r in timed]
    pairs = [r for r in timed if r + 1 in timed]
    overlapped = [r for r in pairs if rounds[r + 1]["started_at"] < rounds[r + 1]["began_at"]]
    return {"sampler_cpu_s_per_round": sum(rounds[r]["cpu_s"] for r in timed) / len(timed),
            "sampler_run_queue_s_per_round": None if None in queued else sum(queued) / len(timed),
            "overlapped_rounds": len(overlapped), "overlap_pairs": len(pairs)}


def async_bench(overrides: list[str], rounds: int, console) -> dict:
    if rounds < 3:
        raise UserError("async_bench: --rounds must be >= 3 (round 1 is not timed)")
    specs = [_spec(overrides, rounds, lag) for lag in (0, 1)]  # both validated before any work
    out: dict = {"objective": specs[0].objective, "task": specs[0].task, "threads": specs[0].threads,
                 "rounds": rounds}
    for lag, spec in enumerate(specs):
        console.print(f"[dim]bench async: data.async_lag={lag}, {rounds} rounds[/]")
        out[f"lag{lag}"] = _run(spec)
    per = out["lag0"]["phase_s_per_round"]
    sample = sum(per.get(k, 0.0) for k in SAMPLE_PHASES)
    train = sum(per.get(k, 0.0) for k in TRAIN_PHASES)
    bound = max(sample, train)
    out.update(sample_s_per_round=sample, train_s_per_round=train, bound_round_s=bound,
               lag1_over_bound=out["lag1"]["round_s"] / bound, speedup=out["lag0"]["round_s"] / out["lag1"]["round_s"])
    return out


def print_async(res: dict, console) -> None:
    import pandas as pd

    def row(r: dict) -> dict:  # seconds per round; CPU and run-queue: the trainer's + the sampler process's
        per, queues = r["phase_s_per_round"], [r["trainer_run_queue_s_per_round"],
                                               r.get("sampler_run_queue_s_per_round", 0.0)]
        return {"s/round": f"{r['round_s']:.3f}", "rounds/s": f"{r['rounds_per_s']:.3f}",
                "sample": f"{sum(per.get(k, 0.0) for k in SAMPLE_PHASES):.3f}",
                "train": f"{sum(per.get(k, 0.0) for k in TRAIN_PHASES):.3f}",
                "wait": f"{per.get('wait_for_sample', 0.0):.3f}",
                "CPU": f"{r['trainer_cpu_s_per_round'] + r.get('sampler_cpu_s_per_round', 0.0):.3f}",
                "run-queue": "n/a" if None in queues else f"{sum(queues):.3f}"}

    table = pd.DataFrame({"lag 0": row(res["lag0"]), "lag 1": row(res["lag1"]),
                          "bound": {"s/round": f"{res['bound_round_s']:.3f}",
                                    "rounds/s": f"{1 / res['bound_round_s']:.3f}"}}).T.fillna("")
    lag1 = res["lag1"]
    console.print(f"humanline bench async: {res['objective']} on {res['task']}, {res['threads']} training thread(s) + "
                  f"the sampler process's, rounds 2..{res['rounds']} timed (a round = one step; seconds per round)\n"
                  f"{table.to_string()}\n"
                  f"lag 1 / bound: {res['lag1_over_bound']:.3f}x; lag 0 / lag 1 (speed-up): {res['speedup']:.3f}x; "
                  f"the sampler began round r+1 while round r trained in {lag1['overlapped_rounds']} of "
                  f"{lag1['overlap_pairs']} rounds\n"
                  "run-queue: seconds the processes were ready to run but waited for a CPU (other work on the "
                  "machine); well above 0, the bound (measured without contention between them) is out of reach",
                  markup=False, highlight=False)


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    p = argparse.ArgumentParser(prog="python -m humanline_cli.lab.async_bench", description=__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", help="Hydra overrides of the online run timed (objective=..., threads=...)")
    p.add_argument("--rounds", type=int, default=8, help="rounds per run (round 1 is not timed)")
    p.add_argument("--out", type=Path, default=None, help="the JSON written (default runs/bench/async-*.json)")
    a = p.parse_args(argv)
    console = Console()
    return measure_and_write("async_bench", lambda: (async_bench(a.overrides, a.rounds, console), "async-", print_async),
                             a.out, console)


if __name__ == "__main__":
    raise SystemExit(main())
