"""correction=none|humanline|tis|mis|decoupled|trdpo: one choice, composed and checked before any work starts;
+humanline=true keeps meaning humanline (correction=humanline); combinations without a meaning are one line."""
from __future__ import annotations

import pytest

from humanline_cli.cli.overrides import normalize_overrides
from humanline_cli.config import compose_error, resolve
from humanline_cli.errors import UserError

GRPO_ONLINE = ["objective=grpo", "data=online"]


def _spec(*overrides):
    """Composed as the CLI composes (`+humanline=` normalised), then resolved."""
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="conf", version_base="1.3"):
        try:
            cfg = compose("train", overrides=normalize_overrides(list(overrides)))
        except Exception as e:
            raise UserError(compose_error(e)) from e
    return resolve(cfg)


def test_correction_humanline_is_plus_humanline_true():
    plus, group = _spec("+humanline=true").humanline, _spec("correction=humanline").humanline
    assert plus == group and group.on and group.clamp and group.sync
    # its knobs stay under hl.*
    assert _spec("correction=humanline", "hl.sync_every=4").humanline.sync_every == 4
    assert not _spec().humanline.on and _spec().correction.kind == "none"


def test_each_correction_has_its_peers_defaults():
    tis = _spec(*GRPO_ONLINE, "correction=tis").correction
    assert (tis.mode, tis.cap, tis.cap_min) == ("token_truncate", 3.0, None)
    mis = _spec(*GRPO_ONLINE, "correction=mis").correction
    assert (mis.mode, mis.cap) == ("sequence_mask", 3.0)  # TRL 1.16's default mode and cap
    dec = _spec(*GRPO_ONLINE, "correction=decoupled").correction
    assert (dec.kind, dec.mode, dec.cap) == ("decoupled", None, 5.0)
    tr = _spec("correction=trdpo").correction
    assert (tr.alpha, tr.tau) == (0.6, 512)  # TRL's ref_model_mixup_alpha, ref_model_sync_steps
    assert _spec(*GRPO_ONLINE, "correction=tis", "correction.level=sequence").correction.mode == "sequence_truncate"


def test_the_reference_holds_the_sampling_weights_only_on_synchronous_plain_rounds():
    assert _spec(*GRPO_ONLINE, "correction=tis").correction.reference_is_sampler
    assert _spec(*GRPO_ONLINE).correction.reference_is_sampler
    assert not _spec(*GRPO_ONLINE, "+humanline=true").correction.reference_is_sampler  # the sync moves it
    assert not _spec(*GRPO_ONLINE, "data.async_lag=1").correction.reference_is_sampler  # sampled rounds before
    assert not _spec("objective=grpo").correction.reference_is_sampler  # offline


@pytest.mark.parametrize("overrides,needle", [
    (["+humanline=true", *GRPO_ONLINE, "correction=tis"], "humanline=true is correction=humanline"),
    (["correction=mis"], "correction=mis has no meaning for objective=dpo"),
    (["objective=grpo", "correction=trdpo"], "correction=trdpo has no meaning for objective=grpo"),
    ([*GRPO_ONLINE, "correction=decoupled", "objective.ratio_denominator=sampler"], "drop objective.ratio_denominator"),
    ([*GRPO_ONLINE, "correction=tis", "correction.cap=0.5"], "correction.cap must be >= 1"),
    (["correction=trdpo", "correction.alpha=0"], "correction.alpha"),
    (["objective=kto", "correction=trdpo", "model.lora.r=8"], "needs full fine-tuning"),
])
def test_meaningless_combinations_are_refused(overrides, needle):
    with pytest.raises(UserError, match=needle.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        _spec(*overrides)


def test_refusal_is_one_line_exit_2(tmp_path):
    from tests.helpers.cli import run_cli

    r = run_cli(["train", "objective=grpo", "correction=trdpo", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "correction=trdpo has no meaning for objective=grpo" in lines[0]
    assert not (tmp_path / "run").exists()
