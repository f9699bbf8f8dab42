"""The headroom pilot and the pre-registered study compose, have the sizes they state, and run what
docs/results.md pre-registers (GRPO, online / stale64 / humanline sync 16 band [-1.5, 1.5], 1,024 eval prompts)."""
from __future__ import annotations

import itertools

import pytest


def _compose(*overrides, hydra_cfg: bool = False):
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose("train", overrides=list(overrides), return_hydra_config=hydra_cfg)


def _points(cfg) -> list[list[str]]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    swept = parser.parse_overrides([f"{k}={v}" for k, v in cfg.hydra.sweeper.params.items()])
    return [list(p) for p in itertools.product(*([f"{o.key_or_group}={v}" for v in o.sweep_string_iterator()]
                                                 for o in swept))]


@pytest.mark.parametrize("name,size", [("laptop_pilot_headroom", 6), ("laptop_pilot_headroom_lr", 9),
                                       ("laptop_pilot_short", 8), ("laptop_headroom", 15),
                                       ("laptop_headroom_pairs", 18),
                                       ("laptop_headroom_frontier", 42), ("laptop_headroom_authors", 18)])
def test_headroom_experiments_compose_with_their_stated_size(name, size):
    from humanline_cli.config import resolve, round_prompts

    cfg = _compose(f"experiment={name}", hydra_cfg=True)
    points = _points(cfg)
    assert len(points) == cfg.regime_study_size == size
    assert cfg.hydra.launcher._target_.endswith("BasicLauncher")  # one run at a time
    specs = [resolve(_compose(f"experiment={name}", *p)) for p in points]
    if name == "laptop_headroom_pairs":  # DPO and KTO on the study's world and regimes, 32 steps
        assert sorted(s.objective for s in specs) == ["dpo"] * 9 + ["kto"] * 9 and {s.seed for s in specs} == {1, 2, 3}
        assert all((s.train.steps, s.train.lr, s.eval_cfg.every, s.eval_cfg.n_prompts) == (32, 1e-4, 8, 1024)
                   for s in specs)
        assert all(s.task_cfg.world["digits"] == 3 and s.task_cfg.world["format"] == "plain" for s in specs)
        hl = [s for s in specs if s.humanline_on]
        assert len(hl) == 6 and all((s.humanline.sync_every, s.humanline.log_eps_P, s.humanline.log_eps_R)
                                    == (16, -1.5, 1.5) and s.data_cfg.generate_every == 64 for s in hl)
        # a stale round's prompts: 64 steps' worth (2,048 for dpo's 32 pairs and kto's 64 examples a step), so
        # that with ties dropping about 40% of the groups its pairs still fill the 32 steps
        assert {round_prompts(s.objective, s.train.batch_size, 64) for s in specs} == {2048}
        assert [p[0] for p in points[:6]] == ["seed=1"] * 6  # seeds outer
        return
    assert all(s.objective == "grpo" and s.eval_cfg.n_prompts == 1024 and s.eval_cfg.greedy for s in specs)
    assert all(s.task_cfg.world["n_eval_prompts"] == 1024 and s.task_cfg.world["format"] == "plain" for s in specs)
    hl = [s for s in specs if s.humanline_on]
    assert all((s.humanline.sync_every, s.humanline.log_eps_P, s.humanline.log_eps_R) == (16, -1.5, 1.5) for s in hl)
    if name == "laptop_headroom_authors":  # the study's regimes at paper_math's objective and sampling settings
        paper = resolve(_compose("experiment=paper_math"))
        assert len(hl) == 6 and {s.seed for s in specs} == {1, 2, 3}
        assert sorted({s.train.lr for s in specs}) == [1e-6, 1e-4] and [p[0] for p in points[:9]] == ["train.lr=1e-06"] * 9
        for s in specs:
            assert (s.train.steps, s.task_cfg.world["digits"]) == (64, 3)
            for field in ("beta", "tempered_logps", "aggregation", "std_ddof", "std_eps"):
                assert getattr(s.objective_cfg, field) == getattr(paper.objective_cfg, field), field
            assert s.train.weight_decay == paper.train.weight_decay == 0.0
            assert s.data_cfg.temperature == paper.data_cfg.temperature == 0.7
        return
    if name == "laptop_headroom_frontier":
        assert len(hl) == 21 and {s.seed for s in specs} == {1, 2, 3}
        assert sorted({s.data_cfg.generate_every for s in specs}) == [1, 2, 4, 8, 16, 32, 64]
        # the study's setting, so that K=1 / K=64 off / K=64 on are its online / stale64 / humanline regimes
        assert all(s.task_cfg.world["digits"] == 3 and (s.train.steps, s.train.lr) == (64, 1e-4) for s in specs)
        assert all(s.train.steps % s.eval_cfg.every == 0 for s in specs)
        return
    if name == "laptop_pilot_short":  # short runs, online and stale64 only: stale64 never regenerates (T <= 64)
        assert not hl and all(s.seed == 0 and s.task_cfg.world["digits"] == 3 for s in specs)
        assert sorted((s.train.steps, s.train.lr) for s in specs) == [(40, 1e-4)] * 2 + [(40, 2e-4)] * 2 + \
            [(64, 1e-4)] * 2 + [(64, 2e-4)] * 2
        assert all(s.train.steps <= 64 and s.train.steps % s.eval_cfg.every == 0 for s in specs)
        assert sorted(str(s.data_cfg.generate_every) for s in specs) == ["64"] * 4 + ["None"] * 4
        return
    assert len(hl) == size // 3
    stale = [s for s in specs if s.data_cfg.generate_every == 64]
    assert len(stale) == 2 * size // 3  # stale64 and humanline on it; online has no generate_every
    if name == "laptop_headroom":
        assert {s.seed for s in specs} == {1, 2, 3, 4, 5}  # seed 0 was the pilot's
        assert all(s.task_cfg.world["digits"] == 3 for s in specs)
        assert points[0][0] == "seed=1" and points[2][0] == "seed=1"  # seeds outer: an interrupted sweep keeps whole seeds
        # pilot 3's kept setting: 64 steps, so stale64's one generation (generate_every=64) is never renewed,
        # evaluated at the last step
        assert all((s.train.steps, s.train.lr, s.eval_cfg.every) == (64, 1e-4, 8) for s in specs)
    elif name == "laptop_pilot_headroom_lr":  # the 3-digit world at higher lr, the same lr for every regime
        assert all(s.task_cfg.world["digits"] == 3 and s.seed == 0 for s in specs)
        assert sorted(s.train.lr for s in specs) == [3e-5] * 3 + [1e-4] * 3 + [3e-4] * 3
        assert [p[0] for p in points[:3]] == ["train.lr=3e-05"] * 3  # lr outer: one lr's regimes run together
    else:
        worlds = {(s.task_cfg.world["digits"], s.task_cfg.world["sft"]["carry_drop"]) for s in specs}
        assert worlds == {(2, 0.9), (3, 0.6)}
