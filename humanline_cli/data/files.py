"""Load rows from JSONL / JSON / CSV files (parsed here), Parquet files, save_to_disk folders or hub
ids (via `datasets`).

Returns a list of dicts plus a `where(i)` function giving "file:line" (JSONL, JSON arrays, CSV) or
"file row i" so every later error can point at the offending record. JSON files are parsed row by
row here rather than by `datasets`, which infers one type per column: a stray number among strings
was blamed on line 1, and rows mixing plain strings with chat message lists were refused. CSV cells
are text; only the numeric / boolean fields of the formats are converted (see `_CSV_NUMBERS`).
"""
from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable
from pathlib import Path

from humanline_cli.errors import UserError

Rows = tuple[list[dict], Callable[[int], str]]

SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
# CSV has no types: these fields are converted from text, every other cell stays a string ("57" is text).
_CSV_NUMBERS = ("score_chosen", "score_rejected")
_CSV_BOOLS = {"true": True, "1": True, "false": False, "0": False}
_CSV_LISTS = ("completions", "rewards")  # the groups format needs lists, which a CSV cell cannot hold
_CSV_TEXTS = ("prompt", "chosen", "rejected", "completion")  # text fields a chat dataset would hold as lists


def _malformed(path, line: int, e: json.JSONDecodeError) -> UserError:
    return UserError(f"{path}:{line}: malformed JSON ({e.msg} at column {e.colno})")


class _DuplicateKey(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique(pairs: list) -> dict:
    """json's object_pairs_hook: an object that names a key twice is refused (json keeps the last value silently;
    pyarrow, under `datasets`, refuses the row)."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _duplicate(path, line: int, e: _DuplicateKey) -> UserError:
    return UserError(f"{path}:{line}: duplicate key {e.key!r} in a JSON object (which value is meant?)")


def _loads(text: str, path, line: int):
    try:
        return json.loads(text, object_pairs_hook=_unique)
    except _DuplicateKey as e:
        raise _duplicate(path, line, e) from None


def _object(obj, path, line: int) -> dict:
    if not isinstance(obj, dict):
        raise UserError(f"{path}:{line}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _read_jsonl(path: Path, limit: int | None) -> tuple[list[dict], list[int]]:
    """Parse line by line (streamed, stops after `limit` records); returns rows and their line numbers."""
    rows: list[dict] = []
    lines: list[int] = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            if limit is not None and len(rows) >= limit:
                break
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(f"{path}:{n}: not UTF-8 text (byte {e.start + 1} of the line)") from None
            text = text.removeprefix("\ufeff") if n == 1 else text
            if not text.strip():
                continue
            try:
                obj = _loads(text, path, n)
            except json.JSONDecodeError as e:
                raise _malformed(path, n, e) from None
            rows.append(_object(obj, path, n))
            lines.append(n)
    return rows, lines


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise UserError(f"{path}:{line}: not UTF-8 text (byte {e.start + 1} of the file)") from None


def _read_json(path: Path) -> tuple[list[dict], Callable[[int], str]]:
    """A .json file holds JSON Lines, an array of objects, or one object of equal-length columns."""
    text = _read_text(path)
    body = text.lstrip()
    if not body:
        return [], lambda i: f"{path} row {i + 1}"
    if not body.startswith("["):
        first = body.split("\n", 1)[0]
        try:
            json.loads(first)
            is_lines = True  # the first line is a whole JSON value: JSON Lines (or a one-line object)
        except json.JSONDecodeError:
            is_lines = False
        if is_lines:
            rows, lines = _read_jsonl(path, None)
            return rows, lambda i: f"{path}:{lines[i]}"
    try:
        doc = json.loads(text, object_pairs_hook=_unique)
    except json.JSONDecodeError as e:
        raise _malformed(path, e.lineno, e) from None
    except _DuplicateKey as e:
        raise _duplicate(path, _duplicate_line(text, e.key), e) from None
    if isinstance(doc, list):
        lines = _array_lines(text)
        return [_object(obj, path, n) for obj, n in zip(doc, lines)], lambda i: f"{path}:{lines[i]}"
    if isinstance(doc, dict) and doc and all(isinstance(v, list) for v in doc.values()) \
            and len({len(v) for v in doc.values()}) == 1:
        keys = list(doc)
        rows = [dict(zip(keys, values)) for values in zip(*doc.values())]
        return rows, lambda i: f"{path} row {i + 1}"
    raise UserError(f"{path}: a .json file must hold JSON Lines, an array of objects, "
                    f"or an object of equal-length columns")


def _duplicate_line(text: str, key: str) -> int:
    """The line of a .json document's object that names `key` twice: the array element that holds it, else (an
    object of columns) the line of the key's second occurrence."""
    if text.lstrip().startswith("["):
        plain = json.JSONDecoder()
        hooked = json.JSONDecoder(object_pairs_hook=_unique)
        i = text.index("[") + 1
        while True:
            while text[i] in " \t\r\n,":
                i += 1
            try:
                hooked.raw_decode(text, i)
            except _DuplicateKey:
                return text.count("\n", 0, i) + 1
            _, i = plain.raw_decode(text, i)
    quoted = json.dumps(key)
    first = text.find(quoted)
    return text.count("\n", 0, text.find(quoted, first + 1)) + 1


def _array_lines(text: str) -> list[int]:
    """Line numbers where each element of a (valid) top-level JSON array starts."""
    decoder, starts = json.JSONDecoder(), []
    i = text.index("[") + 1
    line, counted = 1, 0
    while True:
        while text[i] in " \t\r\n,":
            i += 1
        if text[i] == "]":
            return starts
        line += text.count("\n", counted, i)
        counted = i
        starts.append(line)
        _, i = decoder.raw_decode(text, i)


def _read_csv(path: Path) -> tuple[list[dict], list[int]]:
    """Every cell as text; returns rows and the line each record starts on (the header is line 1)."""
    reader = csv.reader(io.StringIO(_read_text(path), newline=""))
    rows: list[dict] = []
    lines: list[int] = []
    try:
        header = next(reader, None)
        if header is None:
            return rows, lines
        dup = sorted({h for h in header if header.count(h) > 1})
        if dup:
            raise UserError(f"{path}:1: duplicate column(s) {dup} in the CSV header")
        start = reader.line_num + 1
        for cells in reader:
            if cells:  # the csv module yields [] for a blank line
                if len(cells) != len(header):
                    raise UserError(f"{path}:{start}: {len(cells)} cells, but the header has {len(header)} columns")
                rows.append(dict(zip(header, cells)))
                lines.append(start)
            start = reader.line_num + 1
    except csv.Error as e:
        raise UserError(f"{path}:{reader.line_num}: malformed CSV ({e})") from None
    return rows, lines


def _chat_list(cell) -> bool:
    """A CSV cell that reads as a JSON list of {role, content} messages (what a chat dataset's export writes)."""
    if not isinstance(cell, str) or not cell.lstrip().startswith("[") or '"role"' not in cell:
        return False
    try:
        value = json.loads(cell)
    except ValueError:
        return False
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def _csv_types(rows: list[dict], where: Callable[[int], str], path) -> None:
    """Convert the formats' numeric and boolean fields from text (in place); all else stays a string."""
    for name in _CSV_LISTS:
        if rows and name in rows[0]:
            raise UserError(f"{path}: column {name!r}: CSV cells hold text, not lists, so the groups format "
                            f"(prompt/completions/rewards) needs JSONL, JSON or Parquet")
    for i, row in enumerate(rows):
        for name in _CSV_TEXTS:
            if _chat_list(row.get(name)):
                raise UserError(f"{where(i)}: field {name!r} holds a list of chat messages, but CSV cells are text "
                                f"(the cell would be trained as its JSON); chat data needs JSONL, JSON or Parquet")
        for name in _CSV_NUMBERS:
            if name in row:
                cell = row[name].strip()
                try:
                    row[name] = float(cell) if cell else None  # empty: no score (pairs then count as 1 / 0)
                except ValueError:
                    raise UserError(f"{where(i)}: field {name!r} must be a number, got {cell!r}") from None
        if "label" in row:
            cell = row["label"].strip().lower()
            if cell not in _CSV_BOOLS:
                raise UserError(f"{where(i)}: field 'label' must be true/false/1/0, got {row['label']!r}")
            row["label"] = _CSV_BOOLS[cell]


def _rename(rows: list[dict], columns: dict, where: Callable[[int], str], path) -> list[dict]:
    present = set().union(*rows)
    missing = [c for c in columns if c not in present]
    if missing:
        raise UserError(f"data {path!r} has no column(s) {missing} to rename (has {sorted(present)})")
    out = []
    for i, row in enumerate(rows):
        new = {columns.get(k, k): v for k, v in row.items()}
        if len(new) < len(row):
            raise UserError(f"{where(i)}: renaming {columns} gives two fields the same name (fields {sorted(row)})")
        out.append(new)
    return out


# what marks a folder as written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`
_SAVED_MARKS = ("dataset_info.json", "dataset_dict.json", "state.json")


def _saved_gaps(p: Path) -> list[str]:
    """The files a save_to_disk folder lacks (relative to it): dataset_dict.json's splits, each split's
    (or the one dataset's) state.json, dataset_info.json and the Arrow files state.json lists."""
    if not (p / "dataset_dict.json").is_file():
        return _dataset_gaps(p)
    try:
        splits = json.loads((p / "dataset_dict.json").read_text())["splits"]
    except (OSError, ValueError, KeyError, TypeError):
        return ["a readable dataset_dict.json (with its list of splits)"]
    return [f"{s}/{gap}" for s in splits for gap in _dataset_gaps(p / str(s))]


def _dataset_gaps(d: Path) -> list[str]:
    missing = [name for name in ("state.json", "dataset_info.json") if not (d / name).is_file()]
    if not (d / "state.json").is_file():
        return missing + ([] if any(d.glob("*.arrow")) else ["its data-*.arrow files"])
    try:
        files = [f["filename"] for f in json.loads((d / "state.json").read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        return missing + ["a readable state.json"]
    return missing + [f for f in files if not (d / f).is_file()]


def _load_with_datasets(path: str, p: Path, split: str, limit: int | None) -> list[dict]:
    import datasets

    datasets.disable_progress_bars()
    try:
        if p.is_file():
            ds = datasets.load_dataset("parquet", data_files=str(p), split="train")
        elif p.is_dir() and (any((p / m).exists() for m in _SAVED_MARKS) or any(p.glob("*.arrow"))):
            gaps = _saved_gaps(p)
            if gaps:  # datasets would say "neither a Dataset nor a DatasetDict directory"
                raise UserError(f"data {path!r} is a folder but not a complete save_to_disk dataset: it lacks "
                                f"{', '.join(gaps)}")
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise UserError(f"{path}: no split {split!r} (has {', '.join(ds)})")
                ds = ds[split]
        else:
            ds = datasets.load_dataset(str(p) if p.is_dir() else path, split=split)
    except UserError:
        raise
    except FileNotFoundError as e:
        if p.exists():  # a local file or folder that is there: what is missing is inside it
            lines = str(e).splitlines()
            raise UserError(f"cannot load data {path!r}: {lines[0] if lines else 'a file it needs is missing'}") from None
        raise UserError(f"data {path!r} not found (not a local file/dir; hub download needs network)") from None
    except Exception as e:  # datasets raises many types; the first line is the useful part
        lines = str(e).splitlines()
        raise UserError(f"cannot load data {path!r}: {type(e).__name__}: {lines[0] if lines else ''}") from None
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    return ds.to_list()


def load_rows(path: str, split: str = "train", limit: int | None = None, columns: dict | None = None,
              limit_key: str | None = None) -> Rows:
    """`columns` renames source fields to ours, e.g. {"instruction": "prompt", "problem": "prompt"}.
    `limit` keeps the first rows; `limit_key` names the config key it came from (for the error when < 1)."""
    if limit is not None and limit < 1:
        key = limit_key or "limit"
        raise UserError(f"{key} must be at least 1, got {limit} (it is the number of rows to read from {path})")
    p = Path(path)
    where: Callable[[int], str] = lambda i: f"{path} row {i + 1}"  # noqa: E731
    suffix = p.suffix.lower()
    if p.is_file():
        if suffix not in SUFFIXES:
            raise UserError(f"{path}: unsupported file type {suffix!r} (use .jsonl, .json, .parquet, .csv)")
        try:
            match suffix:
                case ".jsonl":
                    rows, lines = _read_jsonl(p, limit)
                    where = lambda i: f"{path}:{lines[i]}"  # noqa: E731
                case ".json":
                    rows, where = _read_json(p)
                case ".csv":
                    rows, lines = _read_csv(p)
                    where = lambda i: f"{path}:{lines[i]}"  # noqa: E731
                case _:
                    rows = _load_with_datasets(path, p, split, limit)
        except OSError as e:
            raise UserError(f"cannot read data file {path}: {e.strerror or e}") from None
        rows = rows[:limit] if limit is not None else rows
    elif not p.is_dir() and (path.startswith((".", "/", "~")) or suffix in SUFFIXES):
        raise UserError(f"data file {path} does not exist")
    else:
        rows = _load_with_datasets(path, p, split, limit)
    if not rows:
        raise UserError(f"data {path!r} is empty" if p.is_file() else f"data {path!r} (split {split!r}) is empty")
    if columns:
        rows = _rename(rows, dict(columns), where, path)
    if p.is_file() and suffix == ".csv":
        _csv_types(rows, where, path)
    return rows, where
