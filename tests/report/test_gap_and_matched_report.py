"""`humanline report` end to end over small hand-written run dirs: gap closed as a ratio of means with its
Fieller interval, and matched quality as censored times to a target with "k of n seeds reached"; every
expected number is worked out here."""
from __future__ import annotations

import json

import pytest

from humanline_cli.report.aggregate import build_report, main_report
from tests.helpers.runs import config, run_dir

# greedy accuracy at the end of each seed's run; x = humanline - offline = 0.10, 0.18, 0.10 and
# y = online - offline = 0.16, 0.26, 0.24
FINAL = {"off": [0.60, 0.62, 0.64], "on": [0.76, 0.88, 0.88], "hl": [0.70, 0.80, 0.74]}
MID = {"off": 0.55, "on": 0.70, "hl": 0.60}     # the mid-run evaluation at step 10 of 20
SECONDS = {"off": 10.0, "on": 40.0, "hl": 10.0}  # loop seconds of the whole run; step 10 at half of it


def _sweep(root) -> None:
    cfgs = {"off": lambda s: config(obj="grpo", seed=s), "on": lambda s: config(obj="grpo", regime="online", seed=s),
            "hl": lambda s: config(obj="grpo", humanline=True, seed=s)}
    for fam, finals in FINAL.items():
        for seed, final in enumerate(finals):
            d = run_dir(root, f"{fam}{seed}", cfgs[fam](seed), win=0.6, wall=SECONDS[fam], acc=final)
            s = json.loads((d / "summary.json").read_text())
            s["steps"] = 20
            s["eval"]["greedy"] = {"accuracy": final, "start_accuracy": 0.5}
            s["wall_clock_s"] = {"train": SECONDS[fam], "total": SECONDS[fam]}
            (d / "summary.json").write_text(json.dumps(s))
            half = SECONDS[fam] / 2
            rows = [{"step": 10, "loss": 0.1, "time/train": half, "wall_s": half},
                    {"step": 10, "eval/greedy/accuracy": MID[fam]}]
            (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _line(md: str, section: str, start: str) -> str:
    body = md.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return next(x for x in body.splitlines() if x.startswith(start))


def test_report_prints_gap_closed_with_fieller_and_matched_quality_with_censoring(tmp_path, capsys):
    root = tmp_path / "sweep"
    _sweep(root)
    assert main_report([str(root), "--accuracy", "0.72"]) == 0
    md = (root / "report.md").read_text()

    # gap closed: mean(x) / mean(y) = 0.38 / 0.66 = 57.6%; Fieller in hundredths, a = 38/3, b = 22,
    # v11 = 64/9, v22 = 28/3, v12 = 16/3, t(0.975, 2)^2 = 18.512820: qa = 484 - 172.7863 = 311.2137,
    # qb = 278.6667 - 98.7350 = 179.9316, qc = 160.4444 - 131.6467 = 28.7978;
    # R = (179.9316 -+ sqrt(32375.4 - 8962.2)) / 311.2137 = 0.0865, 1.0698
    # at equal quality: the target is start + 0.9 x (online's mean final - start) = 0.5 + 0.9 x 0.34 = 0.806;
    # online reaches it on 2 of 3 seeds (0.76 ends short), humanline on none (0.70, 0.80, 0.74 end short), so
    # humanline's median is undefined: no ratio
    gap = _line(md, "Gap closed", "| arithmetic | grpo")
    assert ("| 0.620 | 0.840 | 0.747 | 58% [9%, 107%] | 3 | 4.00x | – (reached: online 2 of 3, humanline 0 of 3) |"
            in gap), gap
    csv = (root / "gap_closed.csv").read_text().splitlines()
    row = dict(zip(csv[0].split(","), csv[1].split(",")))
    assert float(row["gap_closed"]) == pytest.approx(0.575758, abs=1e-6)
    assert (float(row["gap_closed_lo"]), float(row["gap_closed_hi"])) == pytest.approx((0.0864939, 1.06983), abs=1e-5)
    assert row["gap_verdict"] == "gap" and row["speedup_equal_quality"] == "" and row["online_never_reached"] == "1"

    # matched quality at the named target 0.72:
    # online: from (step 10, 20 s, 0.70) to (step 20, 40 s, final): seed 0 at 20 + 20 x 0.02 / 0.06 = 26.67 s,
    #   seeds 1, 2 at 20 + 20 x 0.02 / 0.18 = 22.22 s (step 11.11); median 22.22 s
    # humanline: from (step 10, 5 s, 0.60) to (step 20, 10 s, final): seed 0 ends at 0.70 (censored at 10 s),
    #   seed 1 at 5 + 5 x 0.12 / 0.20 = 8.0 s, seed 2 at 5 + 5 x 0.12 / 0.14 = 9.29 s (step 18.57); Kaplan-Meier:
    #   the share short of it is 2/3 after 8.0 s, 2/3 x 1/2 = 1/3 after 9.29 s: median 9.29 s
    #   (a mean over the seeds that reached it would say 8.64 s, and the ratio 2.57x)
    # speedup 22.22 / 9.29 = 2.39x; at equal steps 40 / 10 = 4.00x
    assert _line(md, "Speedup at matched quality", "| arithmetic | grpo | online |") == (
        "| arithmetic | grpo | online | 3 of 3 | 11.1 | 22.2 | 1.00x | 1.00x |")
    assert _line(md, "Speedup at matched quality", "| arithmetic | grpo | humanline-offline |") == (
        "| arithmetic | grpo | humanline-offline | 2 of 3 (not reached: 1) | 18.6 | 9.3 | 2.39x | 4.00x |")
    assert _line(md, "Speedup at matched quality", "| arithmetic | grpo | offline |") == (
        "| arithmetic | grpo | offline | 0 of 3 (not reached: 3) | – | – | – | 4.00x |")
    assert "greedy accuracy 0.72 (named (--accuracy))" in md
    out = capsys.readouterr().out
    assert "58% [9%, 107%]" in out and "2 of 3 (not reached: 1) | 18.6 | 9.3 | 2.39x" in out
    assert "bootstrap (prompt-level only)" in out


def test_default_matched_target_is_a_share_of_online_gain(tmp_path):
    root = tmp_path / "sweep"
    _sweep(root)
    md = build_report(root).markdown
    # 0.5 + 0.9 x (0.84 - 0.5) = 0.806: online seed 0 ends at 0.76 (censored at 40 s); seeds 1, 2 reach it at
    # 20 + 20 x 0.106 / 0.18 = 31.78 s; Kaplan-Meier: 3 at risk, 2 reach it there, 1/3 short: median 31.78 s
    assert "greedy accuracy 0.806 (start 0.5 + 0.9 x (online's mean final 0.84 - start))" in md
    assert _line(md, "Speedup at matched quality", "| arithmetic | grpo | online |") == (
        "| arithmetic | grpo | online | 2 of 3 (not reached: 1) | 15.9 | 31.8 | 1.00x | 1.00x |")
    assert _line(md, "Speedup at matched quality", "| arithmetic | grpo | humanline-offline |") == (
        "| arithmetic | grpo | humanline-offline | 0 of 3 (not reached: 3) | – | – | – | 4.00x |")


def test_seconds_at_an_evaluation_between_two_logged_train_rows(tmp_path):
    """train.log_every 10, eval.every 15 of 20 steps: no train row at the evaluation's step 15, its work and loop
    seconds lie between the rows at 10 and 20. W seconds a run (online 40, the others 10), 0.4 W of them by step
    10 (setup 1 s left out), so 0.4 W + 0.5 x 0.6 W = 0.7 W at step 15."""
    finals = {"off": [0.60, 0.62], "on": [0.80, 0.84], "hl": [0.80, 0.76]}
    cfgs = {"off": lambda s: config(obj="grpo", seed=s), "on": lambda s: config(obj="grpo", regime="online", seed=s),
            "hl": lambda s: config(obj="grpo", humanline=True, seed=s)}
    root = tmp_path / "sweep"
    for fam, scores in finals.items():
        w = SECONDS[fam]
        for seed, final in enumerate(scores):
            d = run_dir(root, f"{fam}{seed}", cfgs[fam](seed), win=0.6, wall=w + 1, acc=final)
            s = json.loads((d / "summary.json").read_text())
            s["steps"], s["wall_clock_s"] = 20, {"setup": 1.0, "train": w, "total": w + 1}
            s["eval"]["greedy"] = {"accuracy": final, "start_accuracy": 0.5}
            (d / "summary.json").write_text(json.dumps(s))
            rows = [{"step": 10, "time/setup": 1.0, "time/train": 0.4 * w, "wall_s": 1 + 0.4 * w},
                    {"step": 15, "eval/greedy/accuracy": MID[fam], "wall_s": 2 + 0.7 * w},
                    {"step": 20, "time/setup": 1.0, "time/train": w, "wall_s": 1 + w}]
            (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rep = build_report(root)
    # at equal quality: target 0.5 + 0.9 x (0.82 - 0.5) = 0.788 on the work clock, online (0, 0.5), (28 s, 0.70),
    # (40 s, final): seed 0 reaches it at 28 + 12 x 0.088 / 0.10 = 38.56 s, seed 1 at 28 + 12 x 0.088 / 0.14 =
    # 35.543 s: median 35.543 s; humanline (0, 0.5), (7 s, 0.60), (10 s, final): seed 0 at 7 + 3 x 0.188 / 0.20 =
    # 9.82 s, seed 1 (0.76) never: median 9.82 s; 35.543 / 9.82 = 3.62x
    gap = _line(rep.markdown, "Gap closed", "| arithmetic | grpo")
    assert "| 3.62x (reached: online 2 of 2, humanline 1 of 2) |" in gap, gap
    row = next(csv_rows(rep.files["gap_closed.csv"]))
    assert float(row["speedup_equal_quality"]) == pytest.approx(35.542857 / 9.82, abs=5e-4)
    # matched quality on the loop clock (here the work clock: nothing else ran) and in steps: online at steps
    # 15 + 5 x 0.088 / 0.10 = 19.4 and 15 + 5 x 0.088 / 0.14 = 18.14, humanline at 15 + 5 x 0.188 / 0.20 = 19.7
    assert _line(rep.markdown, "Speedup at matched quality", "| arithmetic | grpo | online |") == (
        "| arithmetic | grpo | online | 2 of 2 | 18.1 | 35.5 | 1.00x | 1.00x |")
    assert _line(rep.markdown, "Speedup at matched quality", "| arithmetic | grpo | humanline-offline |") == (
        "| arithmetic | grpo | humanline-offline | 1 of 2 (not reached: 1) | 19.7 | 9.8 | 3.62x | 4.00x |")
    # a study CSV keeps the train rows around the evaluation: the report rebuilt from it reads the same seconds
    from humanline_cli.report.aggregate import report_from_csv
    from humanline_cli.report.study_csv import export

    export(root, tmp_path / "study.csv")
    again = report_from_csv(tmp_path / "study.csv", tmp_path / "from_csv").markdown
    assert _line(again, "Gap closed", "| arithmetic | grpo") == gap


def csv_rows(path):
    import csv

    with open(path, newline="") as f:
        yield from csv.DictReader(f)
