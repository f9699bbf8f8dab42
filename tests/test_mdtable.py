"""The one Markdown table writer of docs/config.md and `humanline report`: pipes inside cells are escaped, a frame's
missing numbers show as "–" and its formats apply per column."""
from __future__ import annotations

import pandas as pd

from humanline_cli.mdtable import md_frame, md_table


def test_a_pipe_in_a_cell_cannot_open_a_column():
    assert md_table(["key", "default"], [["`a|b`", 1]]) == ["| key | default |", "|---|---|", "| `a\\|b` | 1 |"]


def test_a_frame_with_formats_and_missing_values():
    df = pd.DataFrame({"regime": ["online", "hl"], "mean_s": [1.25, float("nan")], "speedup": [None, 2.0]})
    assert md_frame(df, {"mean_s": "{:.1f}", "speedup": "{:.2f}x".format}) == [
        "| regime | mean s | speedup |", "|---|---|---|", "| online | 1.2 | – |", "| hl | – | 2.00x |"]
