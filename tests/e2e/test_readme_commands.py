"""Every `humanline` command in README.md's bash code blocks runs as written, in order, in one folder (a later
command reads what an earlier one wrote: `runs/sweep`, `runs/kto_hl`), with fewer steps and evaluation prompts
added (and the bundled world built small, SmolLM2's steps made of a few short samples). A command added to those
blocks is tested without anyone having to remember it. The setup commands (`python3 -m venv ... just setup ...`)
are what CI itself runs. The GPU and SLURM commands of "Scaling up" are inline code, validated at every sweep
point by tests/config/test_paper_commands.py."""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from tests.helpers.cli import SMOLLM2, TIMEOUT, TINY_WORLD, run_cli

README = Path(__file__).resolve().parents[2] / "README.md"

# what the test adds to a command, by subcommand: fewer steps, fewer evaluation prompts, a small world
TRAIN_CAPS = ["train.steps=2", "train.log_every=1", "eval.n_prompts=8", "threads=1", *TINY_WORLD]
# SmolLM2's online step: 2 groups of 2 samples of at most 8 tokens instead of 32 groups of 8 (minutes a step here)
SMOLLM2_CAPS = ["train.steps=1", "train.batch_size=2", "data.prompts_per_round=2", "data.n=2", "data.max_new_tokens=8",
                "eval.n_prompts=2", "train.max_skipped_fraction=1.0", "train.save_model=false"]
CAPS = {"train": TRAIN_CAPS, "eval": ["eval.n_prompts=8"], "report": [],
        "sample": ["data.limit=4", "data.n=2", "data.max_new_tokens=8"]}


def readme_commands(text: str) -> list[str]:
    """The `humanline ...` lines of the bash code blocks, continuation lines joined, comments dropped."""
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words and words[0] == "humanline":
                cmds.append(shlex.join(words))
    return cmds


def with_caps(cmd: str) -> list[str]:
    """The command's arguments after `humanline`, with the caps its subcommand takes (a key the command sets
    itself is left as written)."""
    args = shlex.split(cmd)[1:]
    caps = list(CAPS[args[0]])
    if "model=smollm2" in args:
        caps = [*SMOLLM2, *SMOLLM2_CAPS] if args[0] == "train" else [*SMOLLM2, *caps]
    if args[0] == "train" and not any(a.startswith(("-m", "hydra.run.dir", "hydra.sweep.dir")) for a in args):
        caps.append("hydra.run.dir=runs/run_{n}")  # a run dir of its own: two runs a second apart share none
    own = {a.split("=", 1)[0].lstrip("+") for a in args if "=" in a}
    return [*args, *(c for c in caps if c.split("=", 1)[0] not in own)]


def test_the_readme_lists_runnable_commands():
    cmds = readme_commands(README.read_text())
    subcommands = [shlex.split(c)[1] for c in cmds]
    assert {"train", "report", "eval", "sample"} <= set(subcommands), subcommands
    assert any("model=smollm2" in c and "sampler=vllm" in c for c in cmds)  # the real-model command
    # the parser: continuation lines joined, comments dropped
    text = "```bash\nhumanline train a=1 \\\n    b=2   # note\nls\n```\n"
    assert readme_commands(text) == ["humanline train a=1 b=2"]
    assert with_caps("humanline train -m x=1,2 train.steps=5")[:3] == ["train", "-m", "x=1,2"]
    assert "train.steps=2" not in with_caps("humanline train train.steps=5")


@pytest.mark.slow
def test_every_readme_command_runs_as_written(tmp_path, cache_dir, smollm2):
    ran, real = [], []
    for n, cmd in enumerate(readme_commands(README.read_text())):
        args = [a.replace("{n}", str(n)) for a in with_caps(cmd)]
        r = run_cli(args, tmp_path, env_extra={"VLLM_CPU_KVCACHE_SPACE": "1"}, timeout=TIMEOUT)
        assert r.returncode == 0, f"{cmd}\n{r.stderr[-3000:]}"
        ran.append(args[0])
        if args[0] == "train" and "sampler=vllm" in args and "model=smollm2" in args:
            real.append(tmp_path / "runs" / f"run_{n}")
    # the real model's online GRPO with vLLM and humanline trained its step (GRPO trains on every group)
    assert real and all([json.loads(x)["step"] for x in (d / "metrics.jsonl").read_text().splitlines()
                         if "loss" in json.loads(x)] == [1] for d in real)
    # what the commands wrote: the sweep's six runs, its report, the evaluation against the start
    summaries = [json.loads(p.read_text()) for p in (tmp_path / "runs" / "sweep").glob("*/summary.json")]
    assert sorted((s["objective"], s["humanline"]) for s in summaries) == sorted(
        (o, h) for o in ("dpo", "kto", "grpo") for h in (True, False))
    assert all(s["status"] == "complete" for s in summaries)
    rows = (tmp_path / "runs" / "sweep" / "report.csv").read_text().splitlines()
    assert len(rows) == 1 + 6, rows  # a header and one row per (objective, humanline) cell
    assert (tmp_path / "runs" / "kto_hl" / "summary.json").is_file()
    assert (tmp_path / "runs" / "smollm2_samples" / "card.json").is_file()
    assert ran.count("train") >= 8
