"""The fair study's registered primary (TOST with Holm over three arms) and secondary off a study CSV, on hand-made
runs with hand-computed numbers: at 3 seeds (2 degrees of freedom) the t distribution's tail is closed-form,
P(T >= t) = (1 - t / sqrt(t^2 + 2)) / 2, so every p-value below is worked by hand."""
from __future__ import annotations

import math
import subprocess

import pandas as pd
import pytest

from humanline_cli.lab.study_check import main

SEEDS = (0, 1, 2)
ONLINE = (0.97, 0.96, 0.98)
# online - H per seed: mean 0 (SD 0.01), mean 0.027 (SD 0.01), mean 0.10 (SD 0.02)
DIFFS = {"hl_stale_once_sync1_lo1": (0.01, -0.01, 0.0), "hl_stale_once_sync16_lo15": (0.037, 0.017, 0.027),
         "hl_stale_once_sync1_open": (0.10, 0.12, 0.08)}
STALE = (0.50, 0.55, 0.60)
COMMIT = "a" * 40


def _tail(t: float) -> float:  # P(T >= t) for T ~ t(2)
    return (1 - t / math.sqrt(t * t + 2)) / 2


def _csv(tmp_path, drop=(), commit=COMMIT, dirty=(), extra=()):
    greedy = {"online": ONLINE, "hl_online": ONLINE, "stale_once": STALE,
              **{h: tuple(o - d for o, d in zip(ONLINE, ds)) for h, ds in DIFFS.items()}}
    rows = []
    for seed in SEEDS:
        for regime, finals in greedy.items():
            if (regime, seed) in drop:
                continue
            rows.append({"run": f"{regime}_seed{seed}", "status": "complete", "regime": regime, "seed": seed,
                         "git_commit": commit, "git_dirty": (regime, seed) in dirty,
                         "greedy_final": finals[seed], "sampled_final": finals[seed] - 0.1 * (regime == "online")})
    rows += list(extra)
    path = tmp_path / "study.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


def _row(out: str, h: str, metric: str, table: int = 0) -> list[str]:
    hits = [line for line in out.splitlines() if line.startswith(f"| {h} | {metric} |")]
    return [c.strip() for c in hits[table].strip("|").split("|")]


def test_holm_over_three_declares_only_what_survives_its_step_down(tmp_path, capsys):
    assert main([str(_csv(tmp_path)), "--seeds", "0-2"]) == 0
    out = capsys.readouterr().out
    assert "seeds with all 6 regimes: 3 of 3" in out and "INCOMPLETE" not in out
    se = 0.01 / math.sqrt(3)
    # H1: mean 0, SD 0.01: both one-sided p equal P(T >= 0.05 / se) = P(T >= 8.6603) = 0.006536
    p1 = _tail(0.05 / se)
    assert p1 == pytest.approx(0.006536, abs=1e-6)
    # H2: mean 0.027: the upper test binds, P(T >= 0.023 / se) = P(T >= 3.9837) = 0.028815; its 90% interval
    # 0.027 -+ t(0.95, 2) se = 0.027 -+ 2.919986 x 0.0057735 lies inside [-0.05, 0.05], so it alone would pass
    p2 = _tail(0.023 / se)
    assert p2 == pytest.approx(0.028815, abs=1e-5)
    half = 2.919986 * se
    # H3: mean 0.10, SD 0.02: P(T >= (0.05 - 0.10) / se3) = 1 - P(T >= 4.3301) = 0.975293
    p3 = 1 - _tail(0.05 / (0.02 / math.sqrt(3)))
    assert p3 == pytest.approx(0.975293, abs=1e-6)
    # Holm, m = 3: 0.006536 <= 0.05 / 3 rejects; 0.028815 > 0.05 / 2 stops the step-down there
    h1, h2, h3 = (_row(out, h, "greedy") for h in DIFFS)
    assert h1 == ["hl_stale_once_sync1_lo1", "greedy", "3", "+0.0000", "0.0100",
                  f"[{-half:+.4f}, {half:+.4f}]", f"{p1:.4f}", "0.0167", "equivalent within +-0.05 (Holm)"]
    assert h2 == ["hl_stale_once_sync16_lo15", "greedy", "3", "+0.0270", "0.0100",
                  f"[{0.027 - half:+.4f}, {0.027 + half:+.4f}]", "0.0288", "0.0250", "not shown equivalent (Holm)"]
    assert f"[{0.027 - half:+.4f}, {0.027 + half:+.4f}]" == "[+0.0101, +0.0439]"  # inside the margin
    assert h3[3:5] == ["+0.1000", "0.0200"] and h3[6:] == [f"{p3:.4f}", "0.0500", "not shown equivalent (Holm)"]
    # sampled is reported and decides nothing (online's sampled is 0.1 below its greedy: online - H1 = -0.09, -0.11, -0.10)
    assert _row(out, "hl_stale_once_sync1_lo1", "sampled")[3:5] == ["-0.1000", "0.0100"]
    assert _row(out, "hl_stale_once_sync1_lo1", "sampled")[-2:] == ["–", "reported, decides nothing"]
    # secondary: H1 - stale_once = 0.46, 0.42, 0.38: mean 0.42, SD 0.04, 95% half-width 4.302653 x 0.04 / sqrt 3
    half95 = 4.302653 * 0.04 / math.sqrt(3)
    assert _row(out, "hl_stale_once_sync1_lo1", "greedy", 1) == [
        "hl_stale_once_sync1_lo1", "greedy", "3", "+0.4200", f"[{0.42 - half95:+.4f}, {0.42 + half95:+.4f}]", "above 0"]
    assert f"{0.42 - half95:.4f}" == "0.3206"


def test_a_missing_run_or_a_dirty_start_decides_nothing(tmp_path, capsys):
    assert main([str(_csv(tmp_path, drop=[("stale_once", 2)])), "--seeds", "0-2"]) == 0
    out = capsys.readouterr().out
    assert "seeds with all 6 regimes: 2 of 3" in out and "INCOMPLETE" in out
    # the primary of H1 still has its 3 seeds, and is reported without a decision
    assert _row(out, "hl_stale_once_sync1_lo1", "greedy")[2] == "3"
    assert _row(out, "hl_stale_once_sync1_lo1", "greedy")[-1] == "incomplete: decides nothing"
    assert _row(out, "hl_stale_once_sync1_lo1", "greedy", 1)[2] == "2"
    # a run started on a dirty checkout does not count, and is named
    assert main([str(_csv(tmp_path, dirty=[("online", 1)])), "--seeds", "0-2"]) == 0
    out = capsys.readouterr().out
    assert "excluded: online seed 1: not started on a clean checkout" in out
    assert "runs counted per regime (of 3 seeds): online 2," in out and "INCOMPLETE" in out
    # a seed outside the registered ones is not read
    other = {"run": "online_seed9", "status": "complete", "regime": "online", "seed": 9, "git_commit": COMMIT,
             "git_dirty": False, "greedy_final": 0.0, "sampled_final": 0.0}
    assert main([str(_csv(tmp_path, extra=[other])), "--seeds", "0-2"]) == 0
    assert "online 3," in capsys.readouterr().out


def _git(repo, *args) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


def test_only_runs_started_after_the_registering_commit_count(tmp_path, capsys):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    commits = []
    for name in ("before", "registered", "after"):
        _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", name)
        commits.append(_git(repo, "rev-parse", "HEAD"))
    before, registered, after = commits
    early = {"run": "x", "status": "complete", "regime": "online", "seed": 0, "git_commit": before,
             "git_dirty": False, "greedy_final": 1.0, "sampled_final": 1.0}
    elsewhere = {**early, "seed": 5, "git_commit": "f" * 40}  # a commit no branch of this repository has
    csv = _csv(tmp_path, commit=after, drop=[("online", 0)], extra=[early, elsewhere])
    assert main([str(csv), "--seeds", "0-2,5", "--registered", registered, "--repo", str(repo)]) == 0
    out = capsys.readouterr().out
    assert f"excluded: online seed 5: started on fffffff, a commit the repository at {repo} lacks" in out
    assert f"excluded: online seed 0: started on {before[:7]}, not at or after the registering commit" in out
    assert f"started on: {after[:7]} (17 runs, clean)" in out and "INCOMPLETE" in out
    # the same runs, registered at the first commit: all 18 count
    assert main([str(csv), "--seeds", "0-2", "--registered", before, "--repo", str(repo)]) == 0
    out = capsys.readouterr().out
    assert "excluded" not in out and "seeds with all 6 regimes: 3 of 3" in out
    assert "| hl_stale_once_sync1_lo1 | greedy | 3 | +0.0100 |" in out  # online seed 0 at 1.0: 0.04, -0.01, 0


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    csv = _csv(tmp_path)
    assert main([str(csv), "--seeds", "zero"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--seeds 'zero'" in err
    assert main([str(tmp_path / "missing.csv")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a study CSV" in err
    twice = {"run": "y", "status": "complete", "regime": "online", "seed": 1, "git_commit": COMMIT, "git_dirty": False,
             "greedy_final": 0.5, "sampled_final": 0.5}
    assert main([str(_csv(tmp_path, extra=[twice])), "--seeds", "0-2"]) == 2
    assert "two complete runs of the same regime and seed: online seed 1" in capsys.readouterr().err


def test_the_cpus_the_counted_runs_ran_on_and_the_seeds_they_split():
    from humanline_cli.lab.study_check import ran_on

    runs = pd.DataFrame({"seed": [0, 0, 1, 1, 2], "cpu": ["Intel Xeon", "Intel Xeon", "Intel Xeon", "AMD EPYC",
                                                           "AMD EPYC"]})
    assert ran_on(runs) == "ran on: AMD EPYC (2 runs), Intel Xeon (3 runs); seeds with arms on more than one CPU: 1"


def test_a_csv_without_machines_counts_its_runs_on_an_unknown_cpu(tmp_path, capsys):
    assert main([str(_csv(tmp_path))]) == 0
    assert "ran on: ? (18 runs); seeds with arms on more than one CPU: 0" in capsys.readouterr().out
