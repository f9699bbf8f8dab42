"""A study's per-run CSV (`humanline report DIR --export-csv FILE`) rebuilds every table of its report with
`humanline report --from-csv FILE`: the same report.csv, gap_closed.csv, cost.csv and async.csv byte for byte,
and the same report.md but for its title and the plots drawn from per-step logs the CSV leaves out."""
from __future__ import annotations

import csv
import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from humanline_cli.report.aggregate import main_report

GOLDEN = Path(__file__).resolve().parent / "golden"

TABLES = ("report.csv", "gap_closed.csv", "cost.csv", "async.csv")


def _sections(md: str) -> dict:
    head, *rest = md.split("\n## ")
    return {s.split("\n", 1)[0]: s for s in rest}


@pytest.mark.parametrize("study", ["study", "regimes"])
def test_report_from_csv_rebuilds_every_table(tmp_path, study):
    root = tmp_path / study
    shutil.copytree(GOLDEN / study, root)
    assert main_report([str(root), "--out", str(tmp_path / "dirs"), "--margin", "0.05",
                        "--export-csv", str(tmp_path / f"{study}.csv")]) == 0
    rows = list(csv.DictReader(open(tmp_path / f"{study}.csv", newline="")))
    assert len(rows) == len([d for d in root.rglob("*") if (d / ".hydra").is_dir()])
    shutil.rmtree(root)  # the CSV alone from here on
    assert main_report(["--from-csv", str(tmp_path / f"{study}.csv"), "--out", str(tmp_path / "csv"),
                        "--margin", "0.05"]) == 0
    for name in TABLES:
        if (tmp_path / "dirs" / name).exists():
            assert (tmp_path / "csv" / name).read_bytes() == (tmp_path / "dirs" / name).read_bytes(), name
    a, b = ((tmp_path / d / "report.md").read_text() for d in ("dirs", "csv"))
    assert b.startswith(f"# humanline report: `{tmp_path / f'{study}.csv'}`")
    sa, sb = _sections(a), _sections(b)
    assert sa.keys() == sb.keys() and "Paired differences" in sa
    assert {k: v for k, v in sa.items() if k != "Plots"} == {k: v for k, v in sb.items() if k != "Plots"}


def test_export_row_says_what_a_reader_checks(tmp_path):
    out = tmp_path / "study.csv"
    assert main_report([str(GOLDEN / "study"), "--out", str(tmp_path / "r"), "--export-csv", str(out)]) == 0
    rows = {r["run"]: r for r in csv.DictReader(open(out, newline=""))}
    r = rows["grpo/online_0"]
    s = json.loads((GOLDEN / "study" / "grpo" / "online_0" / "summary.json").read_text())
    assert float(r["greedy_final"]) == s["eval"]["greedy"]["accuracy"] and float(r["sampled_final"]) == s["eval"]["accuracy"]
    assert json.loads(r["wall_clock_s"]) == s["wall_clock_s"]
    assert len(r["config_hash"]) == 12 and r["status"] == "complete"
    # two seeds of one config share its hash; the seed is not part of it
    assert rows["grpo/online_1"]["config_hash"] == r["config_hash"] != rows["grpo/offline_0"]["config_hash"]
    assert rows["kto/failed"]["status"] == "failed" and rows["kto/failed"]["reason"] == "RuntimeError: out of memory"


def test_from_csv_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "x.csv").write_text("a,b\n1,2\n")
    assert main_report(["--from-csv", str(tmp_path / "x.csv"), "--out", str(tmp_path / "o")]) == 2
    assert "missing columns" in capsys.readouterr().err
    assert main_report(["--from-csv", str(tmp_path / "x.csv")]) == 2
    assert "--from-csv needs --out" in capsys.readouterr().err
    assert main_report([str(tmp_path), "--from-csv", str(tmp_path / "x.csv"), "--out", str(tmp_path / "o")]) == 2
    assert not (tmp_path / "o").exists()


def test_an_interpolated_family_key_resolves_from_the_csv(tmp_path):
    """A stale regime written `generate_every: ${train.generation_span}` (as `${train.steps}` is in the SmolLM2
    studies), where the key it names is the same in every run: the CSV keeps that key too, so the rebuilt report
    still reads those runs as stale-4 (not online) and its tables are the run dirs' byte for byte."""
    root = tmp_path / "study"
    shutil.copytree(GOLDEN / "study", root)
    configs = list(root.rglob(".hydra/config.yaml"))
    for f in configs:
        cfg = yaml.safe_load(f.read_text())
        cfg["train"]["generation_span"] = 4
        if cfg["data"].get("generate_every") == 4:
            cfg["data"]["generate_every"] = "${train.generation_span}"
        f.write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert sum("${train.generation_span}" in f.read_text() for f in configs) == 6
    assert main_report([str(root), "--out", str(tmp_path / "dirs"), "--export-csv", str(tmp_path / "s.csv")]) == 0
    rows = list(csv.DictReader(open(tmp_path / "s.csv", newline="")))
    assert {json.loads(r["config"]).get("train.generation_span") for r in rows if r["config"]} == {4}
    shutil.rmtree(root)
    assert main_report(["--from-csv", str(tmp_path / "s.csv"), "--out", str(tmp_path / "csv")]) == 0
    families = {line.split(",")[2] for line in (tmp_path / "csv" / "report.csv").read_text().splitlines()[1:]}
    assert {"stale-4", "humanline-stale-4", "online"} <= {f.strip('"').split(" (")[0] for f in families}
    for name in ("report.csv", "gap_closed.csv", "cost.csv"):
        assert (tmp_path / "csv" / name).read_bytes() == (tmp_path / "dirs" / name).read_bytes(), name


def _part(tmp_path, name, seeds):
    root = tmp_path / name
    root.mkdir()
    shutil.copy(GOLDEN / "regimes" / "multirun.yaml", root)
    for d in (GOLDEN / "regimes").iterdir():
        if d.is_dir() and int(d.name.rsplit("_", 1)[1]) in seeds:
            shutil.copytree(d, root / d.name)
    return root


def test_append_keeps_the_files_rows_and_adds_only_complete_runs_it_lacks(tmp_path, capsys):
    """A study made in two parts whose first part's run dirs are gone (another machine): exporting the first, then
    appending the second, gives the file one export of all the run dirs gives, byte for byte; appending again adds
    nothing, and an incomplete run is not added until it completes."""
    full = tmp_path / "full.csv"
    assert main_report([str(GOLDEN / "regimes"), "--out", str(tmp_path / "r0"), "--export-csv", str(full)]) == 0
    first, second = _part(tmp_path, "first", {0}), _part(tmp_path, "second", {1})
    parts = tmp_path / "parts.csv"
    assert main_report([str(first), "--out", str(tmp_path / "r1"), "--export-csv", str(parts), "--append"]) == 0
    assert [r["run"] for r in csv.DictReader(open(parts, newline=""))] == ["offline_0", "online_0", "hl_0"]
    shutil.rmtree(first)
    summary = second / "hl_1" / "summary.json"
    done = summary.read_text()
    summary.write_text(json.dumps({**json.loads(done), "status": "incomplete"}))
    assert main_report([str(second), "--out", str(tmp_path / "r2"), "--export-csv", str(parts), "--append"]) == 0
    assert "added 2 runs" in capsys.readouterr().out
    assert [r["run"] for r in csv.DictReader(open(parts, newline=""))] == [
        "offline_0", "offline_1", "online_0", "online_1", "hl_0"]
    summary.write_text(done)
    assert main_report([str(second), "--out", str(tmp_path / "r3"), "--export-csv", str(parts), "--append"]) == 0
    assert parts.read_bytes() == full.read_bytes()
    assert main_report([str(second), "--out", str(tmp_path / "r4"), "--export-csv", str(parts), "--append"]) == 0
    assert "added 0 runs" in capsys.readouterr().out and parts.read_bytes() == full.read_bytes()


def test_append_refuses_a_run_whose_config_differs_from_its_regimes_kept_runs(tmp_path, capsys):
    parts = tmp_path / "parts.csv"
    first, second = _part(tmp_path, "first", {0}), _part(tmp_path, "second", {1})
    assert main_report([str(first), "--out", str(tmp_path / "r1"), "--export-csv", str(parts), "--append"]) == 0
    before = parts.read_bytes()
    def triple_lr(run):
        config = second / run / ".hydra" / "config.yaml"
        cfg = yaml.safe_load(config.read_text())
        cfg["train"]["lr"] = cfg["train"]["lr"] * 3
        config.write_text(yaml.safe_dump(cfg, sort_keys=False))

    triple_lr("online_1")  # the new runs differ in a key the file's rows do not keep
    assert main_report([str(second), "--out", str(tmp_path / "r2"), "--export-csv", str(parts), "--append"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("these runs differ in config keys its rows do not keep (train.lr); export every run dir "
                        "together instead") and "\n" not in err
    for run in ("offline_1", "hl_1"):  # all of them at another lr: each regime's hash differs from the file's
        triple_lr(run)
    assert main_report([str(second), "--out", str(tmp_path / "r2"), "--export-csv", str(parts), "--append"]) == 2
    err = capsys.readouterr().err.strip()
    assert re.search(r"run (offline|hl)_1 has config hash [0-9a-f]{12}, its regime '(offline|hl)' there has "
                     r"[0-9a-f]{12}$", err)
    assert parts.read_bytes() == before
    assert main_report([str(second), "--out", str(tmp_path / "r3"), "--append"]) == 2
    assert "--append needs --export-csv" in capsys.readouterr().err


def test_a_csv_that_cannot_be_written_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "taken").mkdir()  # a folder where the file should go: the rename over it fails
    assert main_report([str(GOLDEN / "regimes"), "--out", str(tmp_path / "r"), "--export-csv",
                        str(tmp_path / "taken")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"humanline: error: cannot write {tmp_path / 'taken'}") and "\n" not in err
    assert not (tmp_path / "taken.tmp").exists()


def test_append_replaces_a_row_that_started_dirty_with_a_clean_rerun_only(tmp_path, capsys):
    """A kept row whose run started on a dirty checkout gives way to a clean rerun of that run (and to nothing else):
    a rerun that started dirty again, or a clean run whose row was clean, leaves the file as it is."""
    part = _part(tmp_path, "part", {0})
    summary = part / "hl_0" / "summary.json"
    done = json.loads(summary.read_text())
    parts = tmp_path / "parts.csv"

    def append(s, out):
        summary.write_text(json.dumps(s))
        assert main_report([str(part), "--out", str(tmp_path / out), "--export-csv", str(parts), "--append"]) == 0
        return capsys.readouterr().out, {r["run"]: r for r in csv.DictReader(open(parts, newline=""))}

    _, rows = append({**done, "git_dirty": True}, "r1")
    assert rows["hl_0"]["git_dirty"] == "True" and len(rows) == 3
    before = parts.read_bytes()
    out, _ = append({**done, "git_dirty": True, "eval": {**done["eval"], "accuracy": 0.125}}, "r2")
    assert "added 0 runs" in out and parts.read_bytes() == before
    out, rows = append({**done, "git_dirty": False, "eval": {**done["eval"], "accuracy": 0.125}}, "r3")
    assert "added 1 runs" in out and list(rows) == ["offline_0", "online_0", "hl_0"]
    assert rows["hl_0"]["git_dirty"] == "False" and float(rows["hl_0"]["sampled_final"]) == 0.125
    assert {k: rows[k] for k in ("offline_0", "online_0")} == {
        r["run"]: r for r in csv.DictReader(before.decode().splitlines()) if r["run"] != "hl_0"}
    after = parts.read_bytes()
    out, _ = append({**done, "git_dirty": False, "eval": {**done["eval"], "accuracy": 0.25}}, "r4")
    assert "added 0 runs" in out and parts.read_bytes() == after
