"""The report's data frames over the golden run dirs: one row per run dir with its config and summary flattened, and
one row per run and evaluation point; the expected values follow from golden/make_runs.py."""
from __future__ import annotations

from pathlib import Path

import pytest

from humanline_cli.report.frame import load, points

STUDY = Path(__file__).resolve().parent / "golden" / "study"


def test_one_row_per_run_dir_with_config_and_summary_flattened():
    runs = load(STUDY)
    # 24 grpo + 3 dpo + 4 kto + the copy are complete; one failed.json, one without summary or failure
    assert len(runs) == 34
    assert runs.status.value_counts().to_dict() == {"complete": 32, "failed": 1, "incomplete": 1}
    failed = runs[runs.status == "failed"].iloc[0]
    assert failed.reason == "RuntimeError: out of memory" and failed.seed == 7
    assert runs[runs.status == "incomplete"].iloc[0].reason.endswith("last logged step 3")
    stale = runs[runs.family == "humanline-stale-4"]
    assert len(stale) == 3 and set(stale["cfg.data.generate_every"]) == {4} and set(stale["cfg.hl.sync_every"]) == {1}
    online0 = runs[runs.path == STUDY / "grpo" / "online_0"].iloc[0]
    assert online0["eval.greedy.accuracy"] == 0.80 and online0["wall_clock_s.total"] == 40.0
    assert online0["final_train_metrics.online/round"] == 4 and online0.family == "online"


def test_evaluation_points_carry_work_and_loop_seconds():
    runs = load(STUDY)
    i = runs.index[runs.path == STUDY / "grpo" / "online_0"][0]
    pts = points(runs.loc[[i]])
    assert set(pts.columns) == {"run", "point", "step", "wall_s", "work_s", "loop_s", "metric", "value"}
    assert (pts.run == i).all() and pts.value.notna().all()  # long: one row per point and recorded score
    greedy = pts[pts.metric == "greedy accuracy"]
    assert greedy.point.tolist() == ["start", "mid", "final"] and greedy.step.tolist() == [0, 4, 8]
    start, mid, final = (greedy.iloc[k] for k in range(3))
    win_start = pts[(pts.point == "start") & (pts.metric == "win rate")].value.tolist()
    assert start.value == 0.5 and win_start == [0.5] and start.work_s == 0.0
    # mid: the train row of step 4 timed train 8 s and sample 8 s; wall-clock 20 s less 2 s of setup
    assert (mid.work_s, mid.loop_s, mid.value) == (16.0, 18.0, 0.698)
    # end: train 16 + sample 16 + label 1.6 + sync 0.1 + push 0.05; 40 s less setup 2, eval 1, save 0.2
    assert final.work_s == pytest.approx(33.75) and final.loop_s == pytest.approx(36.8)
    sampled_final = pts[(pts.point == "final") & (pts.metric == "accuracy")].value.tolist()
    assert final.value == 0.80 and sampled_final == [pytest.approx(0.77)]


def _nested_columns(frame) -> list[str]:
    return [c for c in frame if frame[c].map(lambda x: isinstance(x, dict)).any()]


def test_the_computed_frames_hold_no_dicts(tmp_path):
    """The comparisons and the cells are tidy: a number, a text (or a list of seeds) per cell, never a dict to
    unpack, so pandas groups, pivots and writes them as they are (the loaded run rows keep their raw records)."""
    from humanline_cli.report.aggregate import build_report
    from humanline_cli.report.gap_closed import MARGIN_COLUMNS, gap_frame, gap_rows
    from humanline_cli.report.groups import collapse_duplicates

    runs = load(STUDY)
    complete = collapse_duplicates(runs[runs.status == "complete"])[0]
    gaps = gap_rows(complete, margin=0.05)
    assert len(gaps) == 4 and _nested_columns(gaps) == []  # the 4 rows of golden/expected/study/gap_closed.csv
    # a comparison's paired contrasts are columns: greedy online - offline on the grpo async-1 set, per seed
    async1 = gaps[(gaps.objective == "grpo") & (gaps.set == "async-1")].iloc[0]
    assert async1["greedy_online_minus_humanline_offline_equivalence"] == "equivalent within +-0.05"
    assert list(gap_frame(gaps).columns[-len(MARGIN_COLUMNS):]) == list(MARGIN_COLUMNS)
    rep = build_report(STUDY, tmp_path)
    assert len(rep.cells) == 13 and _nested_columns(rep.cells) == []
    assert rep.cells.n_seeds.sum() == 31  # the 32 complete run dirs less the copy, counted once
