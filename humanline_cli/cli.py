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
        from .launch import launch, shared_run_dir, spawn_count

        try:
            nproc = spawn_count(cfg)
            if nproc:
                launch(cfg, run_dir, nproc)
            else:
                run_job(cfg, shared_run_dir(run_dir))
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
    rest = normalize_overrides(rest)
    if cmd == "train" and os.environ.get("RANK", "0") != "0":
        # torchrun: only rank 0's Hydra makes the run dir; the others use a throwaway one and adopt
        # rank 0's (launch.shared_run_dir)
        import tempfile

        rest += [f"hydra.run.dir={tempfile.mkdtemp(prefix='humanline-rank')}", "hydra.output_subdir=null"]
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


def normalize_overrides(args: list[str]) -> list[str]:
    """`+humanline=...` (the paper-style switch users type) sets the declared `humanline` key."""
    return [a[1:] if a.startswith("+humanline=") else a for a in args]


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


HYDRA_FLAGS = ("-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "-sc",
               "--shell-completion", "-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir",
               "--resolve", "-p", "--package", "--version")


def sweep_points(overrides: list[str]) -> list[tuple[str, list[str]]]:
    """The configs a pre-check composes: the first value of every sweep, then each other value of
    each swept key with the rest at their first value (linear in the sweep size, not a product).
    Returns (label, overrides) pairs; the label names the sweep point for error messages."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType

    parsed = OverridesParser.create().parse_overrides(overrides)
    options: list[list[str]] = []
    for o in parsed:
        if o.is_sweep_override() and o.value_type != ValueType.GLOB_CHOICE_SWEEP:
            options.append([f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()])
        elif o.is_sweep_override():
            continue  # glob sweeps need Hydra's config loader; Hydra checks them itself
        else:
            options.append([o.input_line])
    base = [vals[0] for vals in options]
    points = [("", base)]
    for i, vals in enumerate(options):
        for v in vals[1:]:
            points.append((v, base[:i] + [v] + base[i + 1:]))
    return points


def precheck_overrides(args: list[str]) -> None:
    """Compose (and validate) with Hydra's own API before Hydra runs, so a bad override (typo'd key,
    wrong type, bad value in any sweep point) is reported in one line and nothing starts. Hydra's
    own flags (--help, --cfg, ...) go straight to Hydra."""
    if any(a.split("=")[0] in HYDRA_FLAGS for a in args) or os.environ.get("HYDRA_FULL_ERROR") == "1":
        return
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from .config import compose_error, validate
    from .errors import UserError

    overrides = [a for a in args if not a.startswith("-")]
    keep = [a for a in overrides if not a.startswith(("hydra.", "hydra/", "+hydra", "~hydra"))
            or a.startswith(("hydra.searchpath", "+hydra.searchpath"))]
    keys = [a.split("=", 1)[0].lstrip("+~") for a in overrides if "=" in a]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        _fail(f"override {twice[0]!r} given more than once")
    try:
        points = sweep_points(keep)
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        _fail(compose_error(e))
    with initialize_config_module(config_module="conf", version_base="1.3"):
        for label, point in points:
            where = f"sweep point {label}: " if label else ""
            try:
                validate(compose("train", overrides=point))
            except UserError as e:
                _fail(f"{where}{e}")
            except (HydraException, OmegaConfBaseException, ValueError) as e:
                _fail(f"{where}{compose_error(e)}")


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
