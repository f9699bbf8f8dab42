"""The science additions: greedy and sampled evaluation side by side with the arithmetic subsets, the
gap-closed computation (hand-computed) and its report section, and the regime study's sweep size."""
from __future__ import annotations

import json
import math

import pytest

from humanline_cli.report.aggregate import build_report
from humanline_cli.report.gap_closed import gap_closed_paired
from humanline_cli.world.rewards import subset
from tests.helpers.cli import FAST, TINY_WORLD, run_cli
from tests.helpers.runs import config, run_dir


def test_arithmetic_subsets_are_the_carry():
    assert subset("arithmetic", "79+81=") == "carry" and subset("arithmetic", "82+25=") == "no_carry"
    assert subset("arithmetic", "15+05=") == "carry" and subset("preference", "abc") is None


def test_summary_has_greedy_and_sampled_with_subsets(tmp_path, cache_dir):
    run = tmp_path / "run"
    r = run_cli(["train", *TINY_WORLD, *FAST, "objective=grpo", f"hydra.run.dir={run}"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    ev = json.loads((run / "summary.json").read_text())["eval"]
    assert ev["sampled"]["temperature"] == 0.7 and ev["greedy"]["temperature"] == 0.0
    assert ev["win_rate"] == ev["sampled"]["win_rate"] and ev["accuracy"] == ev["sampled"]["accuracy"]
    prompts = [json.loads(x)["prompt"] for x in (run / "eval_samples.jsonl").read_text().splitlines()]
    carry = sum(subset("arithmetic", p) == "carry" for p in prompts)
    for mode in ("sampled", "greedy"):
        subs = ev[mode]["subsets"]
        assert subs["carry"]["n"] == carry and subs["no_carry"]["n"] == len(prompts) - carry
        # the overall accuracy is the n-weighted mean of the subsets'
        both = (subs["carry"]["accuracy"] * carry + subs["no_carry"]["accuracy"] * (len(prompts) - carry)) / len(prompts)
        assert both == pytest.approx(ev[mode]["accuracy"])


def test_gap_closed_hand_computed():
    g = gap_closed_paired([0.70, 0.72, 0.68], [0.90, 0.92, 0.88], [0.80, 0.87, 0.82])
    # x = humanline - offline = 0.10, 0.15, 0.14; y = online - offline = 0.20 on every seed, so v22 = v12 = 0
    # and Fieller's quadratic b^2 R^2 - 2 a b R + a^2 - t^2 v11 = 0 has roots (a +- t sqrt(v11)) / b: the
    # t-interval of mean(x) divided by 0.2
    sd = math.sqrt((0.03**2 + 0.02**2 + 0.01**2) / 2)  # sd of x around its mean 0.13
    half = 4.302653 * sd / math.sqrt(3) / 0.2
    assert g["mean"] == pytest.approx(0.65) and g["n"] == 3
    assert (g["lo"], g["hi"]) == pytest.approx((0.65 - half, 0.65 + half), abs=1e-6)
    # a seed with no gap (online == offline) counts in the denominator; the gap's own t-interval over the two
    # seeds (0.2, 0.0) holds 0, so the ratio is unbounded
    g2 = gap_closed_paired([0.7, 0.5], [0.9, 0.5], [0.8, 0.6])
    assert g2["verdict"] == "unbounded" and g2["mean"] is None and g2["n"] == 2
    # a caller's interval replaces the t-interval only for one seed (which has none)
    g3 = gap_closed_paired([0.7, 0.5], [0.9, 0.5], [0.8, 0.6], gap_interval=(0.05, 0.15))
    assert g3["verdict"] == "unbounded"
    g4 = gap_closed_paired([0.7], [0.9], [0.8], gap_interval=(0.05, 0.15))
    assert g4["verdict"] == "gap" and g4["n"] == 1 and g4["mean"] == pytest.approx(0.5) and g4["lo"] is None


def test_report_has_the_gap_closed_section(tmp_path):
    root = tmp_path / "sweep"
    accs = {"offline": [0.70, 0.72, 0.68], "online": [0.90, 0.92, 0.88], "hl": [0.80, 0.87, 0.82]}
    for seed in range(3):
        run_dir(root, f"off{seed}", config(obj="grpo", seed=seed), win=0.6, wall=20.0, acc=accs["offline"][seed])
        run_dir(root, f"on{seed}", config(obj="grpo", regime="online", seed=seed), win=0.7, wall=100.0,
                acc=accs["online"][seed])
        run_dir(root, f"hl{seed}", config(obj="grpo", humanline=True, seed=seed), win=0.65, wall=25.0,
                acc=accs["hl"][seed])
    rep = build_report(root)
    md = rep.markdown
    assert "## Gap closed by humanline-offline" in md
    line = next(x for x in md.splitlines() if x.startswith("| arithmetic | grpo"))
    assert "| 0.700 | 0.900 | 0.830 | 65% [" in line and "| 3 | 4.00x |" in line
    # the per-family scores: sampled accuracy, mean [t-interval]: offline 0.70 +- 4.303 * 0.02 / sqrt(3)
    assert "| arithmetic | grpo | – | sampled | 0.700 [0.650, 0.750] | 0.900 [0.850, 0.950] |" in md
    rows = (root / "gap_closed.csv").read_text().splitlines()
    assert len(rows) == 2 and rows[1].split(",")[7] == "0.65"
    assert (root / "gap_closed.png").stat().st_size > 1000


def test_laptop_regimes_composes_and_has_the_stated_size():
    from hydra import compose, initialize_config_module

    from humanline_cli.config import resolve

    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose("train", overrides=["experiment=laptop_regimes"], return_hydra_config=True)
    params = cfg.hydra.sweeper.params
    sizes = {k: len(str(v).split(",")) for k, v in params.items()}
    n = 1
    for v in sizes.values():
        n *= v
    assert n == cfg.regime_study_size == 117  # the file states its size, and the sweep has it
    regimes = str(params["regime"]).split(",")
    with initialize_config_module(config_module="conf", version_base="1.3"):
        specs = {r: resolve(compose("train", overrides=["experiment=laptop_regimes", f"regime={r}"])) for r in regimes}
    assert all(s.eval_cfg.every == 40 and s.eval_cfg.greedy for s in specs.values())
    # each named regime is what its name says
    assert {r for r, s in specs.items() if s.regime == "online"} == {"online", "online_lr3e-5"}
    assert {r for r, s in specs.items() if s.humanline_on} == {r for r in regimes if r.startswith("hl")}
    assert {r for r, s in specs.items() if s.train.lr == 3e-5} == {"offline_lr3e-5", "hl_lr3e-5", "online_lr3e-5"}
    assert specs["hl_sync16"].humanline.sync_every == 16 and specs["hl"].humanline.sync_every == 1
    assert (specs["hl_tight"].humanline.log_eps_P, specs["hl_tight"].humanline.log_eps_R) == (-0.05, 0.05)
    world = {r: s.task_cfg.world["offline"] for r, s in specs.items()}
    assert {r for r, w in world.items() if w.get("style") == "padded"} == {"offline_padded", "hl_padded"}
    assert {r for r, w in world.items() if w.get("source") == "model"} == {"offline_model", "hl_model"}


def test_regime_map_from_one_sweep_pairs_each_humanline_regime_with_its_baselines(tmp_path, capsys):
    import yaml

    from humanline_cli.lab.regime_map import main

    root = tmp_path / "laptop_regimes"
    # (regime, config overrides, accuracy per seed)
    plan = [("offline", {}, [0.70, 0.72, 0.68]), ("online", {"regime": "online"}, [0.90, 0.92, 0.88]),
            ("hl", {"humanline": True}, [0.80, 0.87, 0.82]),
            ("hl_sync16", {"humanline": True, "hl__sync_every": 16}, [0.90, 0.92, 0.88]),
            ("offline_padded", {"task__world__offline": {"style": "padded"}}, [0.60, 0.60, 0.60]),
            ("hl_padded", {"humanline": True, "task__world__offline": {"style": "padded"}}, [0.75, 0.76, 0.74]),
            ("offline_lr3e-5", {"train__lr": 3e-5}, [0.80, 0.80, 0.80]),
            ("hl_lr3e-5", {"humanline": True, "train__lr": 3e-5}, [0.70, 0.70, 0.70]),
            ("online_lr3e-5", {"regime": "online", "train__lr": 3e-5}, [1.0, 1.0, 1.0])]
    for name, over, accs in plan:
        for seed, acc in enumerate(accs):
            cfg = config(obj="grpo", seed=seed, **over)
            d = run_dir(root, f"{name}/grpo_seed{seed}", cfg, win=0.6, wall=100.0 if "online" in name else 25.0, acc=acc)
            (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"regime={name}", "objective=grpo"]))
    (root / "multirun.yaml").write_text(yaml.safe_dump(
        {"hydra": {"sweeper": {"params": {"regime": ",".join(n for n, _, _ in plan)}}}}))
    out = tmp_path / "map.png"
    assert main(["--sweep", str(root), "--out", str(out)]) == 0
    table = [x for x in capsys.readouterr().out.splitlines() if x.startswith("| hl")]
    # sweep order; per-seed gaps: hl 0.5/0.75/0.7, sync16 1/1/1, padded vs offline_padded 0.5/0.5/0.5
    # (online does not read the offline data), lr 3e-5 vs its own baselines -0.5 each
    assert [x.split(" | ")[0] for x in table] == ["| hl", "| hl_sync16", "| hl_padded (vs offline_padded, online)",
                                                  "| hl_lr3e-5 (vs offline_lr3e-5, online_lr3e-5)"]
    assert "| 0.700 | 0.900 | 0.830 | 65% [" in table[0] and "| 100% [100%, 100%] | 3 | 4.00x |" in table[1]
    assert "| 0.600 | 0.900 | 0.750 | 50% [50%, 50%] | 3 |" in table[2]
    assert "| 0.800 | 1.000 | 0.700 | -50% [-50%, -50%] | 3 |" in table[3]
    assert out.stat().st_size > 1000
    rows = (tmp_path / "map.csv").read_text().splitlines()
    assert len(rows) == 5 and rows[0].startswith("regime,compared_with,task,objective")
    assert main(["--sweep", str(tmp_path / "nowhere")]) == 2 and main([]) == 2
    # `humanline report` on the sweep pairs the regimes the same way (its gap section, one row per regime)
    md = build_report(root, tmp_path / "rep").markdown
    gap = [x for x in md.splitlines() if x.startswith("| arithmetic | grpo | hl") and " | accuracy | " in x]
    assert [x.split(" | ")[2] for x in gap] == ["hl", "hl_sync16", "hl_padded (vs offline_padded, online)",
                                                "hl_lr3e-5 (vs offline_lr3e-5, online_lr3e-5)"]
    assert "| 0.700 | 0.900 | 0.830 | 65% [" in gap[0]


def test_learning_curves_and_speedup_at_equal_quality_hand_computed():
    from humanline_cli.report.frame import curve, run_points
    from humanline_cli.report.gap_closed import equal_quality, time_to

    summary = {"eval": {"greedy": {"accuracy": 0.9, "start_accuracy": 0.6}},
               "wall_clock_s": {"setup": 99.0, "train": 10.0, "sample": 30.0, "eval": 5.0, "total": 144.0}}
    metrics = [{"step": 10, "loss": 0.5, "time/train": 1.0, "time/sample": 4.0, "time/eval": 0.0},
               {"step": 20, "loss": 0.4, "time/train": 2.0, "time/sample": 8.0, "time/eval": 1.0, "time/setup": 99.0},
               {"step": 20, "eval/greedy/accuracy": 0.8, "wall_s": 120.0}]
    online = curve(run_points(summary, metrics), "greedy accuracy", "work_s")
    assert online == [(0.0, 0.6), (10.0, 0.8), (40.0, 0.9)]  # work time: no eval, no setup
    assert time_to(online, 0.85) == pytest.approx(25.0)  # 10 + 30 * (0.05 / 0.1)
    assert time_to(online, 0.5) == 0.0 and time_to(online, 0.95) is None
    hl = [(0.0, 0.6), (4.0, 0.7), (10.0, 0.85)]
    # the target is start + 0.9 x (online's mean final - start) = 0.6 + 0.9 x 0.3 = 0.87: online reaches it at
    # 10 + 30 x 0.07 / 0.1 = 31 s on both seeds; humanline seed 0 never does (censored at 10 s), seed 1 at
    # 8 x 0.27 / 0.35 = 6.171 s. Kaplan-Meier: humanline's estimated share short of it drops to 1/2 at 6.171 s
    # (two at risk, one reaches it), so its median is 6.171 s; online's is 31 s
    eq = equal_quality({0: online, 1: online}, {0: hl, 1: [(0.0, 0.6), (8.0, 0.95)]})
    assert eq["target"] == pytest.approx(0.87) and eq["never"] == 0
    assert eq["online"] == {"median": pytest.approx(31.0), "reached": 2, "n": 2}
    assert eq["humanline-offline"] == {"median": pytest.approx(8 * 0.27 / 0.35), "reached": 1, "n": 2}
    assert eq["speedup"] == pytest.approx(31.0 / (8 * 0.27 / 0.35))  # 5.023
    # three humanline seeds, one reaching it: the median is undefined and there is no speedup
    eq3 = equal_quality({0: online}, {0: hl, 1: [(0.0, 0.6), (8.0, 0.95)], 2: hl})
    assert eq3["humanline-offline"]["median"] is None and eq3["speedup"] is None


def test_equal_quality_target_is_online_gain_not_humanline_own_mean():
    """The issue's example: humanline finals 0.50, 0.51, 0.60. A target at their own mean, 0.5367, is out of
    reach of two of them by construction; the target start + 0.9 x online's gain is not humanline's to set."""
    from humanline_cli.report.gap_closed import equal_quality, gain_target

    online = [(0.0, 0.30), (10.0, 0.40), (20.0, 0.50)]  # three seeds alike: mean final 0.50
    hl = {0: [(0.0, 0.30), (5.0, 0.40), (10.0, 0.50)], 1: [(0.0, 0.30), (5.0, 0.40), (10.0, 0.51)],
          2: [(0.0, 0.30), (5.0, 0.45), (10.0, 0.60)]}
    assert gain_target([online] * 3) == pytest.approx((0.30, 0.50, 0.48))  # 0.30 + 0.9 x (0.50 - 0.30)
    eq = equal_quality({s: online for s in range(3)}, hl)
    assert eq["target"] == pytest.approx(0.48)
    # online: 10 + 10 x (0.48 - 0.40) / 0.10 = 18 s on every seed
    assert eq["online"] == {"median": pytest.approx(18.0), "reached": 3, "n": 3} and eq["never"] == 0
    # humanline: 5 + 5 x 0.08 / 0.10 = 9.0 s, 5 + 5 x 0.08 / 0.11 = 8.636 s, 5 + 5 x 0.03 / 0.15 = 6.0 s;
    # every seed reaches it, so the Kaplan-Meier median is the middle time, 8.636 s
    assert eq["humanline-offline"] == {"median": pytest.approx(5 + 5 * 0.08 / 0.11), "reached": 3, "n": 3}
    assert eq["speedup"] == pytest.approx(18.0 / (5 + 5 * 0.08 / 0.11))  # 2.084


def test_km_medians_counts_every_seed_in_n():
    from humanline_cli.report.matched import km_medians

    # (step, seconds, score): one seed reaches 0.8 at step 5 (2.5 s), one never, one has no evaluation at all
    curves = [[(0, 0.0, 0.6), (10, 5.0, 1.0)], [(0, 0.0, 0.6), (10, 5.0, 0.7)], []]
    got = km_medians(curves, 0.8)
    assert (got["reached"], got["n"]) == (1, 3)
    # among the two seeds with curves: one event at 2.5 s of two at risk, so the share short drops to 1/2
    assert got["seconds"] == pytest.approx(2.5) and got["steps"] == pytest.approx(5.0)


def test_report_gives_the_speedup_at_equal_quality_from_learning_curves(tmp_path):
    root = tmp_path / "sweep"
    for seed in range(2):
        for name, cfg, final, mid, work in (("off", config(obj="grpo", seed=seed), 0.7, 0.65, 10.0),
                                            ("on", config(obj="grpo", regime="online", seed=seed), 0.9, 0.8, 40.0),
                                            ("hl", config(obj="grpo", humanline=True, seed=seed), 0.9, 0.7, 10.0)):
            d = run_dir(root, f"{name}{seed}", cfg, win=0.6, wall=work + 5.0, acc=final)
            s = json.loads((d / "summary.json").read_text())
            s["eval"]["greedy"] = {"accuracy": final, "start_accuracy": 0.6}
            setup = 15.0 if name == "hl" else 5.0  # wall-clock speedup at equal steps: 45 / 25
            sample = 10.0 if name == "on" else 0.0  # online: 10 of its 40 work seconds sampling
            s["wall_clock_s"] = {"train": work - sample, "sample": sample, "label": 0.0, "total": work + setup}
            (d / "summary.json").write_text(json.dumps(s))
            rows = [{"step": 20, "loss": 0.1, "time/train": work / 2}, {"step": 20, "eval/greedy/accuracy": mid}]
            (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    md = build_report(root).markdown
    line = next(x for x in md.splitlines() if x.startswith("| arithmetic | grpo"))
    # the target 0.6 + 0.9 x (0.9 - 0.6) = 0.87: online [(0, .6), (20, .8), (40, .9)] reaches it at
    # 20 + 20 x 0.07 / 0.1 = 34 s; humanline-offline [(0, .6), (5, .7), (10, .9)] at 5 + 5 x 0.17 / 0.2 = 9.25 s:
    # 34 / 9.25 = 3.676x. Online spent 10 / 40 of its work time sampling: offline saves at most 40 / 30
    assert line.endswith("| 2 | 1.80x | 3.68x (reached: online 2 of 2, humanline 2 of 2) | 25% (1.33x) |"), line
    csv_row = (root / "gap_closed.csv").read_text().splitlines()[1].split(",")
    assert csv_row[-4:] == ["3.676", "0", "0.25", "1.333"]


def test_regime_map_table_and_figure_from_report_csvs(tmp_path):
    from humanline_cli.lab.regime_map import main

    head = ("task,objective,set,metric,offline,online,humanline_offline,gap_closed,gap_closed_lo,gap_closed_hi,n_seeds,"
            "online_wall_s,humanline_offline_wall_s,speedup,speedup_equal_quality,online_never_reached\n")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "gap_closed.csv").write_text(head + "arithmetic,grpo,,greedy accuracy,0.7,0.9,0.8,0.5,0.4,0.6,3,"
                                                          "100,25,4,0.5,0\n")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "gap_closed.csv").write_text(head + "arithmetic,dpo,,greedy accuracy,0.8,0.9,0.79,-0.1,,,1,"
                                                          "50,25,2,,\n")
    out = tmp_path / "map.png"
    assert main(["--out", str(out), f"groups={tmp_path / 'a'}", f"pairs={tmp_path / 'b'}"]) == 0
    assert out.stat().st_size > 1000
    assert main([f"x={tmp_path / 'missing'}"]) == 2 and main(["no-label"]) == 2


def test_regime_map_markdown_rows():
    from humanline_cli.lab.regime_map import markdown

    row = {"regime": "groups", "objective": "grpo", "metric": "greedy accuracy", "offline": "0.7", "online": "0.9",
           "humanline_offline": "0.8", "gap_closed": "0.5", "gap_closed_lo": "0.4", "gap_closed_hi": "0.6",
           "n_seeds": "3", "speedup": "4", "speedup_equal_quality": ""}
    assert markdown([row])[2] == ("| groups | grpo | greedy accuracy | 0.700 | 0.900 | 0.800 | 50% [40%, 60%] | 3 | "
                                  "4.00x | n/a | n/a |")  # a CSV from before the sampling columns
    row.update(online_sampling_share="0.25", speedup_bound_matched="1.333")
    assert markdown([row])[2].endswith("| 4.00x | n/a | 25% (1.33x) |")


def test_bar_chart_turns_horizontal_for_many_regimes(tmp_path):
    import struct

    from humanline_cli.report.gap_closed import bar_chart

    def size(path):  # PNG IHDR: width, height
        return struct.unpack(">II", path.read_bytes()[16:24])

    few, many = tmp_path / "few.png", tmp_path / "many.png"
    bar_chart(["a", "b", "c"], [(0.5, 0.4, 0.6), (0.1, None, None), (-0.2, -0.3, 0.0)], few)
    bar_chart([f"grpo\nr{i}" for i in range(21)], [(0.02 * i, None, None) for i in range(21)], many)
    (fw, fh), (mw, mh) = size(few), size(many)
    assert fw > fh and mh > mw  # one column per bar for a few, one row per bar for many


def test_no_median_time_to_target_where_fewer_than_half_reach_it():
    from humanline_cli.report.gap_closed import km_to

    # one seed of three crosses 0.5 at t = 10 + 10 x (0.5 - 0.4) / (0.6 - 0.4) = 15; the other two end short of it
    # earlier (t = 8 and 12): Kaplan-Meier's survival falls from 1 to 0 at 15 (one seed still at risk), so it would
    # give 15 as the median though one seed in three reached the target
    curves = [[(0, 0.1), (10, 0.4), (20, 0.6)], [(0, 0.1), (8, 0.45)], [(0, 0.1), (12, 0.3)]]
    assert km_to(curves, 0.5) == {"median": None, "reached": 1, "n": 3}
    # two of three: the median is the Kaplan-Meier one (crossings at 15 and 5; the third censored at 12)
    two = [curves[0], [(0, 0.1), (10, 0.9)], curves[2]]
    assert km_to(two, 0.5) == {"median": 15.0, "reached": 2, "n": 3}
