"""Local data files (``data.data_files``, ``data.val_files``): JSON with Python's ``json``,
CSV and Parquet with ``datasets.load_dataset``.

An option holds a path or a glob pattern, or a list of them (``"data/train-*.jsonl"``). Every
entry ends in one of :data:`FILE_SUFFIXES`; a path must exist, a pattern must match a file
(``recursive=True``: ``**`` crosses folders; matches sorted). Rows come in that order; a file
named twice (by two entries, or two patterns that overlap) is read once, where first named.

Each file is read on its own, so files may differ in their columns and every error names
the file. Text files must be UTF-8.

- ``.jsonl``: one JSON object per line; ``.json``: a list of row objects, one object of
  equal-length column lists or JSON lines. Values are what ``json`` reads (a string stays a
  string whatever other rows hold); a key a row lacks is None.
- ``.csv``: a header row, then rows of as many cells (a cell holding a comma is quoted),
  all kept as strings ("" when empty).
- ``.parquet``: the file's own types (a float32 or float16 value as its shortest decimal).

For CSV and Parquet ``datasets`` caches an Arrow copy (``cache_dir``) keyed on path and
modification time.
"""

from __future__ import annotations

import bisect
import csv
import glob
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maxent_grpo.validation import require

__all__ = ["FILE_SUFFIXES", "FileParts", "expand_files", "read_file", "read_files"]

FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")

# the datasets builder and the format's name (for error messages) of each suffix
_FORMATS = {
    ".jsonl": ("json", "JSON lines"),
    ".json": ("json", "JSON"),
    ".csv": ("csv", "CSV"),
    ".parquet": ("parquet", "Parquet"),
}

Row = dict[str, Any]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FileParts:
    """Which file each of the rows read from several files comes from.

    Attributes:
        starts: the number of each file's first row among all the rows.
        names: each file as error messages name it (``"data.data_files file 'a.jsonl'"``).
        paths: each file's real path.
    """

    starts: tuple[int, ...]
    names: tuple[str, ...]
    paths: tuple[str, ...] = ()

    def where(self, index: int) -> tuple[str, int]:
        """The file row ``index`` comes from and the row's number in that file."""
        part = bisect.bisect_right(self.starts, index) - 1
        return self.names[part], index - self.starts[part]


def expand_files(option: str, value: Any, warn: bool = False) -> list[str]:
    """The files ``value`` names, in reading order, each once (``warn``: say so when one was
    named twice).

    Raises ValueError naming ``option`` unless ``value`` is a path or pattern, or a non-empty
    list of them, ending in one of :data:`FILE_SUFFIXES`; FileNotFoundError for a missing
    path or a pattern matching no file.
    """
    entries = [value] if isinstance(value, str) else value
    require(
        isinstance(entries, (list, tuple)) and bool(entries)
        and all(isinstance(e, str) and e for e in entries),
        f"{option} must be a file path or glob pattern, or a non-empty list of them; "
        f"got {value!r}",
    )
    files: list[str] = []
    for entry in map(os.path.expanduser, entries):  # ~/data/*.jsonl, as the other paths
        require(
            Path(entry).suffix.lower() in FILE_SUFFIXES,
            f"{option} must end in one of {', '.join(FILE_SUFFIXES)}; got {entry!r}",
        )
        if Path(entry).is_file():
            files.append(entry)
            continue
        matches = sorted(p for p in glob.glob(entry, recursive=True) if Path(p).is_file())
        if not matches:
            what = "pattern matches no file" if glob.escape(entry) != entry else "file not found"
            raise FileNotFoundError(f"{option} {what}: {entry!r}" + ("" if os.path.isabs(
                entry) else f" (relative paths are read from the working folder {os.getcwd()})"))
        files += matches
    first: dict[str, str] = {}
    for path in files:
        first.setdefault(os.path.realpath(path), path)
    once = list(first.values())
    if warn and len(once) < len(files):  # an entry and a pattern that overlap: read it once
        log.warning("%s names %d file(s) more than once (entries or patterns that overlap); "
                    "each is read once", option, len(files) - len(once))
    return once


def read_files(option: str, value: Any, cache_dir: str | None) -> tuple[list[Row], FileParts]:
    """Every row of the files ``value`` names (:func:`expand_files`, :func:`read_file`) and
    which file each comes from."""
    rows: list[Row] = []
    starts, names, paths = [], [], []
    for path in expand_files(option, value, warn=True):
        starts.append(len(rows))
        names.append(f"{option} file {path!r}")
        paths.append(os.path.realpath(path))
        rows += read_file(option, path, cache_dir)
    return rows, FileParts(tuple(starts), tuple(names), tuple(paths))


def read_file(option: str, path: str, cache_dir: str | None) -> list[Row]:
    """Every row (all columns) of one local file, read by ``datasets.load_dataset``
    (imported here: a run on a built-in task never loads datasets, pandas or pyarrow).

    Raises ValueError naming ``option`` and ``path`` when the file cannot be read (for JSON
    with the first bad line, else with the reader's reason).
    """
    import datasets
    import pandas as pd  # installed with datasets
    import pyarrow as pa  # installed with datasets

    suffix = Path(path).suffix.lower()
    builder, kind = _FORMATS[suffix]
    try:
        if builder == "json":
            return _json_rows(path)
        options: dict[str, Any] = {}
        if builder == "csv":  # every column a string, empty cells "" (pandas would infer)
            _check_csv_fields(path)
            header = pd.read_csv(path, nrows=0).columns
            options = {
                "features": datasets.Features({c: datasets.Value("string") for c in header}),
                "keep_default_na": False,
            }
        data = datasets.load_dataset(
            builder, data_files=[path], split="train", cache_dir=cache_dir, **options)
        return dataset_rows(data)
    except UnicodeDecodeError as err:
        raise ValueError(f"{option} file {path!r} is not UTF-8 text (byte {err.start} of "
                         f"{err.object[err.start:err.start + 1]!r}): save it as UTF-8") from err
    except (datasets.exceptions.DatasetsError, pa.ArrowException, ValueError,
            StopIteration) as err:
        raise ValueError(
            f"{option} file {path!r} could not be read as {kind}: {_reason(err)}") from err
    except OSError as err:  # the file itself, or datasets' cache (a read-only HOME): a bare errno
        why, where = err.strerror or str(err), err.filename
        if where is not None and os.path.realpath(str(where)) == os.path.realpath(path):
            raise ValueError(f"{option} file {path!r} cannot be read ({why})") from err
        raise ValueError(f"{option} file {path!r}: datasets cannot write its cache "
                         f"{'' if where is None else repr(where) + ' '}({why}): set "
                         "data.dataset_cache_dir to a folder you can write to") from err


def _check_csv_fields(path: str) -> None:
    """ValueError naming the first row whose cells are not as many as the header's: pandas
    would read a first row with one more cell (a comma not quoted, a trailing comma) as an
    index and shift every column."""
    limit = csv.field_size_limit()
    csv.field_size_limit(2**31 - 1)  # pandas has no limit on a cell (Python's is 128 KiB)
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            rows = (row for row in reader if any(cell.strip() for cell in row))  # as pandas
            header = next(rows, [])
            repeated = sorted({name for name in header  # blank ones: pandas' "Unnamed: 2"
                               if name.strip() and header.count(name) > 1})
            if repeated:  # pandas would rename the second "answer" to "answer.1", silently
                raise ValueError(f"its header names the column(s) {repeated} more than once")
            for row in rows:
                if len(row) > len(header):  # fewer cells: the missing ones are ""
                    raise ValueError(
                        f"line {reader.line_num} has {len(row)} cells and the header "
                        f"{len(header)}: quote a cell that holds a comma, and end no row "
                        "with one")
    except csv.Error as err:
        raise ValueError(f"line {reader.line_num}: {err}") from err
    finally:
        csv.field_size_limit(limit)


#: what the readers say of a file without rows: datasets, and for a Parquet file Arrow and
#: datasets 2.19
NO_ROWS = ("corresponds to no data", "BatchSize must be greater than 0, got 0",
           "batch_size must be greater than zero")


def _reason(err: BaseException) -> str:
    """The message of the innermost explicitly chained error (``datasets`` wraps the
    reader's error in DatasetGenerationError)."""
    while err.__cause__ is not None:
        err = err.__cause__
    text = str(err)
    if any(words in text for words in NO_ROWS):
        return "it holds no rows"
    return text or type(err).__name__


def _one_of_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are distinct (``json`` would keep the last of a repeated
    key, silently)."""
    found = dict(pairs)
    if len(found) < len(pairs):
        names = sorted({k for k, _ in pairs if [n for n, _ in pairs].count(k) > 1})
        raise ValueError(f"an object names the key(s) {names} more than once")
    return found


def _json_rows(path: str) -> list[Row]:
    """The rows of a JSON or JSON lines file, every row with every key (None where it has
    none); ValueError naming the line or row that is not a JSON object."""
    text = Path(path).read_text(encoding="utf-8-sig")
    rows: list[Any] | None = None
    if path.lower().endswith(".json"):
        try:
            data = json.loads(text, object_pairs_hook=_one_of_each)
        except json.JSONDecodeError as err:
            if err.msg != "Extra data":  # "Extra data": JSON lines, read line by line below
                raise ValueError(f"line {err.lineno} is not valid JSON: {err.msg}") from None
        else:
            require(isinstance(data, (list, dict)),
                    "it holds neither a list of row objects nor an object")
            rows = data if isinstance(data, list) else [data]
            require(not (isinstance(data, dict) and data and all(  # no row's prompt is one
                isinstance(v, dict) for v in data.values())), "it is one object of objects "
                "keyed by column or by row (pandas' DataFrame.to_json, orient 'columns' or "
                "'index'): write it with orient='records' (a list of row objects), or "
                "orient='records', lines=True (JSON lines)")
            if isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
                require(len({len(v) for v in data.values()}) == 1,
                        "its column lists differ in length")  # an object of columns
                rows = [dict(zip(data, values, strict=True))
                        for values in zip(*data.values(), strict=True)]
            bad = [i for i, row in enumerate(rows) if not isinstance(row, dict)]
            require(not bad, f"row {bad[0] if bad else 0} is not a JSON object")
    if rows is None:
        rows = []
        for line_no, line in enumerate(text.split("\n"), start=1):  # not U+2028: JSON text
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line, object_pairs_hook=_one_of_each))
            except json.JSONDecodeError as err:
                raise ValueError(f"line {line_no} is not valid JSON: {err.msg}") from None
            except ValueError as err:  # a repeated key
                raise ValueError(f"line {line_no}: {err}") from None
            require(isinstance(rows[-1], dict), f"line {line_no} is not a JSON object")
    require(bool(rows), "it holds no rows")
    keys = list(dict.fromkeys(k for row in rows for k in row))
    return [{k: row.get(k) for k in keys} for row in rows]


def dataset_rows(data: Any) -> list[dict[str, Any]]:
    """The rows of a ``datasets.Dataset``, its float16 and float32 columns as written (0.1,
    not 0.10000000149011612: Arrow hands them out as the nearest double)."""
    import numpy as np

    narrow = {c: f.dtype for c, f in data.features.items()
              if getattr(f, "dtype", None) in ("float16", "float32")}
    rows = data.to_list()
    for row in rows if narrow else ():
        for column, dtype in narrow.items():
            if row[column] is not None:
                row[column] = float(str(np.dtype(dtype).type(row[column])))
    return rows
