"""The typed schemas: the config reference (docs/config.md) names every key, saved configs re-validate, and
typed errors are one line through the real CLI (single runs and every sweep point)."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from humanline_cli import schema as S
from tests.helpers.cli import run_cli

README = Path(__file__).resolve().parents[2] / "humanline_cli" / "docs" / "config.md"  # the config reference


def _reference_section() -> str:
    text = README.read_text()
    start = text.index("## Config reference")
    return text[start:text.index("\n## ", start + 5)]


def test_readme_config_reference_names_every_schema_key():
    section = _reference_section()
    named = set(re.findall(r"`([^`]+)`", section))
    words = {w for n in named for w in re.split(r"[ .=,]", n)}
    missing = []
    for node, prefix in [(S.TrainConfig, "train"), (S.EvalConfig, "eval"), (S.HumanlineConfig, "hl"),
                         (S.WandbConfig, "wandb"), (S.BackendConfig, "backend"), (S.ModelConfig, "model"),
                         (S.LoraConfig, "model.lora"), (S.HFSamplerConfig, "sampler"), (S.VLLMSamplerConfig, "sampler"),
                         (S.JudgeConfig, "judge"), (S.TaskLengths, "task.lengths"), (S.ScorerConfig, "task.judge"),
                         (S.RewardConfig, "reward"), (S.RootConfig, "")]:
        for f in dataclasses.fields(node):
            if f.name in S.GROUP_SCHEMAS or f.name in ("name", "lora", "hl", "train", "eval", "wandb", "kind", "task",
                                                        "role") or f.metadata.get("hidden"):
                continue  # a hidden key (backend.profile) checks the tool itself: docs/scaling.md names it
            full = f"{prefix}.{f.name}" if prefix else f.name
            if full not in named and f.name not in words:
                missing.append(full)
    assert not missing, f"README config reference does not name: {missing}"


def test_typed_errors_are_one_line_in_runs_and_sweeps(tmp_path):
    for args, needle in [(["train.lr=abc"], "train.lr"), (["threads=abc"], "threads"),
                         (["-m", "train.steps=3,0"], "sweep point train.steps=0"),
                         (["-m", "train.lrr=1"], "train.lrr"), (["humanline=maybe"], "humanline")]:
        r = run_cli(["train", *args, f"hydra.run.dir={tmp_path}/r", f"hydra.sweep.dir={tmp_path}/s"], tmp_path)
        assert r.returncode == 2, (args, r.stderr)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("humanline: error:") and needle in lines[0], (args, lines)
        assert not (tmp_path / "s").exists()  # nothing started
