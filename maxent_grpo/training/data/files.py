"""Local data files (``data.data_files``, ``data.val_files``) read with ``datasets.load_dataset``.

An option holds a path or a glob pattern, or a list of them (``"data/train-*.jsonl"``). Every
entry ends in one of :data:`FILE_SUFFIXES`; a path must exist, a pattern must match a file
(``recursive=True``: ``**`` crosses folders; matches sorted). Rows come in that order.

Each file is read on its own by the builder of its suffix, so files may differ in their
columns and every error names the file:

- ``.jsonl``: one JSON object per line; ``.json``: a list of row objects, one object of
  equal-length column lists or JSON lines. A missing key is None; a column of integers and
  decimals is read as decimals (Arrow).
- ``.csv``: a header row, then cells all kept as strings ("" when empty).
- ``.parquet``: the file's own types.

``datasets`` caches an Arrow copy (``cache_dir``) keyed on path and modification time.
"""

from __future__ import annotations

import bisect
import glob
import json
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


@dataclass(frozen=True)
class FileParts:
    """Which file each of the rows read from several files comes from.

    Attributes:
        starts: the number of each file's first row among all the rows.
        names: each file as error messages name it (``"data.data_files file 'a.jsonl'"``).
    """

    starts: tuple[int, ...]
    names: tuple[str, ...]

    def where(self, index: int) -> tuple[str, int]:
        """The file row ``index`` comes from and the row's number in that file."""
        part = bisect.bisect_right(self.starts, index) - 1
        return self.names[part], index - self.starts[part]


def expand_files(option: str, value: Any) -> list[str]:
    """The files ``value`` names, in reading order.

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
    for entry in entries:
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
            raise FileNotFoundError(f"{option} {what}: {entry!r}")
        files += matches
    return files


def read_files(option: str, value: Any, cache_dir: str | None) -> tuple[list[Row], FileParts]:
    """Every row of the files ``value`` names (:func:`expand_files`, :func:`read_file`) and
    which file each comes from."""
    rows: list[Row] = []
    starts, names = [], []
    for path in expand_files(option, value):
        starts.append(len(rows))
        names.append(f"{option} file {path!r}")
        rows += read_file(option, path, cache_dir)
    return rows, FileParts(tuple(starts), tuple(names))


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
        options: dict[str, Any] = {}
        if builder == "csv":  # every column a string, empty cells "" (pandas would infer)
            header = pd.read_csv(path, nrows=0).columns
            options = {
                "features": datasets.Features({c: datasets.Value("string") for c in header}),
                "keep_default_na": False,
            }
        data = datasets.load_dataset(
            builder, data_files=[path], split="train", cache_dir=cache_dir, **options
        )
    except (datasets.exceptions.DatasetsError, pa.ArrowException, ValueError,
            StopIteration) as err:
        problem = _json_problem(path) if builder == "json" else None
        raise ValueError(
            f"{option} file {path!r} could not be read as {kind}: "
            f"{problem or _reason(err)}"
        ) from err
    rows = data.to_list()
    if suffix == ".json" and _is_column_object(path, rows):
        columns = rows[0]
        require(len({len(v) for v in columns.values()}) == 1,
                f"{option} file {path!r}: its column lists differ in length")
        rows = [dict(zip(columns, values, strict=True))
                for values in zip(*columns.values(), strict=True)]
    return rows


def _is_column_object(path: str, rows: list[Row]) -> bool:
    """A .json file holding one object whose values are all lists, which ``datasets`` reads
    as a single row: an object of column lists (a list of one such row starts with "[")."""
    if len(rows) != 1 or not rows[0] or not all(isinstance(v, list) for v in rows[0].values()):
        return False
    with open(path, "rb") as f:
        return f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"{")


def _reason(err: BaseException) -> str:
    """The message of the innermost explicitly chained error (``datasets`` wraps the
    reader's error in DatasetGenerationError)."""
    while err.__cause__ is not None:
        err = err.__cause__
    text = str(err)
    if "corresponds to no data" in text:  # datasets' message for a split without rows
        return "it holds no rows"
    return text or type(err).__name__


def _json_problem(path: str) -> str | None:
    """Why ``path`` is not JSON rows, with the line; None when Python's ``json`` finds nothing
    wrong."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        return "it holds no rows"
    if path.lower().endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            if err.msg != "Extra data":  # "Extra data": JSON lines, checked line by line below
                return f"line {err.lineno} is not valid JSON: {err.msg}"
        else:
            if not isinstance(data, (list, dict)):
                return "it holds neither a list of row objects nor an object"
            bad = [i for i, row in enumerate(data) if not isinstance(row, dict)]
            return f"row {bad[0]} is not a JSON object" if isinstance(data, list) and bad else None
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            return f"line {line_no} is not valid JSON: {err.msg}"
        if not isinstance(row, dict):
            return f"line {line_no} is not a JSON object"
    return None
