"""Every `humanline train` command of the docs' "Scaling up" and "Reproducing the paper's tables" sections
(README.md and humanline_cli/docs/*.md, wherever they live), and the pinned paper-scale commands, compose and
validate with backend=cuda at every point of their sweep (validation only: no CUDA, no weights). `sampler=hf`
composes with every experiment file."""
from __future__ import annotations

import itertools
import re
import shlex
from importlib.resources import files
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from humanline_cli.cli.overrides import normalize_overrides
from humanline_cli.config import resolve
from humanline_cli.schema import GROUP_SCHEMAS

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("Scaling up", "Reproducing the paper's tables")
# the paper-scale commands users must be able to type, pinned here whatever the docs say
PINNED = [
    "humanline train -m backend=cuda backend.strategy=fsdp backend.nproc=8 experiment=paper_instruction_following",
    "humanline train -m backend=cuda backend.strategy=ddp backend.nproc=8 experiment=paper_instruction_following",
    "humanline train -m backend=cuda backend.strategy=fsdp backend.nproc=8 experiment=paper_math",
    "humanline train backend=cuda model.lora.r=16 experiment=paper_instruction_following data=online",
    "humanline train backend=cuda experiment=paper_math data=online",
    "humanline train backend=cuda backend.strategy=fsdp backend.nproc=8 experiment=paper_math data=online sampler=hf",
    # LoRA under FSDP2 (adapters on the sharded base; merged weights gathered layer by layer for vLLM)
    "humanline train -m backend=cuda backend.strategy=fsdp backend.nproc=8 model.lora.r=16 "
    "experiment=paper_instruction_following",
]
GROUPS = set(GROUP_SCHEMAS) | {"experiment", "regime"}
EXPERIMENTS = sorted(p.name[:-5] for p in files("conf").joinpath("experiment").iterdir() if p.name.endswith(".yaml"))


def _section_text(text: str, title: str) -> str | None:
    """The body of the markdown section whose heading contains `title` (up to the next heading of the
    same or a higher level)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"(#+)\s+(.*)", line)
        if m and title in m.group(2):
            level, body = len(m.group(1)), []
            for nxt in lines[i + 1:]:
                h = re.match(r"(#+)\s", nxt)
                if h and len(h.group(1)) <= level:
                    break
                body.append(nxt)
            return "\n".join(body)
    return None


def documented_commands() -> list[str]:
    docs = [ROOT / "README.md", *sorted((ROOT / "humanline_cli" / "docs").glob("*.md")), *sorted(ROOT.glob("docs/*.md"))]
    found: dict[str, list[str]] = {title: [] for title in SECTIONS}
    for path in docs:
        if not path.is_file():
            continue
        text = path.read_text()
        for title in SECTIONS:
            body = _section_text(text, title)
            if body is None:
                continue
            for cmd in re.findall(r"`([^`]+)`", body):
                if re.search(r"(^humanline train\b)|(-m humanline_cli train\b)", cmd):
                    found[title].append(cmd)
    for title, cmds in found.items():
        assert cmds, f"no `humanline train` command found in a section titled {title!r} (README.md or docs)"
    return sorted({c for cmds in found.values() for c in cmds})


def _overrides(cmd: str) -> tuple[list[str], bool]:
    """`humanline train [-m] k=v ...` (or torchrun ... -m humanline_cli train ...) -> (overrides, multirun),
    with backend=cuda unless the command names a backend; a literal `...` (more options) is dropped."""
    words = shlex.split(cmd)
    words = words[words.index("train") + 1:]
    multirun = "-m" in words or "--multirun" in words
    args = [w for w in words if w not in ("-m", "--multirun", "...")]
    if not any(a.startswith("backend=") for a in args):
        args.append("backend=cuda")
    return normalize_overrides(args), multirun


def _points(args: list[str], multirun: bool) -> list[list[str]]:
    """The sweep's points: the experiment's sweeper grid (keys the command sets itself are not swept);
    a single run without -m. Only the first seed is kept: the seed never changes what validates."""
    if not multirun:
        return [args]
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose("train", overrides=args, return_hydra_config=True)
    fixed = {a.split("=", 1)[0] for a in args}
    params = OmegaConf.to_container(cfg.hydra.sweeper.params) or {}
    axes = [[f"{k}={v}" for v in str(vals).split(",")][: 1 if k == "seed" else None]
            for k, vals in params.items() if k not in fixed]
    return [[*args, *combo] for combo in itertools.product(*axes)]


def _validate_all(cmd: str) -> int:
    """Compose once per choice of config groups (a compose costs ~1 s) and set plain keys such as
    `humanline` on a copy, as Hydra would; validate every point."""
    args, multirun = _overrides(cmd)
    points = _points(args, multirun)
    swept = len(points[0]) - len(args)
    composed = {}
    with initialize_config_module(config_module="conf", version_base="1.3"):
        for point in points:
            groups = tuple(a for a in point[len(point) - swept:] if a.split("=", 1)[0] in GROUPS)
            if groups not in composed:
                composed[groups] = compose("train", overrides=[*args, *groups])
            cfg = composed[groups].copy()
            for a in point[len(point) - swept:]:
                key, value = a.split("=", 1)
                if key not in GROUPS:
                    OmegaConf.update(cfg, key, yaml.safe_load(value))
            spec = resolve(cfg)
            assert spec.backend_cfg.device.value == "cuda", point
            for a in point[len(point) - swept:]:
                key, value = a.split("=", 1)
                if key == "humanline":
                    assert spec.humanline_on == yaml.safe_load(value)
    return len(points)


def _sweep_size(cmd: str) -> int:
    """objectives x {offline, online} x humanline on/off; experiment=paper_math (the authors' GRPO recipe, issue
    24): online, stale64 and humanline on stale64."""
    return 3 if "experiment=paper_math" in cmd.split() else 12


@pytest.mark.parametrize("cmd", documented_commands())
def test_documented_scaling_and_paper_commands_validate(cmd):
    n = _validate_all(cmd)
    # Hydra's -m after `train`, not python's `-m humanline_cli` of a torchrun line (a single run)
    if "experiment=paper_" in cmd and _overrides(cmd)[1]:
        assert n == _sweep_size(cmd)


@pytest.mark.parametrize("cmd", PINNED)
def test_pinned_paper_scale_commands_validate(cmd):
    assert _validate_all(cmd) == (_sweep_size(cmd) if " -m " in cmd else 1)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_sampler_hf_composes_with_every_experiment(name):
    """The sampler's keys live in conf/sampler/*.yaml: no experiment file sets a vLLM-only key, so
    `sampler=hf` composes (and validates, online included) with each of them."""
    # paper_math, the frontier with sync K and the smollm2 studies are online only (their stale rounds are
    # data.generate_every on online data; the chat task has no offline file)
    online_only = name in ("paper_math", "laptop_headroom_frontier_sync") or name.startswith("smollm2")
    for regime in ("online",) if online_only else ("offline", "online"):
        with initialize_config_module(config_module="conf", version_base="1.3"):
            cfg = compose("train", overrides=[f"experiment={name}", "sampler=hf", f"data={regime}"])
        spec = resolve(cfg)
        assert spec.sampler_cfg.name == "hf" and spec.regime == regime
