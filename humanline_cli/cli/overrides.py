"""Checks on `humanline train`'s overrides before Hydra composes: the paper-style `+humanline=...`, group
choices, every point of a `-m` sweep composed and validated first, and output dirs that can be created.
Each problem is one line and exit 2, before any job starts."""
from __future__ import annotations

import os
from pathlib import Path

from humanline_cli.errors import fail


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
                fail(f"unknown {key} {v.strip()!r} (choose from: {', '.join(options)})")


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

    from humanline_cli.config import compose_error, resolve
    from humanline_cli.errors import UserError

    overrides = [a for a in args if not a.startswith("-")]
    keep = [a for a in overrides if not a.startswith(("hydra.", "hydra/", "+hydra", "~hydra"))
            or a.startswith(("hydra.searchpath", "+hydra.searchpath"))]
    if sum(a.split("=", 1)[0].lstrip("+") == "humanline" for a in overrides) > 1:  # Hydra would refuse a 2nd `+`
        fail("humanline is set more than once (+humanline=true or humanline=false, not both)")
    try:
        points = sweep_points(keep)
        from hydra.core.override_parser.overrides_parser import OverridesParser

        # the hydra.* overrides too: an unquoted non-ASCII run dir is a lexer error Hydra prints in 4 lines
        OverridesParser.create().parse_overrides([a for a in overrides if a not in keep])
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        hint = ("; quote a value with spaces or non-ASCII characters: key='\"value\"'"
                if "LexerNoViableAlt" in str(e) else "")
        fail(compose_error(e).split("; See https://hydra.cc")[0] + hint)
    with initialize_config_module(config_module="conf", version_base="1.3"):
        for label, point in points:
            where = f"sweep point {label}: " if label else ""
            try:
                resolve(compose("train", overrides=point))
            except UserError as e:
                fail(f"{where}{e}")
            except (HydraException, OmegaConfBaseException, ValueError) as e:
                fail(f"{where}{compose_error(e)}")
        multirun = any(a in ("-m", "--multirun") for a in args)
        hydra_args = [a for a in overrides if a not in keep]
        problem = output_dir_problem(points[0][1] + hydra_args, multirun)
        if problem:
            fail(problem)


def hydra_key_problem(e: BaseException) -> str | None:
    """One line for a composition error that names a `hydra.*` key (a key Hydra's config lacks, a value of the wrong
    type: Hydra's own report is 7 lines without our prefix), or None. Other failures are left to Hydra itself: the
    compose API is not the app, and a launcher or sweeper override may need the app."""
    from omegaconf.errors import OmegaConfBaseException

    from humanline_cli.config import compose_error

    cur = e
    while cur is not None:
        if isinstance(cur, OmegaConfBaseException) and str(getattr(cur, "full_key", "") or "").startswith("hydra."):
            return compose_error(e)
        cur = cur.__cause__ or cur.__context__
    return None


def output_dir_problem(overrides: list[str], multirun: bool) -> str | None:
    """Why Hydra could not create the run dir (the sweep dir under -m), or a bad `hydra.*` key, or None. Checked before
    Hydra starts (Hydra's own failure there is a multi-line traceback). `${now:}` is resolved now, a
    second or so before Hydra does: only the parents matter, and they are the same. Creates nothing
    that stays (a probe dir is removed at once); an existing dir is only checked, never written."""

    from hydra import compose
    from omegaconf import OmegaConf

    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    try:  # a config that will not compose with its hydra.* overrides is Hydra's to report, but for a bad hydra.* key
        path = Path(str(OmegaConf.select(compose("train", overrides=overrides, return_hydra_config=True), key)))
    except Exception as e:
        return hydra_key_problem(e)
    path = path.absolute()
    where = f"cannot write the run dir {path}"
    try:
        return _dir_problem(path, key, where)
    except OSError as e:  # a path component over the file system's limit (255 bytes), a loop of links
        return f"{where}: {e.strerror} (set {key}=...)"


def _dir_problem(path: Path, key: str, where: str) -> str | None:
    import tempfile

    if path.exists():
        if not path.is_dir():
            return f"{where}: it is a file, not a directory (set {key}=...)"
        if not os.access(path, os.W_OK | os.X_OK):
            return f"{where}: permission denied or read-only (set {key}=...)"
        return None
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{where}: {parent} is a file, not a directory (set {key}=...)"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".humanline-probe-", dir=parent))
    except OSError as e:
        return f"{where}: cannot create directories in {parent}: {e.strerror} (set {key}=...)"
    return None
