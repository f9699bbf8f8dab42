"""`humanline <command>`: parse argv, dispatch. Each command lives in its own module: train (cli/train.py,
a Hydra app), report (report/aggregate.py), eval (cli/eval.py), bench (bench/project.py), sample
(cli/sample.py). Hydra owns argv, so the subcommand is stripped before Hydra parses the rest; shell
completion arrives without it."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from humanline_cli.cli.overrides import normalize_overrides
from humanline_cli.cli.train import report_interrupt, run_train
from humanline_cli.errors import fail

COMMANDS = {
    "train": "train a policy (Hydra app: overrides, -m sweeps, --help, --cfg job)",
    "report": "paper-style table (Markdown, CSV) and plots from a sweep or runs dir",
    "eval": "win rate of one trained run against another run or the starting policy",
    "bench": "training throughput (plain, humanline, vs TRL), model FLOP/s; KEY=VALUE args, --help",
    "sample": "offline dataset from a model's own samples, scored (pairs, groups, unpaired, card); out=DIR, --help",
}
USAGE = "usage: humanline {" + ",".join(COMMANDS) + "} ...\n" + "\n".join(f"  {k:8s} {v}" for k, v in COMMANDS.items())


def main(argv: list[str] | None = None) -> None:
    try:
        _dispatch(argv)
    except KeyboardInterrupt:  # outside a job (starting up, composing): nothing was written
        report_interrupt()


def _dispatch(argv: list[str] | None = None) -> None:
    argv = list(sys.argv if argv is None else argv)
    args = argv[1:]
    if args and (args[0].startswith("-sc") or args[0].startswith("--shell-completion")):
        sys.argv = [argv[0], *args]  # shell completion arrives without the subcommand...
        line = os.environ.get("COMP_LINE", "")
        words = line.split(" ")
        if len(words) > 1 and words[1] in COMMANDS:  # ...but the line being completed has it
            os.environ["COMP_LINE"] = " ".join([words[0], *words[2:]])
        return run_train()
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return
    cmd, rest = args[0], args[1:]
    if cmd not in COMMANDS:
        fail(f"unknown command {cmd!r}; expected one of: {', '.join(COMMANDS)}")
    rest = normalize_overrides(rest)
    if cmd == "train" and os.environ.get("RANK", "0") != "0":
        # torchrun: only rank 0's Hydra makes the run dir; the others use a throwaway one and adopt
        # rank 0's (train/job.py)
        import tempfile

        rest += [f"hydra.run.dir={tempfile.mkdtemp(prefix='humanline-rank')}", "hydra.output_subdir=null"]
    sys.argv = [f"{Path(argv[0]).name} {cmd}", *rest]
    match cmd:
        case "train":
            run_train()
        case "report":
            from humanline_cli.report.aggregate import main_report

            sys.exit(main_report(rest))
        case "eval":
            from humanline_cli.cli.eval import main_eval

            sys.exit(main_eval(rest))
        case "bench":
            from humanline_cli.bench.project import main_bench

            sys.exit(main_bench(rest))
        case "sample":
            from humanline_cli.cli.sample import main_sample

            sys.exit(main_sample(rest))


if __name__ == "__main__":
    main()
