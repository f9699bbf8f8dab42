"""A study's sweep in parts: which runs count as complete (run dirs and the kept CSV), which seeds a part gets, the
command a seed runs, and the retry of a seed whose runs were refused, with a stand-in for `humanline train -m` that
writes the summaries a real run would."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from humanline_cli.errors import UserError
from humanline_cli.lab.study_parts import (
    check_code,
    command,
    complete_runs,
    drop_checkpoints,
    main,
    missing,
    run_dropping,
    run_share,
    set_aside,
    share,
    sweep_grid,
)

REGIMES = ["online", "hl_online", "stale_once", "hl_stale_once_sync1_lo1", "hl_stale_once_sync16_lo15",
           "hl_stale_once_sync1_open"]


def _summary(runs, name, status="complete", dirty=False):
    (runs / name).mkdir(parents=True, exist_ok=True)
    (runs / name / "summary.json").write_text(json.dumps({"status": status, "git_dirty": dirty}))


def test_the_fair_study_grid_is_66_seeds_by_6_regimes():
    seeds, regimes = sweep_grid("smollm2_fair_study")
    assert seeds == list(range(66)) and regimes == REGIMES
    assert share(seeds, 0, 2) == list(range(0, 66, 2)) and share(seeds, 1, 2) == list(range(1, 66, 2))
    assert share(seeds, 2, 3) == list(range(2, 66, 3))


def test_complete_runs_come_from_run_dirs_and_the_kept_csv(tmp_path):
    runs = tmp_path / "runs"
    _summary(runs, "online_seed6")
    _summary(runs, "hl_online_seed6", status="failed")
    (runs / "stale_once_seed6").mkdir()  # in flight: no summary yet
    (runs / "hl_stale_once_sync1_lo1_seed6").mkdir()
    (runs / "hl_stale_once_sync1_lo1_seed6" / "summary.json").write_text('{"status": "compl')  # cut short
    kept = tmp_path / "study.csv"
    _summary(runs, "hl_stale_once_sync16_lo15_seed6", dirty=True)  # complete, but on uncommitted code
    pd.DataFrame([{"run": "online_seed0", "status": "complete", "git_dirty": False, "summary": "{" + "x" * 200_000 + "}"},
                  {"run": "hl_online_seed0", "status": "failed", "git_dirty": False, "summary": "{}"},
                  {"run": "stale_once_seed0", "status": "complete", "git_dirty": True, "summary": "{}"}]
                 ).to_csv(kept, index=False)
    done = complete_runs(runs, kept)
    assert done == {"online_seed6", "online_seed0"}
    assert complete_runs(runs, None) == {"online_seed6"}
    assert missing(6, REGIMES, done) == REGIMES[1:]
    assert missing(0, REGIMES, done) == REGIMES[1:]
    assert missing(1, REGIMES, done) == REGIMES


def test_a_seed_runs_only_its_missing_regimes_pinned_and_niced(tmp_path):
    assert command("smollm2_fair_study", 6, ["hl_online", "stale_once"], 1, 10) == [
        "taskset", "-c", "1", "nice", "-n", "10", sys.executable, "-m", "humanline_cli", "train", "-m",
        "experiment=smollm2_fair_study", "seed=6", "regime=hl_online,stale_once"]
    assert command("e", 0, ["online"], None, 19)[:4] == ["nice", "-n", "19", sys.executable]
    assert command("e", 0, ["online"], None, 10, tmp_path)[3:8] == ["env", f"PYTHONPATH={tmp_path}", sys.executable,
                                                                     "-P", "-m"]


def _checkout(root, *, commit=True):
    """A git checkout holding stand-in humanline_cli and conf packages."""
    for pkg in ("humanline_cli", "conf"):
        (root / pkg).mkdir(parents=True)
        (root / pkg / "__init__.py").write_text("")
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git[:3], "init", "-q"], check=True)
    if commit:
        subprocess.run([*git, "add", "."], check=True)
        subprocess.run([*git, "commit", "-qm", "code"], check=True)
    return root


def test_a_run_imports_the_code_checkout_even_from_another_checkout(tmp_path, monkeypatch):
    """`python -m` puts the working directory first on sys.path: from a directory holding another humanline_cli
    (the checkout whose runs/ the study writes to), the run must still import --code's."""
    decoy = tmp_path / "decoy"
    (decoy / "humanline_cli").mkdir(parents=True)
    (decoy / "humanline_cli" / "__init__.py").write_text("")
    monkeypatch.chdir(decoy)
    code = _checkout(tmp_path / "code")
    check_code(code)  # imports code's packages, and the checkout is clean
    argv = command("e", 0, ["online"], None, 10, code)
    python = argv[argv.index(sys.executable):argv.index("-m")]
    out = subprocess.run(["env", f"PYTHONPATH={code}", *python, "-c", "import humanline_cli; print(humanline_cli.__file__)"],
                         capture_output=True, text=True, check=True).stdout
    assert Path(out.strip()).parent == code / "humanline_cli"
    (code / "notes.txt").write_text("an untracked file makes the checkout dirty")
    with pytest.raises(UserError, match="uncommitted changes"):
        check_code(code)


def test_code_without_its_own_packages_or_git_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lone = tmp_path / "lone"
    (lone / "humanline_cli").mkdir(parents=True)
    (lone / "humanline_cli" / "__init__.py").write_text("")
    with pytest.raises(UserError, match="would not import its humanline_cli and conf"):
        check_code(lone)  # conf comes from the installed project, not from `lone`
    (lone / "conf").mkdir()
    (lone / "conf" / "__init__.py").write_text("")
    with pytest.raises(UserError, match="not a git checkout"):
        check_code(lone)


def test_a_run_started_on_a_dirty_checkout_is_set_aside_and_run_again(tmp_path):
    runs = tmp_path / "smollm2_fair_study"
    _summary(runs, "online_seed7", dirty=True)
    _summary(runs, "hl_online_seed7")
    (runs / "online_seed7" / "metrics.jsonl").write_text("{}\n")
    calls, said = [], []

    def fake_train(argv):
        calls.append(argv[-1])
        assert not (runs / "online_seed7").exists()  # the dirty run went before its rerun started
        _summary(runs, "online_seed7")

    assert run_share("e", [7], ["online", "hl_online"], runs, None, tries=2, pause=0, run=fake_train,
                     say=said.append) == []
    assert calls == ["regime=online"]
    [kept] = (tmp_path / "smollm2_fair_study_set_aside").iterdir()
    assert kept.name.startswith("online_seed7_") and (kept / "metrics.jsonl").read_text() == "{}\n"
    assert json.loads((kept / "summary.json").read_text())["git_dirty"] is True
    assert any("online_seed7: complete but started on a dirty checkout" in line for line in said)
    _summary(runs, "stale_once_seed7", dirty=True)
    assert set_aside(runs, ["stale_once_seed7", "hl_online_seed7", "online_seed7", "none_seed7"]) == ["stale_once_seed7"]
    assert (runs / "hl_online_seed7" / "summary.json").is_file() and (runs / "online_seed7" / "summary.json").is_file()


def test_a_refused_run_is_retried_and_a_kept_run_never_reruns(tmp_path):
    runs = tmp_path / "runs"
    kept = tmp_path / "study.csv"
    pd.DataFrame([{"run": "online_seed2", "status": "complete", "git_dirty": False}]).to_csv(kept, index=False)
    calls, refused = [], {"hl_online_seed2"}  # refused at setup on the first try only

    def fake_train(argv):
        calls.append(argv[-1])
        seed = int(argv[-2].removeprefix("seed="))
        for regime in argv[-1].removeprefix("regime=").split(","):
            name = f"{regime}_seed{seed}"
            if name in refused:
                refused.discard(name)
                continue
            _summary(runs, name)

    left = run_share("smollm2_fair_study", [0, 2], REGIMES[:3], runs, kept, tries=3, pause=0, run=fake_train,
                     say=lambda line: None)
    assert left == []
    assert calls == ["regime=online,hl_online,stale_once", "regime=hl_online,stale_once", "regime=hl_online"]
    assert not (runs / "online_seed2").exists()


def test_a_seed_that_never_completes_is_reported_and_the_next_seed_runs(tmp_path):
    runs = tmp_path / "runs"
    calls = []
    left = run_share("e", [0, 1], ["a", "b"], runs, None, tries=2, pause=0, say=lambda line: None,
                     run=lambda argv: (calls.append(argv[-2]), _summary(runs, f"a_{argv[-2].replace('=', '')}")))
    assert calls == ["seed=0", "seed=0", "seed=1", "seed=1"]
    assert left == ["b_seed0", "b_seed1"]


@pytest.mark.parametrize(("argv", "says"), [
    (["no_such_study"], "experiment 'no_such_study': no conf/experiment/no_such_study.yaml"),
    (["laptop_headroom"], "does not sweep seed and regime"),
    (["smollm2_fair_study", "--part", "2", "--of", "2"], "--part 2 --of 2: the part must be in [0, 2)"),
    (["smollm2_fair_study", "--kept", "missing.csv"], "--kept missing.csv: no such file"),
    (["smollm2_fair_study", "--code", "."], "--code .: not a humanline checkout"),
])
def test_bad_input_is_one_line_and_exit_2(argv, says, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("study_parts: error: ") and says in err and "\n" not in err


def test_a_csv_without_run_and_status_is_refused(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    assert main(["smollm2_fair_study", "--kept", str(bad), "--runs", str(tmp_path / "runs")]) == 2
    assert "not a study CSV" in capsys.readouterr().err


def test_only_complete_runs_lose_their_checkpoints(tmp_path):
    runs = tmp_path / "runs"
    for name, status in (("online_seed0", "complete"), ("hl_online_seed0", "failed")):
        _summary(runs, name, status)
        (runs / name / "checkpoints" / "step_40").mkdir(parents=True)
    (runs / "stale_once_seed0" / "checkpoints" / "step_8").mkdir(parents=True)  # in flight: no summary yet
    assert drop_checkpoints(runs) == 1
    assert not (runs / "online_seed0" / "checkpoints").exists()
    assert (runs / "online_seed0" / "summary.json").is_file()
    assert (runs / "hl_online_seed0" / "checkpoints" / "step_40").is_dir()
    assert (runs / "stale_once_seed0" / "checkpoints" / "step_8").is_dir()
    assert drop_checkpoints(runs) == 0


def test_checkpoints_go_as_runs_complete_while_the_multirun_goes_on(tmp_path):
    """A stand-in multirun (a real process) finishes run a, then writes run b's checkpoint and waits: a's checkpoint
    goes while b is still in flight, and b's once it completes."""
    runs = tmp_path / "runs"
    script = f"""
import json, pathlib, time
runs = pathlib.Path({str(runs)!r})
for name in ("a_seed0", "b_seed0"):
    (runs / name / "checkpoints" / "step_8").mkdir(parents=True)
    if name == "b_seed0":
        while (runs / "a_seed0" / "checkpoints").exists():
            time.sleep(0.02)
        (runs / "gone").write_text("a's checkpoint went while b ran")
    (runs / name / "summary.json").write_text(json.dumps({{"status": "complete"}}))
"""
    assert run_dropping([sys.executable, "-c", script], runs, every=0.05) == 0
    assert (runs / "gone").is_file()
    assert not (runs / "a_seed0" / "checkpoints").exists() and not (runs / "b_seed0" / "checkpoints").exists()
    assert (runs / "b_seed0" / "summary.json").is_file()
