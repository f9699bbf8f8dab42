"""Paired differences (by seed) with t-intervals and a prompt-level bootstrap, and gap closed only where the
gap's interval excludes 0: hand-computed numbers."""
from __future__ import annotations

import json
import math

import pytest

from humanline_cli.report.aggregate import build_report, print_report
from humanline_cli.report.gap_closed import gap_closed_paired, gap_text, paired_columns
from humanline_cli.report.stats import paired_by_seed, paired_t, prompt_bootstrap
from tests.helpers.runs import config, run_dir


def test_paired_t_hand_computed():
    p = paired_t([0.80, 0.87, 0.82], [0.70, 0.72, 0.68])
    assert p["diffs"] == pytest.approx([0.10, 0.15, 0.14]) and p["n"] == 3
    sd = math.sqrt((0.03**2 + 0.02**2 + 0.01**2) / 2)  # 0.0264575
    half = 4.302653 * sd / math.sqrt(3)  # t(0.975, 2) = 4.302653: 0.0657246
    assert p["mean"] == pytest.approx(0.13)
    assert (p["lo"], p["hi"]) == pytest.approx((0.13 - half, 0.13 + half))
    assert (p["lo"], p["hi"]) == pytest.approx((0.0642754, 0.1957246), abs=1e-6)
    one = paired_t([0.9], [0.7])
    assert one["mean"] == pytest.approx(0.2) and one["lo"] is None and one["n"] == 1
    with pytest.raises(ValueError):
        paired_t([1.0, 2.0], [1.0])


def test_paired_by_seed_keeps_the_seeds_both_scored():
    import pandas as pd

    # seed 3 lacks b, seed 4 has no a score, seed 5 only a: the pairs are seeds 1, 2 and 7 as above
    a = pd.Series([0.87, 0.80, 0.82, 0.99, float("nan"), 0.5], index=[2, 1, 7, 3, 4, 5])
    b = pd.Series([0.70, 0.72, 0.68, float("nan"), 0.1], index=[1, 2, 7, 3, 4])
    p = paired_by_seed(a, b)
    assert p["seeds"] == [1, 2, 7] and p["diffs"] == pytest.approx([0.10, 0.15, 0.14])
    assert (p["lo"], p["hi"]) == pytest.approx((0.0642754, 0.1957246), abs=1e-6)
    assert (p["a_mean"], p["b_mean"]) == pytest.approx((2.49 / 3, 2.10 / 3))
    # t = 0.13 / (0.0264575 / sqrt 3) = 8.5105 on 2 df: two-sided p = 1 - t / sqrt(2 + t^2)
    t = 0.13 / (math.sqrt(0.0014 / 2) / math.sqrt(3))
    assert p["p"] == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-9)
    assert paired_by_seed(a[[5]], b) is None
    assert paired_by_seed(pd.Series([0.5, 0.6], index=[1, 2]), pd.Series([0.4, 0.5], index=[1, 2]))["p"] is None


def test_prompt_bootstrap_hand_computed():
    # one seed, two prompts, differences 1 and 0: a replicate draws 2 prompts with replacement, so its mean is
    # 0 (p 1/4), 1/2 (p 1/2) or 1 (p 1/4); the 2.5% and 97.5% quantiles of 2000 replicates are 0 and 1
    b = prompt_bootstrap([[1.0, 0.0]], [[0.0, 0.0]])
    assert b["mean"] == 0.5 and (b["lo"], b["hi"]) == (0.0, 1.0) and (b["n_seeds"], b["n_prompts"]) == (1, 2)
    # a constant difference has a zero-width interval, whatever is resampled
    c = prompt_bootstrap([[0.75] * 4] * 3, [[0.5] * 4] * 3)
    assert (c["mean"], c["lo"], c["hi"]) == (0.25, 0.25, 0.25)
    # the seeds are held fixed: two seeds, one +1 on every prompt and one 0, average 1/2 on every prompt, so
    # the interval is [0.5, 0.5] though the seeds disagree completely; this is why it is printed as
    # "prompt-level only" and the t-interval over seeds is the reported one
    s = prompt_bootstrap([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]], [[0.0] * 3, [0.0] * 3])
    assert (s["mean"], s["lo"], s["hi"]) == (0.5, 0.5, 0.5)
    # paired: the same prompt draw for both arms, so a shared per-prompt effect cancels exactly
    a = [[0.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]]
    assert prompt_bootstrap(a, a)["lo"] == 0.0 and prompt_bootstrap(a, a)["hi"] == 0.0
    with pytest.raises(ValueError):
        prompt_bootstrap([1.0, 2.0], [1.0, 2.0])


def test_the_gap_interval_decides_the_verdict():
    # one seed, so the given interval of the gap decides: wholly above 0, wholly below, or touching it
    verdict = {iv: gap_closed_paired([0.7], [0.9], [0.8], gap_interval=iv)["verdict"]
               for iv in ((0.01, 0.2), (-0.3, -0.1), (-0.01, 0.2), (0.0, 0.2))}
    assert verdict == {(0.01, 0.2): "gap", (-0.3, -0.1): "online below", (-0.01, 0.2): "unbounded",
                       (0.0, 0.2): "unbounded"}


def test_gap_closed_refuses_a_ratio_when_the_gap_interval_holds_zero():
    # gaps of 1 and 2 prompts in 256 with humanline half-way each time: the old report printed "50% [50%, 50%]"
    off, on = [0.980, 0.976], [0.984, 0.984]
    hl = [0.982, 0.980]
    g = gap_closed_paired(off, on, hl)
    # gap diffs 0.004, 0.008: mean 0.006, sd 0.0028284, half 12.706 * 0.0028284 / sqrt(2) = 0.025412
    assert g["gap"]["mean"] == pytest.approx(0.006)
    assert (g["gap"]["lo"], g["gap"]["hi"]) == pytest.approx((0.006 - 0.025412, 0.006 + 0.025412), abs=1e-6)
    assert g["verdict"] == "unbounded" and g["mean"] is None and g["n"] == 2 and gap_text(g) == "unbounded"
    # one seed has no t-interval: no gap unless the caller supplies one (the prompt bootstrap)
    assert gap_closed_paired([0.7], [0.9], [0.8])["verdict"] == "unbounded"
    one = gap_closed_paired([0.7], [0.9], [0.8], gap_interval=(0.15, 0.25))
    assert one["verdict"] == "gap" and one["mean"] == pytest.approx(0.5) and one["lo"] is None
    assert gap_text(one) == "50%"
    # a gap wholly below 0: online is worse than the baseline, no ratio either
    below = gap_closed_paired([0.9, 0.92], [0.8, 0.81], [0.85, 0.85])
    assert below["verdict"] == "online below" and below["mean"] is None and gap_text(below) == "online below"


def test_gap_closed_is_a_ratio_of_means_with_a_fieller_interval_paired_by_seed():
    # per seed x = humanline - offline = 0.10, 0.18, 0.10 and y = online - offline = 0.16, 0.26, 0.24
    g = gap_closed_paired([0.60, 0.62, 0.64], [0.76, 0.88, 0.88], [0.70, 0.80, 0.74])
    # ratio of means: mean(x) / mean(y) = (0.38 / 3) / (0.66 / 3) = 0.575758 (the mean of per-seed ratios
    # 0.625, 0.692, 0.417 would be 0.578)
    assert g["verdict"] == "gap" and g["n"] == 3 and g["mean"] == pytest.approx(0.38 / 0.66)
    # Fieller, in hundredths: a = 38/3, b = 22; variances of the means (sample (co)variance / 3):
    # v11 = (64 + 256 + 64) / 9 / 2 / 3 = 64/9, v22 = (36 + 16 + 4) / 2 / 3 = 28/3, v12 = 32 / 2 / 3 = 16/3;
    # t(0.975, 2)^2 = 4.302653^2 = 18.512820
    t2 = 4.302653 ** 2
    qa, qb, qc = 22**2 - t2 * 28 / 3, 38 / 3 * 22 - t2 * 16 / 3, (38 / 3) ** 2 - t2 * 64 / 9
    # = 311.2137, 179.9316, 28.7968; roots (qb -+ sqrt(qb^2 - qa qc)) / qa
    root = math.sqrt(qb**2 - qa * qc)
    assert (g["lo"], g["hi"]) == pytest.approx(((qb - root) / qa, (qb + root) / qa), abs=1e-6)
    assert (g["lo"], g["hi"]) == pytest.approx((0.086494, 1.069828), abs=1e-6)
    assert gap_text(g) == "58% [9%, 107%]"


def test_paired_columns_hand_computed():
    import pandas as pd

    arms = {"offline": [0.70, 0.72, 0.68], "online": [0.90, 0.92, 0.88], "humanline-offline": [0.80, 0.87, 0.82]}
    got = paired_columns("greedy accuracy", pd.DataFrame(arms))
    assert got["greedy_humanline_offline_minus_offline_mean"] == pytest.approx(0.13)
    # online - humanline-offline per seed: 0.10, 0.05, 0.06; mean 0.07, sd 0.0264575 (as in test_paired_t_hand_computed)
    half = 4.302653 * math.sqrt((0.03**2 + 0.02**2 + 0.01**2) / 2) / math.sqrt(3)
    assert got["greedy_online_minus_humanline_offline_n"] == 3
    assert (got["greedy_online_minus_humanline_offline_lo"], got["greedy_online_minus_humanline_offline_hi"]) == \
        pytest.approx((0.07 - half, 0.07 + half))
    assert got["greedy_online_minus_offline_lo"] == pytest.approx(0.2)  # 0.2 on every seed
    assert got["greedy_online_minus_offline_boot_lo"] is None  # no per-prompt scores, no bootstrap
    assert "greedy_online_minus_offline_lo90" not in got  # no margin, no equivalence columns
    e = paired_columns("accuracy", pd.DataFrame(arms), margin=0.05)
    assert e["sampled_online_minus_offline_equivalence"] == "not shown equivalent"


def _sweep(root, per_prompt: dict) -> None:
    """Three families; per_prompt[family][seed] = greedy per-prompt scores on the same eval prompts (sampled
    scores are the same here)."""
    cfgs = {"offline": lambda s: config(obj="grpo", seed=s), "online": lambda s: config(obj="grpo", regime="online", seed=s),
            "hl": lambda s: config(obj="grpo", humanline=True, seed=s)}
    for fam, by_seed in per_prompt.items():
        for seed, scores in enumerate(by_seed):
            prompts = [f"{i:02d}+{i:02d}=" for i in range(len(scores))]
            acc = sum(scores) / len(scores)
            d = run_dir(root, f"{fam}{seed}", cfgs[fam](seed), win=0.6, wall=20.0, acc=acc)
            s = json.loads((d / "summary.json").read_text())
            s["eval"]["greedy"] = {"accuracy": acc, "start_accuracy": 0.5}
            (d / "summary.json").write_text(json.dumps(s))
            for name in ("eval_samples.jsonl", "eval_samples_greedy.jsonl"):
                (d / name).write_text("".join(json.dumps({"prompt": p, "policy_score": x}) + "\n"
                                              for p, x in zip(prompts, scores)))


def test_report_prints_paired_differences_and_an_unbounded_gap_closed(tmp_path, capsys):
    root = tmp_path / "sweep"
    # greedy accuracy per seed: offline 0.50, 0.50; online 1.00, 0.75; humanline 0.75, 0.50
    _sweep(root, {"offline": [[1, 1, 0, 0], [1, 0, 1, 0]], "online": [[1, 1, 1, 1], [1, 1, 1, 0]],
                  "hl": [[1, 1, 1, 0], [1, 0, 1, 0]]})
    rep = build_report(root)
    md = rep.markdown
    section = md.split("## Paired differences")[1].split("\n## ")[0]
    lines = [x for x in section.splitlines() if x.startswith("| arithmetic | grpo")]
    greedy = [x for x in lines if " | greedy | " in x]
    # humanline - offline: diffs 0.25, 0.0 -> mean 0.125, sd 0.1767767, half 12.706 * 0.125 = 1.58825
    assert "| humanline-offline - offline | +0.125 | [-1.463, +1.713] |" in greedy[0]
    # online - offline: 0.5, 0.25 -> mean 0.375, half 12.706 * 0.125 = 1.58825: the interval holds 0
    assert "| online - offline | +0.375 | [-1.213, +1.963] |" in greedy[2]
    assert all(x.endswith("| 2 |") for x in lines) and len(lines) == 6
    # the bootstrap interval is there (per-prompt files) and holds the mean
    lo, hi = (float(v) for v in greedy[2].split(" | ")[7].strip("[]").split(", "))
    assert lo <= 0.375 <= hi
    gap_line = next(x for x in md.split("## Gap closed")[1].splitlines() if x.startswith("| arithmetic | grpo"))
    assert "| unbounded |" in gap_line
    csv = (root / "gap_closed.csv").read_text().splitlines()
    head, row = csv[0].split(","), csv[1].split(",")
    assert dict(zip(head, row))["gap_verdict"] == "unbounded" and dict(zip(head, row))["gap"] == "0.375"
    assert "bootstrap (prompt-level only)" in section
    print_report(rep)
    out = capsys.readouterr().out
    assert "Paired differences" in out and "online - offline | +0.375" in out and "unbounded" in out


def test_report_one_seed_gap_decided_by_the_prompt_bootstrap(tmp_path):
    root = tmp_path / "sweep"
    n = 40  # offline right on 10 of 40 prompts, online on all 40, humanline on 30: a clear gap on one seed
    _sweep(root, {"offline": [[1] * 10 + [0] * 30], "online": [[1] * n], "hl": [[1] * 30 + [0] * 10]})
    md = build_report(root).markdown
    gap_line = next(x for x in md.split("## Gap closed")[1].splitlines() if x.startswith("| arithmetic | grpo"))
    assert "| 0.250 | 1.000 | 0.750 | 67% | 1 |" in gap_line  # (0.75 - 0.25) / (1 - 0.25), no seed interval


def test_regime_map_table_says_no_gap_from_the_csv_verdict():
    from humanline_cli.lab.regime_map import markdown

    row = {"regime": "hl_stale16", "objective": "grpo", "metric": "greedy accuracy", "offline": "0.98",
           "online": "0.984", "humanline_offline": "0.982", "gap_closed": "", "gap_closed_lo": "", "gap_closed_hi": "",
           "n_seeds": "2", "speedup": "", "speedup_equal_quality": "", "gap_verdict": "no gap"}
    assert "| 0.982 | no gap | 2 |" in markdown([row])[2]
