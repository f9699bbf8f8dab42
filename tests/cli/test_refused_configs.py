"""Configs that would train nothing or silently ignore a key are refused before any work: online GRPO with one
sample per prompt, and the online rounds' timing keys (data.async_lag, data.generate_every) under data=offline."""
from __future__ import annotations

from pathlib import Path

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


def test_could_not_find_lists_every_option():
    from humanline_cli.config import compose_train

    with pytest.raises(UserError) as e:
        compose_train(["experiment=no_such_exp"])
    msg = str(e.value)
    assert msg.startswith("In 'train': Could not find 'experiment/no_such_exp'; Available options in 'experiment': "
                          "laptop_arithmetic, laptop_async, ")
    listed = msg.split("Available options in 'experiment': ")[1].split(", ")
    import conf

    here = Path(conf.__file__).parent / "experiment"
    assert listed == sorted(p.stem for p in here.glob("*.yaml"))  # every option, in order
    assert "\n" not in msg and "search path" not in msg


@pytest.mark.parametrize("override, msg", [
    ("hydra.rn.dir=x", "config key 'hydra.rn': Key 'rn' not in 'HydraConf'"),
    ("hydra.job.chdir=maybe", "config key 'hydra.job.chdir': Value 'maybe' is not a valid bool (type str)"),
])
def test_a_mistyped_hydra_override_is_one_line(override, msg, capsys):
    from humanline_cli.cli.overrides import precheck_overrides

    with pytest.raises(SystemExit) as e:
        precheck_overrides([override])
    assert e.value.code == 2 and capsys.readouterr().err == f"humanline: error: {msg}\n"
