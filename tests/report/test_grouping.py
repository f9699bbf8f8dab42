"""`humanline report` pools runs as seeds only when their resolved configs match (minus seed and result-neutral keys).

Run dirs are written by hand (.hydra/config.yaml as Hydra saves it, interpolations included, + summary.json); no
training. Expected numbers are computed by hand in the tests.
"""
from __future__ import annotations

import ast
import csv
import json
import math
from pathlib import Path

import pytest

from humanline_cli.report.aggregate import build_report, main_report, parse_ignore
from tests.helpers.runs import config, run_dir

ROOT = Path(__file__).resolve().parents[2]
EXTRA = {"data.path", "hl.sync_every", "model.name_or_path", "train.lr"}  # the keys that vary in `sweep`


@pytest.fixture
def sweep(tmp_path) -> Path:
    root = tmp_path / "sweep"
    # the seed-only set: 3 seeds that also differ in result-neutral keys and in hl.* (inactive: humanline off)
    run_dir(root, "base0", config(seed=0), win=0.60, wall=40.0)
    run_dir(root, "base1", config(seed=1, threads=1, wandb__tags=["rerun"], experiment_name="other",
                                  humanline=False, hl__sync_every=4), win=0.64, wall=50.0)
    run_dir(root, "base2", config(seed=2, resume=False, hl__clamp=False), win=0.71, wall=60.0)
    # one knob each away from the base: never pooled with it
    run_dir(root, "lr", config(seed=3, train__lr=1.0e-4), win=0.70, wall=45.0)
    run_dir(root, "path", config(seed=0, data__path="/data/other.jsonl"), win=0.58, wall=30.0)
    run_dir(root, "model", config(seed=4, model__name_or_path="/models/other"), win=0.52, wall=35.0)
    # online: the base (2 seeds) and one with the other model
    run_dir(root, "on0", config(regime="online", seed=0), win=0.62, wall=100.0)
    run_dir(root, "on1", config(regime="online", seed=1), win=0.66, wall=140.0)
    run_dir(root, "on_model", config(regime="online", seed=0, model__name_or_path="/models/other"), win=0.5, wall=70.0)
    # humanline-offline: active hl.* knobs differ, so two groups
    run_dir(root, "hl1", config(humanline=True, seed=0), win=0.68, wall=20.0)
    run_dir(root, "hl2", config(humanline=True, seed=0, hl__sync_every=2), win=0.69, wall=24.0)
    # kto: its objective defaults (batch_size 64, and train.batch_size through ${objective.batch_size}) differ
    run_dir(root, "kto", config(obj="kto", seed=0), win=0.57, wall=32.0)
    run_dir(root, "kto_on", config(obj="kto", regime="online", seed=0), win=0.59, wall=96.0)
    return root


def read_rows(path: Path) -> tuple[list[str], list[dict]]:
    with open(path) as f:
        r = csv.DictReader(f)
        return list(r.fieldnames), list(r)


def pick(rows, **want) -> dict:
    """The one row whose columns match `want` (dots in keys spelled __)."""
    want = {k.replace("__", "."): v for k, v in want.items()}
    hits = [r for r in rows if all(r[k] == v for k, v in want.items())]
    assert len(hits) == 1, (want, hits)
    return hits[0]


def test_only_the_seed_only_set_is_pooled(sweep):
    rep = build_report(sweep)
    _, rows = read_rows(sweep / "report.csv")
    # 13 complete runs -> 10 groups: base offline (3 seeds) and base online (2 seeds) pool, nothing else does
    assert len(rows) == 10 and sorted(int(r["n_seeds"]) for r in rows) == [1] * 8 + [2, 3]
    base = pick(rows, objective="dpo", family="offline", train__lr="1e-05", model__name_or_path="world://policy",
                data__path="world://offline_pairs.jsonl")  # data.path resolved from ${task.offline.path}
    assert int(base["n_seeds"]) == 3
    # mean (0.60 + 0.64 + 0.71) / 3 = 0.65; deviations -0.05, -0.01, 0.06 -> sd = sqrt(0.0062 / 2)
    assert float(base["win_rate_mean"]) == pytest.approx(0.65)
    assert float(base["win_rate_std"]) == pytest.approx(math.sqrt(0.0062 / 2), rel=1e-6)
    assert float(base["wall_clock_s"]) == pytest.approx(50.0)
    on = pick(rows, objective="dpo", family="online", model__name_or_path="world://policy")
    assert int(on["n_seeds"]) == 2 and float(on["win_rate_mean"]) == pytest.approx(0.64)
    assert float(on["win_rate_std"]) == pytest.approx(math.sqrt(2 * 0.02**2), rel=1e-6)  # 0.62, 0.66
    for kv in ({"train__lr": "0.0001"}, {"data__path": "/data/other.jsonl"},
               {"model__name_or_path": "/models/other", "family": "offline"}):
        row = pick(rows, objective="dpo", **kv)
        assert int(row["n_seeds"]) == 1 and row["win_rate_std"] == ""
    assert rep.cells.n_seeds.sum() == 13


def test_varying_keys_are_csv_columns(sweep):
    build_report(sweep)
    columns, rows = read_rows(sweep / "report.csv")
    # exactly the keys that tell groups apart, right after "family"; never seed, threads, wandb.*, hl.clamp,
    # objective defaults (dpo vs kto) or train.batch_size (it only interpolates objective.batch_size)
    assert columns[:3] == ["task", "objective", "family"]
    assert columns[3:7] == sorted(EXTRA) and columns[7] == "n_seeds"
    hl = [r for r in rows if r["family"] == "humanline-offline"]
    assert sorted(r["hl.sync_every"] for r in hl) == ["1", "2"]
    assert {r["hl.sync_every"] for r in rows if r["family"] != "humanline-offline"} == {""}  # hl inactive there
    assert pick(rows, objective="kto", family="offline")["train.lr"] == "1e-05"


def test_markdown_and_console_label_each_row(sweep, capsys):
    rep = build_report(sweep)
    md = rep.markdown
    header = next(ln for ln in md.splitlines() if ln.startswith("| objective"))
    assert header == "| objective | model.name_or_path | train.lr | offline | online | humanline-offline |"
    rows = [ln for ln in md.splitlines() if ln.startswith("| **")]
    assert [ln.split(" | ")[:3] for ln in rows] == [
        ["| **dpo**", "/models/other", "1e-05"], ["| **dpo**", "world://policy", "1e-05"],
        ["| **dpo**", "world://policy", "0.0001"], ["| **kto**", "world://policy", "1e-05"]]
    main_row = rows[1]
    assert "data.path=/data/other.jsonl<br>win 0.580" in main_row and "hl.sync_every=2<br>win 0.690" in main_row
    assert "n=3" in main_row and "n=2" in main_row
    assert "## Grouping" in md and "`threads`" in md
    assert main_report([str(sweep)]) == 0
    out = capsys.readouterr().out
    assert "train.lr" in out and "0.0001" in out and "data.path=/data/other.jsonl" in out


def test_speedup_only_against_an_otherwise_identical_online_group(sweep):
    build_report(sweep)
    _, rows = read_rows(sweep / "report.csv")
    speed = lambda **kv: pick(rows, **kv)["speedup_vs_online"]  # noqa: E731
    online_wall = (100.0 + 140.0) / 2  # base online, 2 seeds
    assert float(speed(objective="dpo", family="offline", data__path="world://offline_pairs.jsonl", train__lr="1e-05",
                       model__name_or_path="world://policy")) == pytest.approx(online_wall / 50.0)  # 2.4
    # data.* is family-defining: another offline file still compares with the base online group
    assert float(speed(objective="dpo", data__path="/data/other.jsonl")) == pytest.approx(online_wall / 30.0)
    # the other model compares with the online run of the other model (70 s), not the base (120 s)
    assert float(speed(objective="dpo", family="offline", model__name_or_path="/models/other")) == pytest.approx(2.0)
    assert float(speed(objective="dpo", family="online", model__name_or_path="/models/other")) == pytest.approx(1.0)
    assert float(speed(objective="dpo", hl__sync_every="1")) == pytest.approx(online_wall / 20.0)  # 6.0
    assert float(speed(objective="dpo", hl__sync_every="2")) == pytest.approx(online_wall / 24.0)  # 5.0
    assert speed(objective="dpo", train__lr="0.0001") == ""  # no online run with lr 1e-4
    assert float(speed(objective="kto", family="offline")) == pytest.approx(96.0 / 32.0)  # kto online, not dpo's


def test_ignore_merges_groups(sweep, capsys):
    rep = build_report(sweep, ignore=["train.lr"])
    _, rows = read_rows(sweep / "report.csv")
    assert "train.lr" not in rep.columns and len(rows) == 9
    base = pick(rows, objective="dpo", family="offline", data__path="world://offline_pairs.jsonl",
                model__name_or_path="world://policy")
    wins = [0.60, 0.64, 0.71, 0.70]  # base seeds 0-2 + the lr run (seed 3)
    mean = sum(wins) / 4  # 0.6625
    sd = math.sqrt(sum((w - mean) ** 2 for w in wins) / 3)  # (0.0625² + 0.0225² + 0.0475² + 0.0375²) / 3 = 0.008075 / 3
    assert int(base["n_seeds"]) == 4 and float(base["win_rate_mean"]) == pytest.approx(0.6625)
    assert float(base["win_rate_std"]) == pytest.approx(sd, rel=1e-6) and sd == pytest.approx(0.05188, abs=1e-5)
    assert "--ignore `train.lr`" in rep.markdown
    # a prefix ignores the subtree; comma-separated and repeated flags combine; an unknown key is flagged
    assert main_report([str(sweep), "--ignore", "train,model.name_or_path", "--ignore", "trian.lr"]) == 0
    out = capsys.readouterr().out
    _, rows = read_rows(sweep / "report.csv")
    base = pick(rows, objective="dpo", family="offline", data__path="world://offline_pairs.jsonl")
    assert int(base["n_seeds"]) == 5  # + the other-model run (seed 4)
    assert "--ignore trian.lr matched no key" in out
    assert parse_ignore(["a,b", " c.* ", "a"]) == ("a", "b", "c")


def test_hl_knobs_only_count_when_humanline_is_on(tmp_path):
    root = tmp_path / "runs"
    run_dir(root, "off0", config(seed=0, hl__log_eps_P=-2.0), win=0.5, wall=10.0)
    run_dir(root, "off1", config(seed=1, humanline=False, hl__sync=False), win=0.7, wall=10.0)
    run_dir(root, "on0", config(seed=0, humanline=True, hl__log_eps_P=-2.0), win=0.6, wall=10.0)
    run_dir(root, "on1", config(seed=1, humanline=True, hl__sync=False), win=0.8, wall=10.0)
    rep = build_report(root)
    by_family = {}
    for c in rep.cells.to_dict("records"):
        by_family.setdefault(c["family"], []).append(c)
    assert [c["n_seeds"] for c in by_family["offline"]] == [2]  # absent and `humanline: false` both mean off
    assert by_family["offline"][0]["win_rate_mean"] == pytest.approx(0.6)
    assert [c["n_seeds"] for c in by_family["humanline-offline"]] == [1, 1]
    assert {c["label"] for c in by_family["humanline-offline"]} == {"hl.log_eps_P=-1.0, hl.sync=false",
                                                                  "hl.log_eps_P=-2.0, hl.sync=true"}
    assert set(rep.columns) >= {"hl.log_eps_P", "hl.sync"} and "hl.clamp" not in rep.columns


def test_run_dirs_without_config_fall_back_to_summary_labels(tmp_path):
    root = tmp_path / "runs"
    kw = dict(obj="dpo", humanline=False)
    run_dir(root, "old0", None, win=0.6, wall=40.0, regime="offline", seed=0, **kw)
    run_dir(root, "old1", None, win=0.8, wall=60.0, regime="offline", seed=1, **kw)
    run_dir(root, "old_on", None, win=0.5, wall=150.0, regime="online", seed=0, **kw)
    rep = build_report(root)
    _, rows = read_rows(root / "report.csv")
    off = pick(rows, family="offline")
    assert int(off["n_seeds"]) == 2 and float(off["win_rate_mean"]) == pytest.approx(0.7)
    assert float(off["speedup_vs_online"]) == pytest.approx(150.0 / 50.0)
    assert "| objective | offline | online |" in rep.markdown  # today's layout, no extra columns
    # a new-style run with the same labels is never pooled with them; the column says which is which
    run_dir(root, "new", config(seed=2), win=0.9, wall=40.0)
    rep = build_report(root)
    _, rows = read_rows(root / "report.csv")
    assert sorted((r["family"], r["config.yaml"], r["n_seeds"]) for r in rows) == [
        ("offline", "", "1"), ("offline", "missing", "2"), ("online", "missing", "1")]
    assert pick(rows, family="offline", **{"config.yaml": ""})["speedup_vs_online"] == ""  # only old online


def test_report_plots_does_not_import_report():
    tree = ast.parse((ROOT / "humanline_cli" / "report" / "plots.py").read_text())
    imported = {(n.level, n.module) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {(0, a.name) for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any(mod in ("report", "humanline_cli.report.aggregate") for _, mod in imported), imported


def test_plots_keep_config_groups_apart(tmp_path, monkeypatch):
    from humanline_cli.report import plots as report_plots

    legends, save = {}, report_plots.save_figure

    def spy(fig, path):
        legends[path.name] = sorted(t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().texts)
        return save(fig, path)

    monkeypatch.setattr(report_plots, "save_figure", spy)
    root = tmp_path / "runs"
    for name, every, peak in (("a", 1, 30), ("b", 2, 35)):
        d = run_dir(root, name, config(humanline=True, hl__sync_every=every), win=0.6, wall=10.0)
        (d / "metrics.jsonl").write_text(json.dumps({"step": 5, "humanline/unclamped_fraction": 0.9}) + "\n")
        counts = [0] * 62
        counts[peak] = 10
        (d / "logratios.jsonl").write_text(json.dumps({"step": 5, "lo": -3.0, "hi": 3.0, "counts": counts}) + "\n")
    rep = build_report(root)
    assert set(rep.skipped_plots) == {"eval_vs_step.png", "final_scores.png"}  # no periodic evals; one seed each
    assert sorted(rep.frame[rep.frame.status == "complete"].variant) == ["hl.sync_every=1", "hl.sync_every=2"]
    assert all((root / png).read_bytes()[:4] == b"\x89PNG" for png in ("eval_vs_wallclock.png", "logratio_hist.png"))
    # one histogram per config group (never summed over them), each named by what tells it apart
    assert legends["logratio_hist.png"] == ["humanline-offline (hl.sync_every=1) (out of range 0.0%)",
                                            "humanline-offline (hl.sync_every=2) (out of range 0.0%)"]
    assert legends["unclamped_fraction.png"] == ["humanline-offline (hl.sync_every=1)",
                                                 "humanline-offline (hl.sync_every=2)"]


def test_runs_group_by_correction_within_one_comparison_set(tmp_path):
    """correction=none|tis|humanline on the same data: one comparison set, each correction a labelled cell of its
    family (humanline's in humanline-online), never a row of its own; correction=humanline keeps hl.* (it is on)."""
    from humanline_cli.report.frame import load
    from humanline_cli.report.groups import comparison_sets

    root = tmp_path / "runs"
    for seed in (0, 1):
        for kind, win in (("none", 0.6), ("tis", 0.62)):
            run_dir(root, f"{kind}{seed}", config(regime="online", seed=seed, correction={"kind": kind, "cap": 3.0}),
                    win=win + seed / 100, wall=10.0)
        for sync in (1, 16):
            d = run_dir(root, f"hl{sync}_{seed}", config(regime="online", seed=seed, hl__sync_every=sync,
                                                         correction={"kind": "humanline", "cap": 3.0}),
                        win=0.5 + seed / 100, wall=10.0)
            summary = json.loads((d / "summary.json").read_text())  # a run writes humanline: true for it
            (d / "summary.json").write_text(json.dumps({**summary, "humanline": True}))
    rep = build_report(root)
    cells = {(c["family"], c["label"]): c["n_seeds"] for c in rep.cells.to_dict("records")}
    assert cells == {("online", "correction.kind=none"): 2, ("online", "correction.kind=tis"): 2,
                     ("humanline-online", "correction.kind=humanline, hl.sync_every=1"): 2,
                     ("humanline-online", "correction.kind=humanline, hl.sync_every=16"): 2}
    assert set(rep.cells.row_keys) == {()}  # one table row: the correction labels a cell, it is not a row key
    sets = comparison_sets(load(root).query("status == 'complete'"))
    assert len(sets) == 1 and len(sets[0][3]) == 4


def test_runs_of_one_config_that_computed_in_different_dtypes_are_not_pooled(tmp_path):
    """backend.precision=auto resolves per machine (bf16 where the CPU computes it fast): the same config run on
    two machines trains in two dtypes, and the report keeps them apart by summary.json's `precision.compute`."""
    from humanline_cli.report.frame import COMPUTE_KEY, load
    from humanline_cli.report.groups import groups
    from humanline_cli.report.study_csv import config_hash

    root = tmp_path / "sweep"
    for name, seed, dtype in (("a0", 0, "bfloat16"), ("a1", 1, "bfloat16"), ("b0", 0, "float32"), ("b2", 2, None)):
        d = run_dir(root, name, config(seed=seed, backend={"precision": "auto"}), win=0.6, wall=10.0)
        if dtype:  # b2: a summary from before the field, as older runs have
            s = json.loads((d / "summary.json").read_text())
            (d / "summary.json").write_text(json.dumps({**s, "precision": {"compute": dtype, "why": "probe"}}))
    runs = load(root)
    by_name = {Path(p).name: i for i, p in zip(runs.index, runs.path)}
    members = sorted(sorted(Path(runs.at[i, "path"]).name for i in g) for g in groups(runs).members)
    assert members == [["a0", "a1"], ["b0"], ["b2"]]
    assert runs.at[by_name["a0"], "config"][COMPUTE_KEY] == "bfloat16"
    assert COMPUTE_KEY not in runs.at[by_name["b2"], "config"]
    # the config hash names the config: the same for all four
    assert len({config_hash(c) for c in runs.config}) == 1
    rep = build_report(root)
    assert "backend.compute_dtype" in rep.markdown and "bfloat16" in rep.markdown and "float32" in rep.markdown
