"""`humanline report`: aggregation, CI math, failed/incomplete listing, plots and CLI errors on a synthetic runs dir."""
from __future__ import annotations

import csv
import math
import statistics
from pathlib import Path

import pytest

from humanline_cli.report.aggregate import build_report, main_report
from humanline_cli.report.stats import mean_ci, win_rate_ci
from tests.helpers.runs import make_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def runs_dir(tmp_path) -> Path:
    root = tmp_path / "sweep"
    # dpo: offline x2 seeds, online x2 seeds, humanline-offline x1 seed
    make_run(root, "0", "dpo", "offline", False, 0, win=0.60, acc=0.70, wall=30.0)
    make_run(root, "1", "dpo", "offline", False, 1, win=0.70, acc=0.80, wall=50.0)
    make_run(root, "2", "dpo", "online", False, 0, win=0.55, acc=0.75, wall=90.0, sample=40.0)
    make_run(root, "3", "dpo", "online", False, 1, win=0.65, acc=0.85, wall=110.0, sample=60.0)
    make_run(root, "4", "dpo", "offline", True, 0, win=0.62, ci=[0.57, 0.67], acc=0.81, wall=20.0)
    # grpo: online x1, humanline-offline x3 seeds (nested one level deeper, like a second sweep)
    make_run(root, "5", "grpo", "online", False, 0, win=0.58, acc=0.60, wall=200.0, sample=120.0)
    for seed, (w, t) in enumerate([(0.60, 40.0), (0.62, 50.0), (0.67, 60.0)]):
        make_run(root / "more", str(seed), "grpo", "offline", True, seed, win=w, acc=0.6 + 0.01 * seed, wall=t)
    # kto: offline only (no online run -> speedup n/a)
    make_run(root, "6", "kto", "offline", False, 0, win=0.52, acc=0.55, wall=25.0)
    # one failed, one incomplete
    make_run(root, "7", "dpo", "online", False, 2, status="failed", error="RunFailed: loss is nan at step 3")
    make_run(root, "8", "grpo", "online", True, 0, status="incomplete", steps=(10, 20))
    return root


def read_csv(path: Path) -> dict:
    with open(path) as f:
        return {(r["task"], r["objective"], r["family"]): r for r in csv.DictReader(f)}


def test_csv_aggregates_and_speedup(runs_dir):
    rep = build_report(runs_dir)
    rows = read_csv(runs_dir / "report.csv")
    assert list(rows) == [("arithmetic", "dpo", "offline"), ("arithmetic", "dpo", "online"),
                          ("arithmetic", "dpo", "humanline-offline"), ("arithmetic", "kto", "offline"),
                          ("arithmetic", "grpo", "online"), ("arithmetic", "grpo", "humanline-offline")]
    off = rows[("arithmetic", "dpo", "offline")]
    assert int(off["n_seeds"]) == 2
    assert float(off["win_rate_mean"]) == pytest.approx(0.65)
    assert float(off["win_rate_std"]) == pytest.approx(math.sqrt(((0.60 - 0.65) ** 2 + (0.70 - 0.65) ** 2) / 1), rel=1e-5)
    assert float(off["accuracy_mean"]) == pytest.approx(0.75)
    assert float(off["wall_clock_s"]) == pytest.approx(40.0)
    assert float(off["speedup_vs_online"]) == pytest.approx(100.0 / 40.0)
    on = rows[("arithmetic", "dpo", "online")]
    assert int(on["n_seeds"]) == 2  # the failed seed 2 is not aggregated
    assert float(on["speedup_vs_online"]) == pytest.approx(1.0)
    assert float(on["sample_s"]) == pytest.approx(50.0) and float(on["label_s"]) == pytest.approx(25.0)
    assert float(on["train_s"]) == pytest.approx(95.0)
    hl = rows[("arithmetic", "dpo", "humanline-offline")]
    assert float(hl["speedup_vs_online"]) == pytest.approx(5.0)  # online 100 s / humanline-offline 20 s
    assert hl["win_rate_std"] == ""  # one seed: no spread
    assert (float(hl["win_rate_lo"]), float(hl["win_rate_hi"])) == pytest.approx((0.57, 0.67))  # the run's own CI
    assert float(rows[("arithmetic", "grpo", "humanline-offline")]["speedup_vs_online"]) == pytest.approx(200.0 / 50.0)
    assert rows[("arithmetic", "kto", "offline")]["speedup_vs_online"] == ""  # no online run
    assert (rep.frame.status == "complete").sum() == 10 and (rep.frame.status != "complete").sum() == 2


def test_multi_seed_ci_is_t_interval(runs_dir):
    build_report(runs_dir)
    row = read_csv(runs_dir / "report.csv")[("arithmetic", "grpo", "humanline-offline")]
    wins = [0.60, 0.62, 0.67]
    mean, sd = sum(wins) / 3, statistics.stdev(wins)
    half = 4.302653 * sd / math.sqrt(3)  # t(0.975, df=2)
    assert float(row["win_rate_mean"]) == pytest.approx(0.63)
    assert float(row["win_rate_std"]) == pytest.approx(sd, rel=1e-5)
    assert float(row["win_rate_lo"]) == pytest.approx(mean - half, rel=1e-5)
    assert float(row["win_rate_hi"]) == pytest.approx(mean + half, rel=1e-5)
    assert (mean - half, mean + half) == pytest.approx((0.5404, 0.7196), abs=1e-3)
    # two seeds far apart: the interval is clipped to [0, 1]
    lo, hi = win_rate_ci([0.60, 0.70])
    assert lo == pytest.approx(0.65 - 12.706205 * statistics.stdev([0.6, 0.7]) / math.sqrt(2)) and hi == 1.0


def test_t_quantiles():
    # the 95% interval's half-width over its standard error is t(0.975, n - 1), as printed t-tables (e.g. NIST's)
    # give it to 4 or 5 significant digits
    for df, t in ((1, 12.7062), (2, 4.3027), (10, 2.2281), (60, 2.0003), (120, 1.9799)):
        x = [0.0, 1.0] * ((df + 1) // 2) + [0.5] * ((df + 1) % 2)
        ci = mean_ci(x)
        assert (ci["hi"] - ci["mean"]) / (statistics.stdev(x) / math.sqrt(len(x))) == pytest.approx(t, abs=1e-4)
    assert mean_ci([0.7])["lo"] is None and mean_ci([]) is None


def test_markdown_lists_failed_and_incomplete(runs_dir):
    rep = build_report(runs_dir)
    md = (runs_dir / "report.md").read_text()
    assert md == rep.markdown
    assert md.startswith("# humanline report")
    section = md.split("## Failed or incomplete runs", 1)[1].split("##", 1)[0]
    failed = [ln for ln in section.splitlines() if "`7`" in ln]
    assert len(failed) == 1 and "failed" in failed[0] and "RunFailed: loss is nan at step 3" in failed[0]
    assert "dpo / online / seed 2" in failed[0]
    inc = [ln for ln in section.splitlines() if "`8`" in ln]
    assert len(inc) == 1 and "incomplete" in inc[0] and "last logged step 20" in inc[0]
    assert "grpo / humanline-online / seed 0" in inc[0]
    assert "humanline-online" not in md.split("## Failed", 1)[0]  # incomplete run is not a table column
    ci_note = md.split("## Confidence intervals", 1)[1].split("##", 1)[0]
    assert "Student-t interval across the seeds' win rates" in ci_note
    assert "normal-approximation interval on the per-prompt outcomes" in ci_note and "1/2 tie" in ci_note
    header = next(ln for ln in md.splitlines() if ln.startswith("| objective"))
    assert header == "| objective | offline | online | humanline-offline |"
    objs = [ln.split("|")[1].strip() for ln in md.splitlines() if ln.startswith("| **")]
    assert objs == ["**dpo**", "**kto**", "**grpo**"]
    assert "5.00x vs online" in md and "n/a vs online" in md
    for png in ("eval_vs_wallclock.png", "unclamped_fraction.png", "logratio_hist.png"):
        assert f"]({png})" in md


def test_pngs_are_valid(runs_dir, tmp_path):
    out = tmp_path / "out"
    rep = build_report(runs_dir, out_dir=out)
    assert set(rep.skipped_plots) == {"eval_vs_step.png"}  # these runs have no periodic greedy/sampled evals
    for png in ("eval_vs_wallclock.png", "unclamped_fraction.png", "logratio_hist.png"):
        data = (out / png).read_bytes()
        assert data[:8] == PNG_SIGNATURE and len(data) > 5000
    assert (out / "report.md").is_file() and (out / "report.csv").is_file()
    assert not (runs_dir / "report.md").exists()


def test_eval_curve_and_late_histogram(runs_dir):
    from humanline_cli.report.plots import eval_curve, late_histogram

    rep = build_report(runs_dir)
    run = next(r for r in rep.frame.itertuples() if r.path.name == "4")
    metric, pts = eval_curve(run)
    assert metric == "accuracy"
    assert pts == [(0.0, 0.5), (10.0, pytest.approx(0.76)), (20.0, 0.81)]  # start, eval row, final
    h = late_histogram(run)
    assert len(h) == 62 and h[25] == 100 and sum(h) == 102  # only the last of 4 steps


def test_verifierless_task_shows_judge_reward(tmp_path):
    root = tmp_path / "runs"
    make_run(root, "a", "dpo", "offline", False, 0, task="summarize", win=0.6, acc=None, reward=0.42, wall=10.0)
    make_run(root, "b", "dpo", "offline", False, 1, task="summarize", win=0.7, acc=None, reward=0.46, wall=12.0)
    make_run(root, "c", "kto", "online", True, 0, task="arithmetic", win=0.6, acc=0.9, wall=12.0)
    rep = build_report(root)
    row = read_csv(root / "report.csv")[("summarize", "dpo", "offline")]
    assert row["accuracy_mean"] == "" and row["accuracy_std"] == ""
    assert float(row["reward_mean"]) == pytest.approx(0.44)
    md = rep.markdown
    summ = md.split("## Task `summarize`", 1)[1].split("##", 1)[0]
    assert "judge reward 0.440 ± 0.028" in summ and "acc " not in summ and "no verifier" in summ
    arith = md.split("## Task `arithmetic`", 1)[1].split("##", 1)[0]
    assert "acc 0.900" in arith and "judge reward" not in arith.split("|---|", 1)[1]
    assert "unclamped_fraction.png" in rep.files  # the humanline run in the other task


def test_skipped_plots_are_reported(tmp_path):
    root = tmp_path / "runs"
    d = make_run(root, "a", "dpo", "offline", False, 0, win=0.6, acc=0.7, wall=10.0)
    (d / "logratios.jsonl").unlink()
    rep = build_report(root)
    assert set(rep.skipped_plots) == {"unclamped_fraction.png", "logratio_hist.png", "eval_vs_step.png",
                                      "final_scores.png"}
    assert "`final_scores.png` skipped: no regime has an accuracy over two or more seeds" in rep.markdown
    assert "`logratio_hist.png` skipped: no run wrote logratios.jsonl" in rep.markdown
    assert not (root / "logratio_hist.png").exists()
    assert "Failed or incomplete runs\n\nnone" in rep.markdown


def test_main_report_errors(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main_report([str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("humanline: error: no run dirs under") and err.count("\n") == 1
    assert main_report([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("humanline: error: no such directory") and err.count("\n") == 1


def test_main_report_prints_table(runs_dir, tmp_path, capsys):
    assert main_report([str(runs_dir), "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "humanline-offline" in out and "grpo" in out and "5.00x" in out
    assert "loss is nan at step 3" in out
    assert (tmp_path / "o" / "report.csv").is_file()


def test_wandb_failure_does_not_fail_report(runs_dir, monkeypatch, capsys):
    import wandb

    def boom(*a, **k):
        raise RuntimeError("no wandb today")

    monkeypatch.setattr(wandb, "init", boom)
    rep = build_report(runs_dir, wandb_mode="offline")
    assert rep.wandb_error == "RuntimeError: no wandb today"
    assert "humanline: warning: wandb" in capsys.readouterr().err
    assert (runs_dir / "report.md").is_file()


def test_wandb_offline_logs(runs_dir, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    rep = build_report(runs_dir, wandb_mode="offline")
    assert rep.wandb_error is None
    assert list((runs_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    # a second report over the same root does not mistake wandb/ for a run dir
    assert len(build_report(runs_dir).frame) == len(rep.frame)


def test_final_scores_plot_pairs_seeds_and_draws_the_t_interval(tmp_path, monkeypatch):
    """final_scores.png: per regime each seed's last accuracy, joined by seed across regimes, and the mean with its
    95% t-interval (hand-computed: 3 seeds 0.6, 0.7, 0.8 -> 0.7 +- t(0.975, 2) x 0.1 / sqrt(3) = 0.7 +- 0.248414)."""
    from humanline_cli.report import plots as report_plots

    drawn, save = {}, report_plots.save_figure

    def spy(fig, path, *args, **kwargs):
        if path.name == "final_scores.png":
            ax = fig.axes[0]
            drawn["seeds"] = [list(map(float, ln.get_ydata())) for ln in ax.lines if ln.get_color() == "tab:gray"
                              and ln.get_linestyle() == "-"]
            drawn["bars"] = [(float(c.lines[0].get_ydata()[0]), *map(float, c.lines[2][0].get_segments()[0][:, 1]))
                             for c in ax.containers]
            drawn["ticks"] = [t.get_text() for t in ax.get_xticklabels()]
        return save(fig, path, *args, **kwargs)

    monkeypatch.setattr(report_plots, "save_figure", spy)
    root = tmp_path / "runs"
    for seed, (off, hl) in enumerate(((0.6, 0.5), (0.7, 0.9), (0.8, 0.7))):
        make_run(root, f"off{seed}", "dpo", "offline", False, seed, win=0.6, acc=off, wall=10.0)
        make_run(root, f"hl{seed}", "dpo", "offline", True, seed, win=0.6, acc=hl, wall=10.0)
    rep = build_report(root)
    assert "final_scores.png" in rep.files and (root / "final_scores.png").read_bytes()[:8] == PNG_SIGNATURE
    assert drawn["ticks"] == ["offline", "humanline-offline"]  # plain, then humanline on the same data
    assert sorted(drawn["seeds"]) == [[0.6, 0.5], [0.7, 0.9], [0.8, 0.7]]  # one line per seed, paired
    half = 4.302652729749464 * 0.1 / 3 ** 0.5
    (m0, lo0, hi0), (m1, lo1, hi1) = drawn["bars"]
    assert (m0, lo0, hi0) == pytest.approx((0.7, 0.7 - half, 0.7 + half), abs=1e-12)
    assert m1 == pytest.approx(0.7, abs=1e-12)
    assert hi1 - lo1 == pytest.approx(2 * 4.302652729749464 * 0.2 / 3 ** 0.5, abs=1e-12)


def _with_commit(run: Path, commit: str) -> Path:
    import json

    s = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**s, "git_commit": commit}))
    return run


def test_runs_of_different_commits_are_kept_apart_unless_pooled(tmp_path, capsys):
    """Two runs of one config from different code are not n=2 seeds: each commit gets its own cell, named; the
    report says so, and --pool-commits pools them."""
    root = tmp_path / "runs"
    _with_commit(make_run(root, "a", "dpo", "offline", False, 0, win=0.6, acc=0.7, wall=10.0), "a" * 40)
    _with_commit(make_run(root, "b", "dpo", "offline", False, 1, win=0.8, acc=0.9, wall=10.0), "b" * 40)
    assert main_report([str(root), "--out", str(tmp_path / "apart")]) == 0
    rows = list(csv.DictReader(open(tmp_path / "apart" / "report.csv")))
    assert sorted((r["git_commit"], r["n_seeds"]) for r in rows) == [("a" * 40, "1"), ("b" * 40, "1")]
    note = f"Runs of 2 commits ({'a' * 12}, {'b' * 12}) are kept apart by a git_commit label, never pooled as seeds"
    assert note in (tmp_path / "apart" / "report.md").read_text() and note in capsys.readouterr().out
    assert main_report([str(root), "--out", str(tmp_path / "pooled"), "--pool-commits"]) == 0
    (row,) = list(csv.DictReader(open(tmp_path / "pooled" / "report.csv")))
    assert row["n_seeds"] == "2" and "git_commit" not in row and float(row["accuracy_mean"]) == pytest.approx(0.8)
    assert "pooled as seeds (--pool-commits)" in (tmp_path / "pooled" / "report.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--margin", "inf"], "argument --margin: expected a finite number > 0, got 'inf'"),
    (["--margin", "0"], "argument --margin: expected a finite number > 0, got '0'"),
    (["--accuracy", "nan"], "argument --accuracy: expected a finite number in [0, 1], got 'nan'"),
    (["--accuracy", "5"], "argument --accuracy: expected a finite number in [0, 1], got '5'"),
    (["--accuracy", "x"], "argument --accuracy: expected a number, got 'x'"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_report_argument_errors_are_one_line(runs_dir, capsys, args, message):
    with pytest.raises(SystemExit) as e:
        main_report([str(runs_dir), *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == f"humanline: error: report: {message} (--help shows the usage)\n"


def test_report_out_on_an_existing_file_is_one_clear_line(runs_dir, tmp_path, capsys):
    (tmp_path / "taken").write_text("x")
    assert main_report([str(runs_dir), "--out", str(tmp_path / "taken")]) == 2
    assert capsys.readouterr().err == (f"humanline: error: --out {tmp_path / 'taken'} is a file; name a directory "
                                       f"for report.md, report.csv and the plots\n")
