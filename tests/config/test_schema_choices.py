"""Every choice is an Enum in the schema: a wrong one is refused while the config is typed, with the full set of
valid values in the one-line message, before anything loads."""
from __future__ import annotations

import enum

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from humanline_cli import schema as S
from humanline_cli.config import compose_error, resolve
from humanline_cli.errors import UserError

CHOICES = [c for c in vars(S).values() if isinstance(c, type) and issubclass(c, enum.Enum) and c.__module__ == S.__name__]


def _refusal(overrides: list[str]) -> str:
    try:
        with initialize_config_module(config_module="conf", version_base="1.3"):
            resolve(compose("train", overrides=overrides))
    except (HydraException, OmegaConfBaseException) as e:  # typed while Hydra composes
        return compose_error(e)
    except UserError as e:
        return str(e)
    raise AssertionError(f"{overrides} was accepted")


@pytest.mark.parametrize("choice", CHOICES, ids=lambda c: c.__name__)
def test_each_member_is_named_by_its_value(choice):
    """OmegaConf takes an Enum value from the config by member NAME, and StrEnum prints the value: they agree."""
    assert [m.name for m in choice] == [m.value for m in choice]


@pytest.mark.parametrize("override,key,valid", [
    ("task.judge.kind=bogus", "task.judge.kind", "[none, world, verifier, model, reward_model, lexicon]"),
    ("task.labeller.method=bogus", "task.labeller.method", "[math, math_latex, exact, final_number]"),
    ("judge.kind=bogus", "judge.kind", "[task, llm, alpaca_eval, none]"),
    ("check_model_task=bogus", "check_model_task", "[error, warn]"),
])
def test_a_wrong_choice_names_the_key_and_every_valid_value(override, key, valid):
    line = _refusal([override])
    assert key in line and line.endswith(f"expected one of {valid}") and "\n" not in line, line


def test_async_worker_choice_is_typed():
    line = _refusal(["data=online", "data.async_lag=1", "data.async_worker=thread"])
    assert "data.async_worker" in line and line.endswith("expected one of [process, inline]"), line
