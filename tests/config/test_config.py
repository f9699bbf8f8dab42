"""Every config file composes and validates; bad knobs are rejected with a message naming the key."""
from __future__ import annotations

from importlib.resources import files

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from humanline_cli.cli.overrides import normalize_overrides
from humanline_cli.config import compose_error, resolve
from humanline_cli.errors import UserError

GROUPS = sorted(p.name for p in files("conf").iterdir() if p.is_dir() and not p.name.startswith("_"))


def _compose(overrides: list[str]):
    """Compose as the CLI does: `+humanline=` normalised, schema errors as one-line UserErrors."""
    with initialize_config_module(config_module="conf", version_base="1.3"):
        try:
            return compose("train", overrides=normalize_overrides(overrides), return_hydra_config=False)
        except Exception as e:
            raise UserError(compose_error(e)) from e


def _options(group: str) -> list[str]:
    return sorted(p.name[:-5] for p in files("conf").joinpath(group).iterdir() if p.name.endswith(".yaml"))


CASES = [(g, o) for g in GROUPS if g != "experiment" for o in _options(g)]


@pytest.mark.parametrize("group,option", CASES, ids=[f"{g}={o}" for g, o in CASES])
def test_every_config_file_composes_and_validates(group, option):
    extra = {("reward", "model"): ["reward.name_or_path=some/rm"],
             ("task", "custom"): ["data.path=pairs.jsonl", "task.prompts.eval=eval.jsonl"],
             ("task", "chat_arithmetic"): ["data=online"],
             ("task", "chat_sentiment"): ["data=online"],  # no offline data of their own
             # GRPO's importance-weight corrections need the sampler's log-probs: online data
             **{("correction", k): ["objective=grpo", "data=online"] for k in ("tis", "mis", "decoupled")}
             }.get((group, option), [])
    cfg = _compose([f"{group}={option}", *extra])
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    spec = resolve(cfg)
    if group not in ("data", "task", "reward", "judge", "regime", "correction"):  # regime: a _global_ package
        assert cfg[group].name == option
    if group == "correction":
        assert spec.correction.kind == option
    if group == "objective":
        assert spec.objective == option
    if group == "data":
        assert spec.regime == option


def test_defaults_are_the_documented_ones():
    cfg = _compose([])
    spec = resolve(cfg)
    assert (spec.objective, spec.regime, spec.task, spec.model) == ("dpo", "offline", "arithmetic", "tiny")
    assert cfg.backend.name == "auto" and cfg.sampler.name == "hf"
    assert not spec.humanline_on and not spec.humanline.clamp and not spec.humanline.sync
    assert spec.train.batch_size == 32 and spec.train.accumulation == 1


def test_humanline_switch_and_ablations():
    on = resolve(_compose(["+humanline=true"])).humanline
    assert on.clamp and on.sync and (on.log_eps_P, on.log_eps_R, on.sync_every) == (-1.0, 1.5, 1)
    sync_only = resolve(_compose(["+humanline=true", "hl.clamp=false"])).humanline
    assert sync_only.sync and not sync_only.clamp
    clamp_only = resolve(_compose(["+humanline=true", "hl.sync=false", "hl.sync_every=5"])).humanline
    assert clamp_only.clamp and not clamp_only.sync
    k = resolve(_compose(["+humanline=true", "hl.sync_every=4", "hl.log_eps_P=-0.5"])).humanline
    assert k.sync_every == 4 and k.log_eps_P == -0.5
    # hl knobs without +humanline=true do nothing: humanline stays off
    off = resolve(_compose(["hl.clamp=true"])).humanline
    assert not (off.clamp or off.sync)


def test_batch_size_follows_objective_and_accumulation():
    spec = resolve(_compose(["objective=kto", "train.micro_batch_size=16"]))
    assert spec.train.batch_size == 64 and spec.train.accumulation == 4


BAD = [
    (["objective.beta=-1"], "objective.beta"),
    (["train.lr=abc"], "train.lr"),
    (["train.steps=0"], "train.steps"),
    (["train.batch_size=10", "train.micro_batch_size=3"], "micro_batch_size"),
    (["train.max_prompt_length=64", "train.max_length=64"], "max_prompt_length"),
    (["+humanline=true", "hl.clamp=false", "hl.sync=false"], "turns everything off"),
    (["+humanline=true", "hl.log_eps_P=0.5"], "log_eps_P"),
    (["objective=grpo", "objective.epsilon=1.5"], "epsilon"),
    (["objective=grpo", "objective.ratio_denominator=sampler"], "needs data=online"),
    (["objective=grpo", "objective.aggregation=sum"], "objective.aggregation"),
    (["train.schedule=linear"], "train.schedule"),
    (["backend.device=tpu"], "backend.device"),
    (["+humanline=maybe"], "humanline"),
    (["train.warmup_ratio=1.5"], "warmup_ratio"),
    (["data=online", "sampler=vllm", "sampler.block_size=24"], "sampler.block_size"),
]


@pytest.mark.parametrize("overrides,needle", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_config_is_rejected_with_the_key_named(overrides, needle):
    with pytest.raises(UserError) as e:
        resolve(_compose(overrides))
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_the_humanline_spec_is_the_schema_with_the_switch_applied():
    from humanline_cli.core.humanline import HumanlineSpec
    from humanline_cli.schema import HumanlineConfig

    knobs = HumanlineConfig(clamp=False, log_eps_P=-0.5, sync_every=3)
    off, on = HumanlineSpec.from_config(False, knobs), HumanlineSpec.from_config(True, knobs)
    assert vars(off) == {"clamp": False, "sync": False, "log_eps_P": -0.5, "log_eps_R": 1.5, "sync_every": 3}
    assert vars(on) == {"clamp": False, "sync": True, "log_eps_P": -0.5, "log_eps_R": 1.5, "sync_every": 3}
    assert (off.on, on.on) == (False, True)
    # the band and the period are the schema's fields, not declared again
    assert set(HumanlineSpec.__dict__.get("__annotations__", {})) == {"clamp", "sync"}
