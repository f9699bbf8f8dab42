"""What every measuring lab tool does around its measurement: a bad input is one line and exit 2, a Ctrl-C while
measuring is one line and exit 130 with nothing written, and the result is one JSON file (the user's --out, else
runs/bench/<prefix><objective>-<time>.json) printed as a table."""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from humanline_cli.bench.project import check_out
from humanline_cli.errors import UserError, ignore_ctrl_c


def measure_and_write(name: str, measure: Callable[[], tuple[dict, str, Callable]], out: Path | None,
                      console) -> int:
    """`measure()` returns (result, file-name prefix, printer); the exit code of the tool."""
    try:
        if out:
            check_out(out)
        res, prefix, printer = measure()
    except UserError as e:
        print(f"humanline: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # nothing is written before the measurement ends (--out comes last)
        ignore_ctrl_c()  # a second Ctrl-C must not cut this line short
        print(f"humanline: {name} interrupted (Ctrl-C) while measuring; nothing was written", file=sys.stderr)
        return 130
    out = out or Path(f"runs/bench/{prefix}{res['objective']}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    printer(res, console)
    console.print(f"wrote {out}")
    return 0
