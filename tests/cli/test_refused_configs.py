"""Configs that would train nothing or silently ignore a key are refused before any work: online GRPO with one
sample per prompt, and the online rounds' timing keys (data.async_lag, data.generate_every) under data=offline."""
from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module

from humanline_cli.config import resolve
from humanline_cli.errors import UserError
from tests.helpers.cli import run_cli


def _validate(overrides: list[str]):
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return resolve(compose("train", overrides=overrides))


def test_grpo_online_needs_two_samples_per_prompt():
    with pytest.raises(UserError) as e:
        _validate(["objective=grpo", "data=online", "data.n=1"])
    assert str(e.value) == ("objective=grpo needs data.n >= 2 samples per prompt, got data.n=1 (a group of one has no "
                            "reward spread: every advantage is 0 and nothing trains)")
    assert _validate(["objective=grpo", "data=online", "data.n=2"]).data_cfg.n == 2
    assert _validate(["objective=dpo", "data=online", "data.n=1"]).data_cfg.n == 1  # max_skipped_fraction catches it


@pytest.mark.parametrize("key,value", [("async_lag", 1), ("generate_every", 4)])
def test_online_round_keys_are_refused_offline(key, value):
    with pytest.raises(UserError) as e:
        _validate([f"data.{key}={value}"])  # data=offline is the default
    assert str(e.value) == (f"data.{key}={value} needs data=online (data=offline trains on a fixed file and samples no "
                            f"rounds); drop data.{key} or set data=online")
    assert getattr(_validate(["data=online", f"data.{key}={value}"]).data_cfg, key) == value
    assert _validate([]).regime == "offline"  # unset: offline as before


def test_a_refusal_is_one_line_exit_2_through_the_cli(tmp_path):
    r = run_cli(["train", "objective=grpo", "data=online", "data.n=1", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert [ln for ln in r.stderr.splitlines() if ln.strip()] == [
        "humanline: error: objective=grpo needs data.n >= 2 samples per prompt, got data.n=1 (a group of one has no "
        "reward spread: every advantage is 0 and nothing trains)"]
    assert not (tmp_path / "run" / "resolved_config.json").exists()
