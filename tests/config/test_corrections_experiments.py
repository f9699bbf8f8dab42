"""The registered corrections frontier (docs/results.md) composes, every point of its sweep validates, and it runs
what the registration says: GRPO at K in {1, 4, 16, 64} x {none, humanline, tis, decoupled} x seeds 1-5; DPO/KTO at
K in {1, 64} x {none, humanline, trdpo} x seeds 1-5."""
from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from pathlib import Path


def _compose(*overrides, hydra_cfg: bool = False):
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose("train", overrides=list(overrides), return_hydra_config=hydra_cfg)


def _points(cfg) -> list[list[str]]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    swept = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in cfg.hydra.sweeper.params.items()])
    values = ([f"{o.key_or_group}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override()
              else [f"{o.key_or_group}={o.get_value_element_as_str()}"] for o in swept)
    return [list(p) for p in itertools.product(*values)]


def _specs(name):
    from hydra import compose, initialize_config_module

    from humanline_cli.config import resolve

    cfg = _compose(f"experiment={name}", hydra_cfg=True)
    points = _points(cfg)
    assert len(points) == cfg.regime_study_size
    assert cfg.hydra.launcher._target_.endswith("BasicLauncher") and points[0][0] == "seed=1"  # seeds outer
    # the seeds repeat the same cells (the seed changes no check): each cell resolved once, at seed 1, counted 5 times
    assert Counter(p[0] for p in points) == {f"seed={i}": len(points) // 5 for i in range(1, 6)}
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cells = [resolve(compose("train", overrides=[f"experiment={name}", *p])) for p in points if p[0] == "seed=1"]
    return cells * 5


def test_the_grpo_frontier_is_the_registered_grid():
    specs = _specs("laptop_corrections_frontier")
    assert len(specs) == 80 and {s.objective for s in specs} == {"grpo"}
    cells = Counter((s.data_cfg.generate_every, s.correction.kind) for s in specs)
    assert cells == {(k, c): 5 for k in (1, 4, 16, 64) for c in ("none", "humanline", "tis", "decoupled")}
    assert all((s.train.steps, s.train.lr, s.eval_cfg.n_prompts, s.eval_cfg.greedy) == (64, 1e-4, 1024, True)
               for s in specs)
    assert all(s.humanline_on == (s.correction.kind == "humanline") for s in specs)
    hl = [s.humanline for s in specs if s.humanline_on]
    assert all((h.sync_every, h.log_eps_P, h.log_eps_R) == (16, -1.5, 1.5) for h in hl)
    assert {(s.correction.mode, s.correction.cap) for s in specs if s.correction.kind == "tis"} == {("token_truncate", 3.0)}
    assert {s.correction.cap for s in specs if s.correction.kind == "decoupled"} == {5.0}


def test_the_pairs_frontier_is_the_registered_grid():
    specs = _specs("laptop_corrections_frontier_pairs")
    cells = Counter((s.objective, s.data_cfg.generate_every, s.correction.kind) for s in specs)
    assert cells == {(o, k, c): 5 for o in ("dpo", "kto") for k in (1, 64) for c in ("none", "humanline", "trdpo")}
    assert {(s.correction.alpha, s.correction.tau) for s in specs if s.correction.kind == "trdpo"} == {(0.6, 8)}


def test_the_async_frontier_is_the_frontier_with_stale_samplers():
    from hydra import compose, initialize_config_module

    from humanline_cli.config import resolve

    cfg = _compose("experiment=laptop_corrections_async", hydra_cfg=True)
    points = _points(cfg)
    assert len(points) == cfg.regime_study_size == 24 and [p[0] for p in points[:8]] == ["seed=1"] * 8
    kinds = ("none", "humanline", "tis", "decoupled")
    with initialize_config_module(config_module="conf", version_base="1.3"):
        specs = [resolve(compose("train", overrides=["experiment=laptop_corrections_async", *p])) for p in points]
        # the synchronous grid's K=1 cell of each correction: the same run but for the sampler's lag
        grid = {k: resolve(compose("train", overrides=["experiment=laptop_corrections_frontier", f"correction={k}",
                                                       "data.generate_every=1"])) for k in kinds}
    cells = Counter((s.seed, s.data_cfg.async_lag, s.correction.kind) for s in specs)
    assert cells == {(seed, lag, c): 1 for seed in (1, 2, 3) for lag in (4, 16) for c in kinds}
    assert all(s.data_cfg.generate_every == 1 and s.data_cfg.async_worker.value == "inline" for s in specs)
    for s in specs:
        g = grid[s.correction.kind]
        # the knobs as the grid's; only the derived flag differs: an async round's reference is not its sampler
        assert (s.train, s.eval_cfg, s.humanline) == (g.train, g.eval_cfg, g.humanline)
        assert s.correction == dataclasses.replace(g.correction, reference_is_sampler=False)
    assert grid["none"].correction.reference_is_sampler  # synchronous K=1: the round's start sampled it
    assert cfg.hydra.sweep.subdir == "L0_none/grpo_seed0"  # L, correction, seed: a point's dir names its cell


def test_the_registration_is_in_results_md():
    text = (Path(__file__).resolve().parents[2] / "humanline_cli" / "docs" / "results.md").read_text()
    section = text[text.index("## Registered: humanline against the staleness corrections"):]
    section = section.split("\n## ")[0]
    # registered before its runs, the comparison as it was committed, its result after it
    assert "registered (528faa1), before any of its runs" in section
    primary = "> **Primary comparison:** `humanline` minus `tis` at K=64, greedy accuracy at step 64 (the last step)"
    assert section.index(primary) < section.index("**Result: the primary**")
    assert "experiment=laptop_corrections_frontier" in section and "paired t" in section


def test_a_run_dir_names_the_runs_correction():
    """The default run and sweep dirs end in the correction (humanline=true is correction=humanline)."""
    import humanline_cli.cli.train  # noqa: F401  (registers the run dirs' resolver, as `humanline train` does)

    def ends(*o):
        h = _compose("objective=grpo", "data=online", "hydra.job.num=0", *o, hydra_cfg=True).hydra
        return str(h.run.dir).rsplit("_", 2)[-2:], str(h.sweep.subdir).rsplit("_", 2)[-2:]

    assert ends() == (["online", "none"], ["online", "none"])
    assert ends("correction=humanline") == (["online", "humanline"], ["online", "humanline"])
    assert ends("humanline=true") == (["online", "humanline"], ["online", "humanline"])
    assert ends("correction=tis") == (["online", "tis"], ["online", "tis"])
