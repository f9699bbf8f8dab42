"""`humanline report` on a sweep over staleness x correction (experiment=laptop_corrections_frontier's shape): per
data regime, humanline minus each other correction paired by seed with 95% t-intervals, greedy and sampled
(report/correction_contrasts.py), and the gap-closed comparison of each stale-K's plain (correction=none) group;
hand-computed."""
from __future__ import annotations

import csv
import json
import math

import pytest

from humanline_cli.report.aggregate import build_report
from tests.helpers.runs import config, run_dir

T2 = 4.302652729911275  # t(0.975, 2)
T1 = 12.706204736174698  # t(0.975, 1)
# (K, correction) -> per seed 1, 2, 3 (greedy, sampled) at the last step; None: no run of that seed
PLAN = {(1, "none"): [(0.60, 0.40), (0.62, 0.42), (0.64, 0.44)],
        (1, "tis"): [(0.61, 0.40), (0.60, 0.42), None],
        (64, "none"): [(0.30, 0.25), (0.34, 0.27), (0.32, 0.26)],
        (64, "humanline"): [(0.50, 0.35), (0.56, 0.38), (0.53, 0.35)],
        (64, "tis"): [(0.31, 0.25), (0.33, 0.27), (0.32, 0.26)],
        (64, "decoupled"): [(0.28, 0.22), (0.30, 0.24), (0.29, 0.23)]}  # its dirs sort first: never the baseline


def _sweep(root, plan=PLAN):
    for (k, kind), scores in plan.items():
        for seed, got in enumerate(scores, start=1):
            if got is None:
                continue
            cfg = config(obj="grpo", regime="online", seed=seed, correction={"kind": kind, "cap": 3.0})
            cfg["data"]["generate_every"] = k
            d = run_dir(root, f"K{k}_{kind}/grpo_seed{seed}", cfg, win=0.6, wall=100.0, acc=got[1])
            s = json.loads((d / "summary.json").read_text())
            s["eval"]["greedy"] = {"accuracy": got[0], "start_accuracy": 0.28}
            s["humanline"] = kind == "humanline"  # a run writes humanline: true for correction=humanline
            (d / "summary.json").write_text(json.dumps(s))
    return root


def _rows(path):
    with open(path, newline="") as f:
        return {(r["data"], r["metric"], r["a"], r["b"]): r for r in csv.DictReader(f)}


def test_each_correction_against_humanline_per_staleness_paired_by_seed(tmp_path):
    rep = build_report(_sweep(tmp_path / "sweep"))
    rows = _rows(rep.files["corrections.csv"])
    # K=64 has humanline: humanline minus none and minus tis; K=1 has none: tis minus none, seeds 1 and 2 only
    modes = ("greedy", "sampled")
    assert set(rows) == {("stale-64", m, "humanline", b) for m in modes for b in ("none", "tis", "decoupled")} | {
        ("online", m, "tis", "none") for m in modes}
    # humanline - tis, greedy: 0.19, 0.23, 0.21: mean 0.21, sd 0.02, half-width t(0.975, 2) x 0.02 / sqrt(3)
    r = rows[("stale-64", "greedy", "humanline", "tis")]
    half = T2 * 0.02 / math.sqrt(3)
    assert float(r["mean"]) == pytest.approx(0.21, abs=5e-7) and r["n_seeds"] == "3"
    assert (float(r["lo"]), float(r["hi"])) == pytest.approx((0.21 - half, 0.21 + half), abs=5e-7)
    assert (float(r["a_mean"]), float(r["b_mean"])) == pytest.approx((0.53, 0.32), abs=5e-7)
    # humanline - none, greedy: 0.20, 0.22, 0.21: mean 0.21, sd 0.01
    r = rows[("stale-64", "greedy", "humanline", "none")]
    half = T2 * 0.01 / math.sqrt(3)
    assert (float(r["lo"]), float(r["hi"])) == pytest.approx((0.21 - half, 0.21 + half), abs=5e-7)
    # humanline - tis, sampled: 0.10, 0.11, 0.09: mean 0.10, sd 0.01
    r = rows[("stale-64", "sampled", "humanline", "tis")]
    assert float(r["mean"]) == pytest.approx(0.10, abs=5e-7)
    assert float(r["hi"]) - float(r["mean"]) == pytest.approx(T2 * 0.01 / math.sqrt(3), abs=5e-7)
    # paired by seed, not by position: tis has seeds 1 and 2 at K=1: 0.61 - 0.60, 0.60 - 0.62 = +0.01, -0.02;
    # mean -0.005, sd 0.03 / sqrt(2), half-width t(0.975, 1) x 0.03 / 2
    r = rows[("online", "greedy", "tis", "none")]
    assert float(r["mean"]) == pytest.approx(-0.005, abs=5e-7) and r["n_seeds"] == "2"
    assert float(r["hi"]) - float(r["mean"]) == pytest.approx(T1 * 0.015, abs=5e-6)
    # sampled at K=1: 0.40 - 0.40, 0.42 - 0.42: a zero-width interval at 0
    r = rows[("online", "sampled", "tis", "none")]
    assert (float(r["mean"]), float(r["lo"]), float(r["hi"])) == (0.0, 0.0, 0.0)
    section = rep.markdown.partition("## Paired differences between corrections\n")[2]
    assert "| grpo | – | stale-64 | greedy | humanline - tis | 0.530 | 0.320 | +0.210 | [+0.160, +0.260] | 3 |" in section
    assert section.index("| online |") < section.index("| stale-64 |")  # K ascending
    # only none and humanline: humanline on and off, the gap-closed section's comparison: no section, no file
    plan = {key: v for key, v in PLAN.items() if key[1] in ("none", "humanline")}
    rep = build_report(_sweep(tmp_path / "on_off", plan))
    assert "corrections.csv" not in rep.files and not (tmp_path / "on_off" / "corrections.csv").exists()
    assert "between corrections" not in rep.markdown


def test_the_gap_section_compares_each_stale_k_plain_group(tmp_path):
    """online, stale-64 and humanline-stale-64 each hold one group once the tis and decoupled groups are set aside
    (their corrections are compared above): gap closed = mean(0.20, 0.22, 0.21) / mean(0.30, 0.28, 0.32) = 0.21 /
    0.30 (decoupled as the baseline would give 0.24 / 0.33)."""
    rep = build_report(_sweep(tmp_path / "sweep"))
    with open(rep.files["gap_closed.csv"], newline="") as f:
        gaps = list(csv.DictReader(f))
    assert [(g["set"], g["metric"], g["n_seeds"]) for g in gaps] == [("stale-64", "greedy accuracy", "3")]
    assert float(gaps[0]["gap_closed"]) == pytest.approx(0.7, abs=5e-6)
    assert float(gaps[0]["gap"]) == pytest.approx(0.30, abs=5e-6)


# the mean wall-clock seconds of each (K, correction) group, every seed alike
WALLS = {(1, "none"): 60.0, (1, "tis"): 80.0, (64, "none"): 30.0, (64, "humanline"): 40.0, (64, "tis"): 50.0,
         (64, "decoupled"): 24.0}


def test_the_cell_table_and_matched_quality_take_online_none_as_the_baseline(tmp_path):
    """online holds two groups (correction none and tis): both read online's correction=none group as the
    baseline, the one the gap section compares with."""
    root = _sweep(tmp_path / "sweep")
    for d in root.glob("K*_*/grpo_seed*"):
        k, kind = d.parent.name.removeprefix("K").split("_")
        s = json.loads((d / "summary.json").read_text())
        s["steps"], s["wall_clock_s"] = 64, {"total": WALLS[(int(k), kind)]}
        (d / "summary.json").write_text(json.dumps(s))
    rep = build_report(root)
    # speedup vs online = online none's 60 s / the group's
    speed = {(c["family"], c["label"].split(",")[0]): c["speedup_vs_online"] for c in rep.cells.to_dict("records")}
    assert speed == pytest.approx({("online", "correction.kind=none"): 1.0, ("online", "correction.kind=tis"): 0.75,
                                   ("stale-64", "correction.kind=none"): 2.0, ("stale-64", "correction.kind=tis"): 1.2,
                                   ("stale-64", "correction.kind=decoupled"): 2.5,
                                   ("humanline-stale-64", "correction.kind=humanline"): 1.5})
    assert "n/a vs online" not in rep.markdown and "30.0 s (2.00x vs online)" in rep.markdown
    # matched quality, no mid-run evaluation: each curve runs straight from (step 0, 0 s, 0.28) to (step 64, the
    # run's seconds, its final greedy accuracy). Target 0.28 + 0.9 x (0.62 - 0.28) = 0.586, reached at the share
    # 0.306 / (final - 0.28) of the run: online none 0.60, 0.62, 0.64 at 57.375, 54, 51 s (of 60): median 54 s,
    # step 64 x 0.306 / 0.34 = 57.6; online tis 0.61, 0.60 at 74.18, 76.5 s (of 80): median 80 x 0.306 / 0.33 =
    # 74.18 s, step 59.35: speedup 54 / 74.18 = 0.73x, at equal steps 60 / 80 = 0.75x; stale-64 none never
    # reaches it (0.30, 0.34, 0.32)
    section = rep.markdown.partition("## Speedup at matched quality\n")[2].split("\n## ", 1)[0]
    assert "greedy accuracy 0.586 (start 0.28 + 0.9 x (online's mean final 0.62 - start))" in section
    rows = {x.split(" | ")[2]: x for x in section.splitlines() if x.startswith("| arithmetic | grpo | ")}
    assert rows["online (correction.kind=none, data.generate_every=1)"].endswith(
        "| 3 of 3 | 57.6 | 54.0 | 1.00x | 1.00x |")
    assert rows["online (correction.kind=tis, data.generate_every=1)"].endswith(
        "| 2 of 2 | 59.3 | 74.2 | 0.73x | 0.75x |")
    assert rows["stale-64 (correction.kind=none, data.generate_every=64)"].endswith(
        "| 0 of 3 (not reached: 3) | – | – | – | 2.00x |")
    assert len(rows) == 6
