"""Ctrl-C in `humanline eval`: one line saying the evaluation was interrupted and that a rerun evaluates again,
exit 130; not the training command's "interrupted before training" (eval trains nothing)."""
from __future__ import annotations

import signal

import pytest

from humanline_cli.cli import eval as eval_cmd
from humanline_cli.cli.main import main


def test_ctrl_c_in_eval_is_one_line_exit_130(tmp_path, monkeypatch, capsys):
    def ctrl_c(*a, **k):  # Ctrl-C while the policies generate or the judge is asked
        raise KeyboardInterrupt

    monkeypatch.setattr(eval_cmd, "evaluate_pair", ctrl_c)
    old = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit) as e:
            main(["humanline", "eval", str(tmp_path / "run")])
    finally:
        signal.signal(signal.SIGINT, old)  # the command ignores a second Ctrl-C while it reports
    assert e.value.code == 130
    assert [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()] == [
        f"humanline: eval of {tmp_path / 'run'} interrupted (Ctrl-C) before it finished; rerun the same command (a "
        f"result file is written only once its evaluation is complete)"]
