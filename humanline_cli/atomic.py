"""Atomic file writes: a temp file next to the target, then a rename over it, so a reader (or a rerun
after a kill) sees the old file or the new one, never half of one. The one helper for every file the
package rewrites in place (summary.json, failed.json, resolved_config.json, .hydra/*.yaml, caches)."""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from humanline_cli.errors import cannot_write


def write_text_atomic(path: Path, text: str, tmp: Path | None = None) -> None:
    """Write `text` to `tmp` (default: `<path>.tmp`; writers that may race pass their own), then rename it
    over `path`. On failure the temp file is removed and RunFailed names `path`."""
    path = Path(path)
    tmp = tmp or path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise cannot_write(path, e) from e


def write_json_atomic(path: Path, obj, indent: int | None = 2, tmp: Path | None = None) -> None:
    """`obj` as JSON (non-ASCII kept as is), atomically (write_text_atomic)."""
    write_text_atomic(path, json.dumps(obj, indent=indent, ensure_ascii=False, default=str) + "\n", tmp)
