"""Experiment files (whole studies) compose and validate at every sweep point; launcher presets
compose; re-running a multirun skips jobs whose run dir already holds a complete summary.json."""
from __future__ import annotations

import itertools
import json
import math
from importlib.resources import files
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from humanline_cli.config import resolve
from tests.helpers.cli import FAST, TINY_WORLD, run_cli

EXPERIMENTS = sorted(p.name[:-5] for p in files("conf").joinpath("experiment").iterdir() if p.name.endswith(".yaml"))


def _compose(overrides, hydra=False):
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose("train", overrides=overrides, return_hydra_config=hydra)


def _sweep_points(name):
    cfg = _compose([f"experiment={name}"], hydra=True)
    params = OmegaConf.to_container(cfg.hydra.sweeper.params)
    keys = list(params)
    parser = OverridesParser.create()  # Hydra's own grammar: a sweep value may hold commas inside {...}
    overrides = [parser.parse_override(f"{k}={params[k]}") for k in keys]
    values = [list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]
              for o in overrides]
    return cfg, [[f"{k}={v}" for k, v in zip(keys, combo)] for combo in itertools.product(*values)]


def test_the_documented_studies_exist():
    assert {"laptop_arithmetic", "laptop_preference", "paper_instruction_following", "paper_math",
            "paper_math_pairs", "laptop_paper_regimes"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_sweep_point_composes_and_validates(name):
    cfg, points = _sweep_points(name)
    assert cfg.hydra.sweep.dir == f"runs/experiments/{name}"
    seen = set()
    # a point's seed reaches the run only as the integer `seed`: the points that differ in it alone compose
    # alike, so each other combination composes once (Hydra's compose takes ~0.2 s a point)
    for point in points:
        assert all(int(v.split("=", 1)[1]) >= 0 for v in point if v.startswith("seed="))
    for point in dict.fromkeys(tuple(v for v in p if not v.startswith("seed=")) for p in points):
        c = _compose([f"experiment={name}", *point])
        OmegaConf.to_container(c, resolve=True)
        spec = resolve(c)
        seen.add((spec.objective, spec.regime, spec.humanline_on))
    # the paper grid: 3 objectives x {offline, online} x humanline on/off; the regime study compares
    # humanline-offline regimes with offline and online baselines (no humanline-online)
    grid = {(o, d, h) for o in ("dpo", "kto", "grpo") for d in ("offline", "online") for h in (True, False)}
    if name == "laptop_regimes":
        grid = {(o, d, h) for o, d, h in grid if not (d == "online" and h)}
    if name == "paper_math":  # the authors' GRPO recipe: online, stale rounds plain and humanline
        grid = {("grpo", "online", False), ("grpo", "online", True)}
    if name == "laptop_async":  # asynchronous online rounds: online only, 4 lags, 3 seeds
        grid = {(o, "online", h) for o in ("dpo", "kto", "grpo") for h in (True, False)}
        assert len(points) == cfg.regime_study_size == 3 * 4 * 2 * 3
        assert {p[1] for p in points} == {f"data.async_lag={k}" for k in (0, 1, 2, 4)}
        assert cfg.hydra.launcher.n_jobs == 1  # a job is already two processes: timing needs the cores
    if name == "laptop_speed_check":  # the cost model's check: GRPO online, stale-16/64, async lag 1, 5 seeds
        grid = {("grpo", "online", False)}
        assert len(points) == cfg.regime_study_size == 4 * 5 and cfg.hydra.launcher.n_jobs == 1
        assert [p[1] for p in points[:4]] == [f"regime={r}" for r in ("online", "stale16", "stale64", "async1")]
    if name == "smollm2_demo":  # the real model: online humanline, stale-16 plain and humanline, 2 seeds, seed-major
        grid = {("grpo", "online", False), ("grpo", "online", True)}
        assert len(points) == cfg.regime_study_size == 3 * 2
        assert points[:3] == [["seed=0", f"regime={r}"] for r in ("hl_online", "stale16", "hl_stale16_sync1_lo1")]
        resolve(_compose(["experiment=smollm2_demo"]))  # `train -m` validates the sweep's base before any point
        c = resolve(_compose(["experiment=smollm2_demo", "regime=stale16"]))
        # one stale round serves the whole run: 16 steps x 4 groups = 64 prompts, every train prompt once
        shape = (c.train.steps, c.train.batch_size, c.data_cfg.generate_every, c.data_cfg.prompts_per_round)
        assert shape == (16, 4, 16, 64)
        assert cfg.task.generator.n_train == 64 and cfg.task.generator.n_eval == cfg.eval.n_prompts == 86
    if name == "smollm2_pilot":  # one seed outside the study's, plain online against plain stale16
        grid = {("grpo", "online", False)}
        assert points == [["seed=100", "regime=online"], ["seed=100", "regime=stale16"]]
        assert len(points) == cfg.regime_study_size
        assert cfg.task.generator.instruction == "Answer with the number only."
    if name == "smollm2_study":  # pre-registered: 4 regimes x seeds 0-4, seed-major, at pilot 2's setting
        grid = {("grpo", "online", False), ("grpo", "online", True)}
        regimes = ("stale16", "hl_stale16_sync1_lo1", "online", "hl_online")
        assert points == [[f"seed={s}", f"regime={r}"] for s in range(5) for r in regimes]
        assert len(points) == cfg.regime_study_size
        pilot = _compose(["experiment=smollm2_pilot"])
        for key in ("task.generator", "data", "eval"):  # the pilot's setting, but lr 3e-5 (pilot 2)
            assert OmegaConf.select(cfg, key) == OmegaConf.select(pilot, key)
        assert cfg.train.lr == 3e-5 and {**cfg.train, "lr": 0} == {**pilot.train, "lr": 0}
    if name == "smollm2_pairs":  # DPO and KTO on SmolLM2's own best-vs-worst samples, the study's setting
        grid = {(o, "online", h) for o in ("dpo", "kto") for h in (True, False)}
        regimes = ("online", "stale16", "hl_stale16_sync1_lo1")
        assert points == [[f"seed={s}", f"objective={o}", f"regime={r}"]
                          for s in range(3) for o in ("dpo", "kto") for r in regimes]
        assert len(points) == cfg.regime_study_size
        study = _compose(["experiment=smollm2_study"])
        assert cfg.task.generator == study.task.generator and cfg.eval == study.eval
        assert cfg.train.lr == study.train.lr
        for o, prompts in (("dpo", 64), ("kto", 32)):  # 10 steps x 4 units fit in one stale16 generation
            c = resolve(_compose(["experiment=smollm2_pairs", f"objective={o}", "regime=stale16"]))
            assert (c.train.steps, c.train.batch_size, c.data_cfg.prompts_per_round) == (10, 4, prompts)
    if name.startswith("smollm2_fair_"):  # GRPO online and stale_once, humanline on both in the study
        grid = {("grpo", "online", False)} | ({("grpo", "online", True)} if name.endswith("study") else set())
    if name == "smollm2_precision_check":  # plain online GRPO in two precisions
        grid = {("grpo", "online", False)}
    if name.startswith("laptop_pilot_headroom") or name.startswith("laptop_headroom"):  # GRPO, stale rounds
        grid = {("grpo", "online", False), ("grpo", "online", True)}
    if name == "laptop_headroom_frontier_sync":  # the frontier below K=16 with humanline syncing once per round
        assert points == [[f"seed={s}", f"data.generate_every={k}", f"humanline={h}"]
                          for s in (1, 2, 3) for k in (1, 2, 4, 8) for h in ("False", "True")]
        assert len(points) == cfg.regime_study_size
        resolve(_compose([f"experiment={name}"]))  # `train -m` validates the sweep's base before any point
        frontier = _compose(["experiment=laptop_headroom_frontier"])
        for key in ("train", "task", "eval", "threads"):  # the frontier's setting
            assert OmegaConf.select(cfg, key) == OmegaConf.select(frontier, key)
        for point in points:
            spec = resolve(_compose([f"experiment={name}", *point]))
            k = spec.data_cfg.generate_every
            assert spec.humanline.sync_every == k == min(16, k) and type(spec.humanline.sync_every) is int
            assert (spec.humanline.log_eps_P, spec.humanline.log_eps_R) == (-1.5, 1.5)
            assert spec.humanline.sync == spec.humanline.clamp == spec.humanline_on
    if name == "laptop_headroom_pairs":  # the study's regimes with DPO and KTO
        grid = {(o, "online", h) for o in ("dpo", "kto") for h in (True, False)}
    if name == "laptop_pilot_short":  # online and stale64 (stale rounds are online data), no humanline
        grid = {("grpo", "online", False)}
    if name == "laptop_corrections_frontier":  # GRPO stale-K rounds x corrections (details: test_corrections_experiments)
        grid = {("grpo", "online", False), ("grpo", "online", True)}
    if name == "laptop_corrections_async":  # the frontier's GRPO setting, asynchronous rounds x corrections
        grid = {("grpo", "online", False), ("grpo", "online", True)}
    if name == "laptop_corrections_frontier_pairs":  # DPO/KTO at K 1 and 64 x none, humanline, trdpo
        grid = {(o, "online", h) for o in ("dpo", "kto") for h in (True, False)}
    if name == "smollm2_sentiment":  # exploratory: GRPO online, plain and humanline, the start's KL and verdict
        assert points == [["seed=0", f"regime={r}"] for r in ("online", "hl_online")] and len(points) == 2
        assert (cfg.task.name, cfg.eval.kl_to_start, cfg.eval.model_judge) == ("chat_sentiment", True, True)
        grid = {("grpo", "online", False), ("grpo", "online", True)}
    if name == "smollm2_sentiment_pairs":  # exploratory, seed 0: DPO and KTO on the start's best-vs-worst replies
        grid = {(o, "online", h) for o in ("dpo", "kto") for h in (True, False)}
        regimes = ("online", "stale16", "hl_stale16_sync1_lo1")
        assert points == [["seed=0", f"objective={o}", f"regime={r}"] for o in ("dpo", "kto") for r in regimes]
        assert len(points) == cfg.regime_study_size == 6
        sentiment = _compose(["experiment=smollm2_sentiment"])
        assert cfg.task == sentiment.task and cfg.model == sentiment.model and cfg.threads == 1
        assert {**cfg.eval, "every": 0} == {**sentiment.eval, "every": 0} and cfg.eval.every == 6
        assert (cfg.eval.kl_to_start, cfg.eval.model_judge) == (True, True)
        for key in ("n", "max_new_tokens", "temperature", "prompts_per_round"):
            assert cfg.data[key] == sentiment.data[key], key
        assert cfg.train.lr == sentiment.train.lr
        for o, prompts in (("dpo", 64), ("kto", 32)):  # 12 steps x 4 units come from one stale16 generation
            c = resolve(_compose(["experiment=smollm2_sentiment_pairs", f"objective={o}", "regime=stale16"]))
            assert (c.train.steps, c.train.batch_size, c.data_cfg.prompts_per_round) == (12, 4, prompts)
            assert c.data_cfg.generate_every == 16 > c.train.steps and prompts <= c.task_cfg.generator.n_train == 120
            assert c.data_cfg.min_gap == 0.01  # best vs worst by VADER, as online rounds pair
    if name == "laptop_one_pass":  # online, plain offline and humanline offline, DPO and KTO
        grid = {(o, d, h) for o in ("dpo", "kto") for d, h in (("online", False), ("offline", False),
                                                               ("offline", True))}
    assert seen == grid


def test_one_pass_study_trains_one_pass_over_the_self_sampled_groups():
    cfg, points = _sweep_points("laptop_one_pass")
    assert len(points) == cfg.regime_study_size == 3 * 2 * 2 * 3
    assert cfg.hydra.launcher._target_.endswith("BasicLauncher")  # one run at a time
    # seeds outer: an interrupted sweep keeps whole seeds, each with both learning rates
    assert [p[0] for p in points[:12]] == ["seed=1"] * 12 and [p[1] for p in points[:12]] == \
        ["train.lr=1e-06"] * 6 + ["train.lr=3e-06"] * 6
    specs = [resolve(_compose(["experiment=laptop_one_pass", *p])) for p in points]
    assert {s.seed for s in specs} == {1, 2, 3} and sorted({s.train.lr for s in specs}) == [1e-6, 3e-6]
    # the built world's offline_groups.jsonl: 3,699 of its 4,096 prompts have 8 samples that differ in score
    # (docs/results.md); one pass is ceil(3699 / 32) DPO steps = ceil(2 * 3699 / 64) KTO steps = 116
    for s in specs:
        assert s.train.steps == -(-3699 * (2 if s.objective == "kto" else 1) // s.train.batch_size) == 116
        assert (s.eval_cfg.every, s.eval_cfg.n_prompts, s.eval_cfg.greedy, s.threads) == (58, 256, True, 1)
        assert s.task_cfg.world["offline"]["source"] == "policy" and s.task_cfg.world["offline"]["n_per_prompt"] == 8
        assert s.data_cfg.min_gap == 0.01  # offline pairs are built as online rounds build theirs
    offline = [s for s in specs if s.regime == "offline"]
    online = [s for s in specs if s.regime == "online"]
    assert len(offline) == 24 and all(s.data_cfg.path == "world://offline_groups.jsonl" for s in offline)
    assert sum(s.humanline_on for s in offline) == 12 and not any(s.humanline_on for s in online)
    assert all(s.data_cfg.prompts == "world://prompts_train.jsonl" for s in online)  # the offline set's prompts
    hl = [s for s in specs if s.humanline_on]
    assert all((s.humanline.sync_every, s.humanline.log_eps_P, s.humanline.log_eps_R) == (1, -1.0, 1.5) for s in hl)


def test_paper_studies_use_the_paper_settings():
    c = resolve(_compose(["experiment=paper_instruction_following", "objective=kto", "humanline=true"]))
    assert c.train.lr == 5e-6 and c.train.batch_size == 64 and c.train.warmup_ratio == 0.1
    assert c.humanline.clamp and c.humanline.sync and c.humanline.log_eps_P == -1.0 and c.humanline.log_eps_R == 1.5
    cfg = _compose(["experiment=paper_instruction_following", "data=online"])
    assert cfg.model.name_or_path == "meta-llama/Meta-Llama-3-8B-Instruct"
    assert cfg.task.offline.path == "princeton-nlp/llama3-ultrafeedback-armorm"
    assert (cfg.data.n, cfg.data.temperature, cfg.data.top_p, cfg.data.min_gap) == (8, 0.7, 0.95, 0.01)
    assert cfg.sampler.name == "vllm" and cfg.backend.name == "cuda"
    m = _compose(["experiment=paper_math_pairs"])
    assert m.task.judge.kind == "verifier" and resolve(m).data_cfg.columns["instruction"] == "prompt"


@pytest.mark.parametrize("launcher,target", [("local", "JoblibLauncher"), ("slurm", "SlurmLauncher")])
def test_launcher_presets_compose(launcher, target):
    cfg = _compose([f"hydra/launcher={launcher}"], hydra=True)
    assert cfg.hydra.launcher._target_.endswith(target)
    if launcher == "local":
        assert cfg.hydra.launcher.n_jobs == 2
    else:
        assert cfg.hydra.launcher.gpus_per_node == 1


def test_rerunning_a_sweep_skips_complete_runs(cache_dir, tmp_path):
    args = ["train", "-m", "objective=dpo,kto", *TINY_WORLD, *FAST, "train.save_model=false",
            f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    first = run_cli(args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    summaries = sorted((tmp_path / "sweep").glob("*/summary.json"))
    assert len(summaries) == 2
    # one run "crashed": its summary is gone; the re-run must redo it and skip the other
    stamp = summaries[0].stat().st_mtime_ns
    summaries[1].unlink()
    second = run_cli(args, cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    assert second.stderr.count("already complete") == 1
    assert summaries[0].stat().st_mtime_ns == stamp
    assert json.loads(summaries[1].read_text())["status"] == "complete"


FAIR_REGIMES = ("online", "hl_online", "stale_once", "hl_stale_once_sync1_lo1", "hl_stale_once_sync16_lo15",
                "hl_stale_once_sync1_open")


def test_fair_smollm2_pilot_and_study_are_registered_as_results_md_says():
    from humanline_cli.lab.pilot_check import NEEDED, cells, decide
    from humanline_cli.lab.power import tost_seeds
    from humanline_cli.report.study_csv import read_table

    pilot, pilot_points = _sweep_points("smollm2_fair_pilot")
    assert pilot_points == [[f"seed={s}", f"train.lr={lr}", f"regime={r}"] for s in (100, 101, 102)
                            for lr in ("3e-06", "1e-05", "3e-05") for r in ("online", "stale_once")]
    assert len(pilot_points) == pilot.regime_study_size == 18
    study, points = _sweep_points("smollm2_fair_study")
    # the pilot's rule on its committed CSV gives the study's lr and seed count: lr 1e-5; online - stale_once at it
    # 0.46, 0.545, 0.2775 greedy on seeds 100-102, SD 0.1367, so 66 seeds for 80% power of the TOST at margin 0.05
    pilot_csv = Path(str(files("humanline_cli").joinpath("docs", "studies", "smollm2_fair_pilot.csv")))
    rule = decide(cells(read_table(pilot_csv, NEEDED)), [3e-6, 1e-5, 3e-5],
                  [100, 101, 102])
    assert rule["verdict"].startswith("pass: ") and rule["tuned_lr"] == study.train.lr == 1e-5
    diffs = (0.46, 0.545, 0.2775)
    assert rule["check"]["greedy"]["diffs"] == pytest.approx(diffs, abs=1e-12)
    sd = math.sqrt(sum((d - sum(diffs) / 3) ** 2 for d in diffs) / 2)
    assert rule["sd"] == pytest.approx(sd, abs=1e-12) and sd == pytest.approx(0.13668, abs=1e-5)
    assert rule["seeds_needed"] == tost_seeds(max(sd, 0.06), 0.05) == 66
    assert points == [[f"seed={s}", f"regime={r}"] for s in range(66) for r in FAIR_REGIMES]
    # the study's decision reads the regimes and seeds it runs
    from humanline_cli.lab import study_check
    assert (FAIR_REGIMES, tuple(range(66))) == (study_check.REGIMES, study_check.SEEDS)
    assert FAIR_REGIMES[3:] == study_check.HUMANLINE and FAIR_REGIMES[::2][:2] == (study_check.ONLINE, study_check.STALE)
    assert len(points) == study.regime_study_size == 396
    assert not {100, 101, 102} & set(range(66))  # pilot seeds are never study seeds
    for key in ("task", "data", "eval", "model", "objective", "threads"):  # the pilot's setting
        assert OmegaConf.select(study, key) == OmegaConf.select(pilot, key), key
    assert {**study.train, "lr": 0} == {**pilot.train, "lr": 0}
    # 400 held-out prompts of the three-digit + one-digit pool without a carry (start 0.3075 greedy, measured before
    # any pilot run), evaluated every 8 of 48 steps
    g = study.task.generator
    assert (g.digits, g.digits_b, g.op, g.carry, g.instruction) == (3, 1, "add", False, "Answer with the number only.")
    assert (study.task.generator.n_eval, study.eval.n_prompts, study.eval.every, study.train.steps) == (400, 400, 8, 48)
    specs = {r: resolve(_compose(["experiment=smollm2_fair_study", f"regime={r}"]))
             for r in FAIR_REGIMES}
    for r in ("stale_once", *FAIR_REGIMES[3:]):  # one generation of the starting policy's samples serves the run
        c = specs[r]
        assert c.data_cfg.generate_every == c.train.steps == 48 and c.data_cfg.prompts_per_round == 48 * 4 <= 480
    hl = {r: specs[r].humanline for r in FAIR_REGIMES}
    assert (hl["hl_stale_once_sync1_lo1"].sync_every, hl["hl_stale_once_sync1_lo1"].log_eps_P) == (1, -1.0)
    authors = hl["hl_stale_once_sync16_lo15"]  # the authors' math recipe: its sync fires at steps 16 and 32
    assert (authors.sync_every, authors.log_eps_P, authors.log_eps_R, authors.clamp) == (16, -1.5, 1.5, True)
    assert 48 // authors.sync_every == 3
    assert (hl["hl_stale_once_sync1_open"].clamp, hl["hl_stale_once_sync1_open"].sync) == (False, True)
    assert (hl["hl_online"].clamp, hl["hl_online"].sync, hl["online"].clamp, hl["online"].sync) == (True, True, False, False)


def test_smollm2_precision_check_is_the_fair_pilots_online_setting_in_two_precisions():
    """6 runs: pilot seeds 100-102 x backend.precision fp32, auto (seed-major), plain online at lr 3e-6, the fair
    pilot's setting otherwise, each run in a dir named by its precision and seed."""
    pilot, _ = _sweep_points("smollm2_fair_pilot")
    check, points = _sweep_points("smollm2_precision_check")
    assert points == [[f"seed={s}", f"backend.precision={p}", "regime=online"] for s in (100, 101, 102)
                      for p in ("fp32", "auto")]
    assert len(points) == check.regime_study_size == 6
    for key in ("task", "data", "eval", "model", "objective", "sampler", "threads"):  # the pilot's setting
        assert OmegaConf.select(check, key) == OmegaConf.select(pilot, key), key
    assert {**check.train, "lr": 0} == {**pilot.train, "lr": 0} and check.train.lr == 3e-6
    assert OmegaConf.to_container(check.hydra.sweep)["subdir"] == "${backend.precision}_seed${seed}"
    specs = {p: resolve(_compose(["experiment=smollm2_precision_check", "regime=online", f"backend.precision={p}"]))
             for p in ("fp32", "auto")}
    assert {p: (s.regime, s.humanline_on, s.train.lr, s.backend_cfg.precision.value) for p, s in specs.items()} == {
        "fp32": ("online", False, 3e-6, "fp32"), "auto": ("online", False, 3e-6, "auto")}
