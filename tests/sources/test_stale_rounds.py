"""Stale on-policy rounds: data.generate_every=K sizes each online round to serve K optimizer
steps (the authors' math "offline": one generation per 64 steps). K=1 is online with a round per step, exactly;
K>1 reuses one generation for K steps; reports call the family stale-K and pair it with online and humanline."""
from __future__ import annotations

import csv
import json

import pytest
from safetensors.torch import load_file

from humanline_cli.config import round_prompts
from tests.helpers.cli import FAST, TINY_WORLD, run_cli


def test_round_prompts_fill_k_steps_of_units():
    # grpo: one group per prompt; the authors' recipe: 64 steps x 32 groups = 2048 prompts
    assert round_prompts("grpo", 32, 64) == 2048
    assert round_prompts("dpo", 32, 1) == 32        # one best-vs-worst pair per prompt
    assert round_prompts("kto", 64, 16) == 512      # a desirable and an undesirable example per prompt
    assert round_prompts("kto", 7, 1) == 4          # ceil(7 / 2): never fewer units than one step needs


def _validate(*overrides):
    from hydra import compose, initialize_config_module

    from humanline_cli.config import resolve

    with initialize_config_module(config_module="conf", version_base="1.3"):
        return resolve(compose("train", overrides=["task=arithmetic", *overrides]))


def test_generate_every_sets_the_round_and_offline_refuses_it():
    from humanline_cli.errors import UserError

    spec = _validate("data=online", "objective=grpo", "data.generate_every=64")
    assert spec.data_cfg.prompts_per_round == 64 * spec.train.batch_size == 2048
    assert any("data.generate_every=64" in n for n in spec.notes)
    # an online knob: data=offline samples no rounds, so setting it there is refused (test_refused_configs.py)
    with pytest.raises(UserError, match="data.generate_every=4 needs data=online"):
        _validate("data=offline", "data.generate_every=4")
    with pytest.raises(UserError, match="data.generate_every"):
        _validate("data=online", "data.generate_every=0")


def _train(tmp_path, name, *extra):
    run = tmp_path / name
    r = run_cli(["train", *TINY_WORLD, *FAST, "objective=grpo", "data=online", "train.steps=4", "eval.n_prompts=8",
                 "data.n=4", "train.checkpoint_every=0", f"hydra.run.dir={run}", *extra], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [m for m in metrics if "loss" in m]
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    return train_rows, samples, load_file(str(run / "model" / "model.safetensors"))


def test_generate_every_1_is_online_and_k_reuses_one_generation(cache_dir, tmp_path):
    # K=1 vs today's online with the same round size (batch 8 groups = 8 prompts): same samples, losses, weights
    base_rows, base_samples, base_w = _train(tmp_path, "online", "data.prompts_per_round=8")
    k1_rows, k1_samples, k1_w = _train(tmp_path, "k1", "data.generate_every=1")
    assert k1_samples == base_samples and len({s["round"] for s in base_samples}) == 4
    assert [r["loss"] for r in k1_rows] == [r["loss"] for r in base_rows]
    assert base_w.keys() == k1_w.keys() and all(base_w[k].equal(k1_w[k]) for k in base_w)
    # objective.aggregation=dapo (TRL's loss_type=dapo): a round of one step divides the step's token sum by
    # that step's own completion tokens, i.e. token_mean: the same losses and bitwise the same weights
    dapo_rows, dapo_samples, dapo_w = _train(tmp_path, "k1_dapo", "data.generate_every=1", "objective.aggregation=dapo")
    assert dapo_samples == k1_samples and [r["loss"] for r in dapo_rows] == [r["loss"] for r in k1_rows]
    assert all(k1_w[k].equal(dapo_w[k]) for k in k1_w)
    assert all(r["online/round_tokens_per_step"] >= 8 * 4 for r in dapo_rows)  # 8 groups of 4, >= 1 token each
    # K=2: two generations for four steps, each of 2 x 8 prompts x 4 samples, each serving two steps
    k2_rows, k2_samples, _ = _train(tmp_path, "k2", "data.generate_every=2")
    assert [s["round"] for s in k2_samples] == [1] * 64 + [2] * 64
    assert [r["online/round"] for r in k2_rows] == [1, 1, 2, 2]


def test_report_pairs_stale_k_with_its_humanline_runs_and_online(tmp_path):
    from humanline_cli.report.aggregate import build_report
    from tests.helpers.runs import config, run_dir

    root = tmp_path / "sweep"
    acc = {"online": [0.90, 0.92, 0.88], "stale": [0.80, 0.82, 0.78], "s16": [0.89, 0.90, 0.86], "s1": [0.60, 0.62, 0.58]}
    for seed in range(3):
        run_dir(root, f"on{seed}", config(obj="grpo", regime="online", seed=seed), win=0.7, wall=100.0,
                acc=acc["online"][seed])
        stale = dict(obj="grpo", regime="online", seed=seed, data__generate_every=64)
        run_dir(root, f"stale{seed}", config(**stale), win=0.6, wall=90.0, acc=acc["stale"][seed])
        run_dir(root, f"s16_{seed}", config(**stale, humanline=True, hl__sync_every=16), win=0.6, wall=90.0,
                acc=acc["s16"][seed])
        run_dir(root, f"s1_{seed}", config(**stale, humanline=True), win=0.6, wall=90.0, acc=acc["s1"][seed])
    build_report(root)
    with open(root / "gap_closed.csv") as f:
        got = {r["set"]: float(r["gap_closed"]) for r in csv.DictReader(f)}
    # per seed (hl - stale) / (online - stale): sync 16 closes 0.9, 0.8, 0.8; sync 1 closes -2, -2, -2
    assert got == pytest.approx({"stale-64, hl.sync_every=1": -2.0, "stale-64, hl.sync_every=16": 2.5 / 3})


def test_laptop_paper_regimes_composes_and_has_the_stated_size():
    from hydra import compose, initialize_config_module

    from humanline_cli.config import resolve

    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose("train", overrides=["experiment=laptop_paper_regimes"], return_hydra_config=True)
        params = cfg.hydra.sweeper.params
        sizes = {k: len(str(v).split(",")) for k, v in params.items()}
        assert sizes == {"objective": 3, "regime": 13, "seed": 3}
        assert 3 * 13 * 3 == cfg.regime_study_size == 117
        regimes = str(params["regime"]).split(",")
        specs = {(o, r): resolve(compose("train", overrides=["experiment=laptop_paper_regimes", f"regime={r}",
                                                               f"objective={o}"]))
                 for o in ("grpo", "kto") for r in regimes}
    grpo = {r: s for (o, r), s in specs.items() if o == "grpo"}
    # every run shares one world: its offline data are the starting policy's own 8 samples per prompt
    assert all(s.task_cfg.world["offline"] == {"source": "policy", "n_per_prompt": 8, "other_sft": {}}
               for s in specs.values())
    assert all(s.eval_cfg.every == 40 and s.eval_cfg.greedy and s.threads == 1 for s in specs.values())
    assert {r for r, s in grpo.items() if s.regime == "offline"} == {"offline", "hl"}
    # online: the data=online defaults; stale K: rounds of K steps (grpo: K x 32 groups; kto: K x 64 / 2 prompts)
    assert grpo["online"].data_cfg.generate_every is None and grpo["online"].data_cfg.prompts_per_round == 64
    for k in (16, 64):
        assert grpo[f"stale{k}"].data_cfg.prompts_per_round == k * 32 and not grpo[f"stale{k}"].humanline_on
        assert specs[("kto", f"stale{k}")].data_cfg.prompts_per_round == k * 64 // 2
        for sync in (1, 16):
            for lo, band in (("lo1", -1.0), ("lo15", -1.5)):
                s = grpo[f"hl_stale{k}_sync{sync}_{lo}"]
                assert s.humanline_on and s.data_cfg.prompts_per_round == k * 32
                assert (s.humanline.sync_every, s.humanline.log_eps_P, s.humanline.log_eps_R) == (sync, band, 1.5)
    assert grpo["hl"].humanline_on and grpo["hl"].humanline.sync_every == 1


def test_regime_map_pairs_humanline_on_stale_rounds_with_the_stale_baseline(tmp_path, capsys):
    import yaml

    from humanline_cli.lab.regime_map import main
    from tests.helpers.runs import config, run_dir

    root = tmp_path / "laptop_paper_regimes"
    stale = {"regime": "online", "data__generate_every": 64}
    plan = [("online", {"regime": "online"}, [0.90, 0.92, 0.88]), ("stale64", stale, [0.80, 0.82, 0.78]),
            ("hl_stale64_sync16_lo15", {**stale, "humanline": True, "hl__sync_every": 16, "hl__log_eps_P": -1.5},
             [0.90, 0.92, 0.88]),
            ("offline", {}, [0.70, 0.70, 0.70]), ("hl", {"humanline": True}, [0.75, 0.76, 0.74])]
    for name, over, accs in plan:
        for seed, acc in enumerate(accs):
            d = run_dir(root, f"{name}/grpo_seed{seed}", config(obj="grpo", seed=seed, **over), win=0.6, wall=50.0,
                        acc=acc)
            (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"regime={name}", "objective=grpo"]))
    (root / "multirun.yaml").write_text(yaml.safe_dump(
        {"hydra": {"sweeper": {"params": {"regime": ",".join(n for n, _, _ in plan)}}}}))
    assert main(["--sweep", str(root), "--out", str(tmp_path / "map.png")]) == 0
    table = [x.split(" | ") for x in capsys.readouterr().out.splitlines() if x.startswith("| hl")]
    # hl_stale64 vs stale64 (0.80 -> online 0.90): closes 100%; hl vs offline: (0.05, 0.06, 0.04) / 0.2 each
    assert [r[0] for r in table] == ["| hl_stale64_sync16_lo15 (vs stale64, online)", "| hl"]
    assert table[0][3:6] == ["0.800", "0.900", "0.900"] and table[1][3:6] == ["0.700", "0.900", "0.750"]


def test_paper_math_is_the_authors_recipe():
    from hydra import compose, initialize_config_module

    from humanline_cli.config import resolve

    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose("train", overrides=["experiment=paper_math"], return_hydra_config=True)
        assert str(cfg.hydra.sweeper.params.regime).split(",") == ["online", "stale64", "hl_stale64_sync16_lo15"]
        s = {r: resolve(compose("train", overrides=["experiment=paper_math", f"regime={r}"]))
             for r in ("online", "stale64", "hl_stale64_sync16_lo15")}
    on, stale, hl = s["online"], s["stale64"], s["hl_stale64_sync16_lo15"]
    assert cfg.model.name_or_path == "Qwen/Qwen2.5-1.5B-Instruct" and cfg.sampler.name == "vllm"
    assert cfg.task.prompts.train == "simplescaling/openaimath" and cfg.task.prompts.eval == "HuggingFaceH4/MATH-500"
    assert on.task_cfg.prompts.columns == {"problem": "prompt", "solution": "solution"}  # verified against `answer`
    assert on.task_cfg.labeller.kind == on.task_cfg.judge.kind == "verifier" and on.eval_cfg.n_prompts == 500
    o, t = on.objective_cfg, on.train
    assert (on.objective, o.beta, o.batch_size, o.epsilon, o.std_ddof, o.std_eps) == ("grpo", 1e-4, 32, 0.2, 1, 1e-4)
    assert (t.steps, t.lr, t.warmup_ratio, t.schedule, t.weight_decay, t.micro_batch_size) == (
        1600, 1e-6, 0.1, "constant", 0.0, 1)
    assert (t.max_prompt_length, t.max_length, on.data_cfg.max_new_tokens) == (512, 2560, 2048)
    assert (on.data_cfg.n, on.data_cfg.temperature, on.data_cfg.top_p) == (8, 0.7, 1.0)
    # 32 groups a step; online: a generation every step; stale: every 64 steps; humanline: sync 16, [-1.5, 1.5]
    assert (on.data_cfg.prompts_per_round, stale.data_cfg.prompts_per_round, hl.data_cfg.prompts_per_round) == (
        32, 2048, 2048)
    assert not on.humanline_on and not stale.humanline_on and hl.humanline_on
    assert (hl.humanline.sync_every, hl.humanline.log_eps_P, hl.humanline.log_eps_R) == (16, -1.5, 1.5)
