"""Load rows from JSONL / JSON / Parquet / CSV files, save_to_disk folders or hub ids via `datasets`.

Returns a list of dicts plus a `where(i)` function giving "file:line" (JSONL) or "file row i" so
every later error can point at the offending record.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from ..errors import UserError

Rows = tuple[list[dict], Callable[[int], str]]


def _check_jsonl(path: Path) -> list[int]:
    """Parse every line (so a malformed one is reported with its number); returns line numbers of records."""
    lines = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{n}: malformed JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise UserError(f"{path}:{n}: expected a JSON object, got {type(obj).__name__}")
            lines.append(n)
    return lines


def load_rows(path: str, split: str = "train", limit: int | None = None, columns: dict | None = None) -> Rows:
    """`columns` renames source fields to ours, e.g. {"instruction": "prompt", "problem": "prompt"}."""
    import datasets

    datasets.disable_progress_bars()
    p = Path(path)
    where: Callable[[int], str] = lambda i: f"{path} row {i + 1}"  # noqa: E731
    try:
        if p.is_file():
            suffix = p.suffix.lower()
            builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(suffix)
            if builder is None:
                raise UserError(f"{path}: unsupported file type {suffix!r} (use .jsonl, .json, .parquet, .csv)")
            if suffix == ".jsonl":
                line_numbers = _check_jsonl(p)
                if not line_numbers:
                    raise UserError(f"data {path!r} is empty")
                where = lambda i: f"{path}:{line_numbers[i]}"  # noqa: E731
            ds = datasets.load_dataset(builder, data_files=str(p), split="train")
        elif p.is_dir():
            if (p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists():
                ds = datasets.load_from_disk(str(p))
                if isinstance(ds, datasets.DatasetDict):
                    if split not in ds:
                        raise UserError(f"{path}: no split {split!r} (has {', '.join(ds)})")
                    ds = ds[split]
            else:
                ds = datasets.load_dataset(str(p), split=split)
        elif path.startswith((".", "/", "~")) or p.suffix.lower() in (".jsonl", ".json", ".parquet", ".csv"):
            raise UserError(f"data file {path} does not exist")
        else:
            ds = datasets.load_dataset(path, split=split)
    except UserError:
        raise
    except FileNotFoundError:
        raise UserError(f"data {path!r} not found (not a local file/dir; hub download needs network)") from None
    except Exception as e:  # datasets raises many types; the first line is the useful part
        raise UserError(f"cannot load data {path!r}: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    if columns:
        missing = [c for c in columns if c not in ds.column_names]
        if missing:
            raise UserError(f"data {path!r} has no column(s) {missing} to rename (has {ds.column_names})")
        ds = ds.rename_columns(dict(columns))
    rows = ds.to_list()
    if not rows:
        raise UserError(f"data {path!r} (split {split!r}) is empty")
    return rows, where
