"""`humanline train --help` lists what a user picks: the groups of conf/ with their options, never the schema/*
groups behind them; the project's own studies (experiments and their named regimes) in one line each that points
at docs/results.md."""
from __future__ import annotations

from pathlib import Path

from tests.helpers.cli import run_cli

CONF = Path(__file__).resolve().parents[2] / "conf"


def test_train_help_lists_the_groups_a_user_picks(tmp_path):
    r = run_cli(["train", "--help"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    groups = r.stdout.split("== Groups (group=option) ==\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert "schema/" not in r.stdout
    by = dict(line.split(": ", 1) for line in groups)
    assert sorted(by) == ["backend", "correction", "data", "experiment", "judge", "model", "objective", "regime", "reward",
                          "sampler", "task"]
    assert by["correction"] == ", ".join(sorted(f.stem for f in (CONF / "correction").glob("*.yaml")))
    assert by["objective"] == ", ".join(sorted(f.stem for f in (CONF / "objective").glob("*.yaml")))
    assert by["data"] == "offline, online"
    studies = sorted(f.stem for f in (CONF / "experiment").glob("*.yaml") if not f.stem.startswith("paper_"))
    assert by["experiment"] == ("paper_instruction_following, paper_math, paper_math_pairs; and "
                                f"{len(studies)} studies of the project's own (laptop_*, smollm2_*): "
                                "humanline_cli/docs/results.md")
    assert by["regime"].startswith(f"{len(list((CONF / 'regime').glob('*.yaml')))} named regimes of those studies")
    assert "hl_stale16_sync16_lo15" not in r.stdout.split("== Config ==")[0]
    assert "== Config ==" in r.stdout and "batch_size: 32" in r.stdout  # the composed config follows
