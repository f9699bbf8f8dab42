"""A study's per-run CSV (`humanline report DIR --export-csv FILE`) rebuilds every table of its report with
`humanline report --from-csv FILE`: the same report.csv, gap_closed.csv, cost.csv and async.csv byte for byte,
and the same report.md but for its title and the plots drawn from per-step logs the CSV leaves out."""
from __future__ import annotations

import csv
import json
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
