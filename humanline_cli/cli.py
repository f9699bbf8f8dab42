"""`humanline <command>`: train (Hydra app), plus report/eval added by later modules.

Hydra owns argv, so the subcommand is stripped before Hydra parses the rest. User mistakes print
one line and exit 2 (HYDRA_FULL_ERROR=1 shows the traceback instead).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

COMMANDS = {
    "train": "train a policy (Hydra app: overrides, -m sweeps, --help, --cfg job)",
    "report": "paper-style table (Markdown, CSV) and plots from a sweep or runs dir",
    "eval": "win rate of one trained run against another run or the starting policy",
}
USAGE = "usage: humanline {train,report,eval} ...\n" + "\n".join(f"  {k:8s} {v}" for k, v in COMMANDS.items())


def _fail(msg: str, code: int = 2):
    print(f"humanline: error: {msg}", file=sys.stderr)
    sys.exit(code)


def is_complete(run_dir: Path) -> bool:
    """The sweep resume rule: a run dir whose summary.json says status=complete is done."""
    import json

    try:
        return json.loads((run_dir / "summary.json").read_text()).get("status") == "complete"
    except (OSError, ValueError):
        return False


def _train_app():
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig

    @hydra.main(version_base="1.3", config_path="pkg://conf", config_name="train")
    def app(cfg: DictConfig) -> None:
        from .errors import RunFailed, UserError
        from .run import run_job

        run_dir = Path(HydraConfig.get().runtime.output_dir)
        multirun = str(HydraConfig.get().mode) == "RunMode.MULTIRUN"
        if multirun and cfg.get("resume", True) and is_complete(run_dir):
            print(f"humanline: skipping {run_dir}: already complete (resume=false reruns it)", file=sys.stderr)
            return
        try:
            run_job(cfg, run_dir)
        except UserError as e:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            _fail(str(e))
        except RunFailed as e:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            if multirun:  # one failed job should not kill a sweep; report lists it from failed.json
                print(f"humanline: run failed ({run_dir}): {e}", file=sys.stderr)
                return
            _fail(f"run failed ({run_dir}): {e}")

    return app


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv if argv is None else argv)
    args = argv[1:]
    if args and (args[0].startswith("-sc") or args[0].startswith("--shell-completion")):
        sys.argv = [argv[0], *args]  # shell completion arrives without the subcommand...
        line = os.environ.get("COMP_LINE", "")
        words = line.split(" ")
        if len(words) > 1 and words[1] in COMMANDS:  # ...but the line being completed has it
            os.environ["COMP_LINE"] = " ".join([words[0], *words[2:]])
        return _run_hydra()
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return
    cmd, rest = args[0], args[1:]
    if cmd not in COMMANDS:
        _fail(f"unknown command {cmd!r}; expected one of: {', '.join(COMMANDS)}")
    sys.argv = [f"{Path(argv[0]).name} {cmd}", *rest]
    match cmd:
        case "train":
            _run_hydra()
        case "report":
            from .report import main_report

            sys.exit(main_report(rest))
        case "eval":
            from .eval_cmd import main_eval

            sys.exit(main_eval(rest))


def check_group_choices(args: list[str]) -> None:
    """Catch unknown group options (objective=foo) with one line before Hydra's multi-line report.
    Skipped when the user adds their own config search path."""
    if any(a.startswith(("hydra.searchpath", "+hydra.searchpath")) for a in args):
        return
    from importlib.resources import files

    conf = files("conf")
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.lstrip("+~").split("=", 1)
        if "." in key or "/" in key or not conf.joinpath(key).is_dir() or value.startswith(("glob(", "range(")):
            continue
        options = sorted(p.name[:-5] for p in conf.joinpath(key).iterdir() if p.name.endswith(".yaml"))
        for v in value.split(","):
            if v.strip() and v.strip() not in options:
                _fail(f"unknown {key} {v.strip()!r} (choose from: {', '.join(options)})")


HYDRA_FLAGS = ("-m", "--multirun", "-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "-sc",
               "--shell-completion", "-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir",
               "--resolve", "-p", "--package", "--version")


def precheck_overrides(args: list[str]) -> None:
    """Compose once with Hydra's own API so a bad override (typo'd key, bad value syntax) is reported
    in one line before Hydra's multi-line report. Only for plain single runs; sweeps and Hydra's own
    flags go straight to Hydra."""
    if any(a.split("=")[0] in HYDRA_FLAGS for a in args) or os.environ.get("HYDRA_FULL_ERROR") == "1":
        return
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    overrides = [a for a in args if not a.startswith(("hydra.", "hydra/", "+hydra", "~hydra"))]
    try:
        with initialize_config_module(config_module="conf", version_base="1.3"):
            compose("train", overrides=overrides)
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        _fail("; ".join(lines[:3]) if lines else type(e).__name__)


def _run_hydra():
    check_group_choices(sys.argv[1:])
    precheck_overrides(sys.argv[1:])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("WANDB_SILENT", "true")  # our summary says where the wandb run is
    app = _train_app()
    try:
        app()
    except SystemExit as e:
        # Hydra exits 1 on config errors (unknown group option, bad override); we promise exit 2.
        if e.code == 1:
            sys.exit(2)
        raise


if __name__ == "__main__":
    main()
