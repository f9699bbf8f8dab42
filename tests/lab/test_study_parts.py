"""A study's sweep in parts: which runs count as complete (run dirs and the kept CSV), which seeds a part gets, the
command a seed runs, and the retry of a seed whose runs were refused, with a stand-in for `humanline train -m` that
writes the summaries a real run would."""
from __future__ import annotations

import json
import sys

import pandas as pd
import pytest

from humanline_cli.lab.study_parts import (
    command,
    complete_runs,
    drop_checkpoints,
    main,
    missing,
    run_dropping,
    run_share,
    share,
    sweep_grid,
)

REGIMES = ["online", "hl_online", "stale_once", "hl_stale_once_sync1_lo1", "hl_stale_once_sync16_lo15",
           "hl_stale_once_sync1_open"]


def _summary(runs, name, status="complete"):
    (runs / name).mkdir(parents=True, exist_ok=True)
    (runs / name / "summary.json").write_text(json.dumps({"status": status}))


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
    pd.DataFrame([{"run": "online_seed0", "status": "complete", "summary": "{" + "x" * 200_000 + "}"},
                  {"run": "hl_online_seed0", "status": "failed", "summary": "{}"}]).to_csv(kept, index=False)
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
    assert command("e", 0, ["online"], None, 10, tmp_path)[3:6] == ["env", f"PYTHONPATH={tmp_path}", sys.executable]


def test_a_refused_run_is_retried_and_a_kept_run_never_reruns(tmp_path):
    runs = tmp_path / "runs"
    kept = tmp_path / "study.csv"
    pd.DataFrame([{"run": "online_seed2", "status": "complete"}]).to_csv(kept, index=False)
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
