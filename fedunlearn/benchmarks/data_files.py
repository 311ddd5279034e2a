"""Rows of local benchmark files (parquet, JSON, JSON lines) with errors naming file and record.

Each file is read on its own with ``datasets.load_dataset("parquet" | "json", data_files=...)``
(nothing is fetched from the hub), so a damaged shard, a missing column or a missing value is
reported for that file. A file ``datasets`` cannot parse becomes a :class:`DataFileError`
naming the file and, for JSON, the line where the text stops being JSON. Rows count from 0 in
each file, as in ``datasets`` and pandas (in a JSON-lines file without blank lines, row ``i``
is line ``i + 1``).
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class DataFileError(ValueError):
    """A benchmark file that cannot be used; the message names the file (and the record)."""


@dataclass(frozen=True)
class Table:
    """The rows of one or more files, in order, with the file and row each came from."""

    files: tuple[Path, ...]
    columns: tuple[tuple[str, ...], ...]  # the columns of each file
    starts: tuple[int, ...]  # the index in ``rows`` of each file's first row
    rows: list[dict[str, Any]]

    def where(self, index: int) -> str:
        """``"<file> row <i>"`` for ``rows[index]``."""
        k = bisect.bisect_right(self.starts, index) - 1
        return f"{self.files[k]} row {index - self.starts[k]}"

    def require(self, names: Sequence[str]) -> Table:
        """This table, once every non-empty file has the columns ``names`` and every row a
        value (not null) in each; :class:`DataFileError` naming the file (and row) otherwise."""
        ends = (*self.starts[1:], len(self.rows))
        for path, present, start, end in zip(
            self.files, self.columns, self.starts, ends, strict=True
        ):
            missing = [name for name in names if name not in present]
            if missing and end > start:
                raise DataFileError(
                    f"{path}: missing column {missing[0]!r} (columns: {sorted(present)})"
                )
        for index, row in enumerate(self.rows):
            for name in names:
                if row.get(name) is None:
                    raise DataFileError(f"{self.where(index)}: no value in column {name!r}")
        return self


def read_table(
    files: Sequence[Path],
    cache_dir: str | None,
    *,
    required: Sequence[str] = (),
    optional: Sequence[str] | None = None,
    limit: int | None = None,
) -> Table:
    """The rows of ``files`` (parquet when the first is ``.parquet``, JSON otherwise).

    ``required`` columns must be present with a value in every row (:meth:`Table.require`);
    ``optional=None`` keeps every column, otherwise only ``required`` and the ``optional``
    ones a file has; ``limit`` caps the number of rows (later files are then not read).
    """
    builder = "parquet" if files[0].suffix == ".parquet" else "json"
    rows: list[dict[str, Any]] = []
    read: list[Path] = []
    columns: list[tuple[str, ...]] = []
    starts: list[int] = []
    for path in files:
        if limit is not None and len(rows) >= limit:
            break
        dataset = _load(path, builder, cache_dir)
        present = tuple(dataset.column_names)
        if optional is not None and set(required) <= set(present):
            dataset = dataset.select_columns(
                [*required, *(c for c in optional if c in present and c not in required)]
            )
        if limit is not None and len(rows) + len(dataset) > limit:
            dataset = dataset.select(range(limit - len(rows)))
        read.append(path)
        columns.append(present)
        starts.append(len(rows))
        rows.extend(dataset.to_list())
    return Table(tuple(read), tuple(columns), tuple(starts), rows).require(required)


def _load(path: Path, builder: str, cache_dir: str | None) -> Any:
    """``datasets.load_dataset`` on one file; :class:`DataFileError` naming it on failure."""
    import pyarrow as pa  # heavy imports, only needed here
    from datasets import load_dataset
    from datasets.exceptions import DatasetGenerationError

    try:
        return load_dataset(builder, data_files=[str(path)], split="train", cache_dir=cache_dir)
    except (DatasetGenerationError, pa.ArrowException, ValueError, OSError) as err:
        where = (json_problem(path) if builder == "json" else None) or _root_cause(err)
        raise DataFileError(f"{path}: not a readable {builder} file: {where}") from err


def _root_cause(err: BaseException) -> str:
    while err.__cause__ is not None:
        err = err.__cause__
    return f"{type(err).__name__}: {err}"


def json_problem(path: Path) -> str | None:
    """Where ``path`` stops being one JSON document or JSON lines (``"line 9: Unterminated
    string ..."``); None when its text parses (then its shape is the problem)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        return f"byte {err.start}: not UTF-8 text"
    try:
        json.loads(text)
        return None
    except json.JSONDecodeError as whole:
        if text.lstrip().startswith("["):  # one JSON array, not JSON lines
            return f"line {whole.lineno} column {whole.colno}: {whole.msg}"
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            return f"line {number} column {err.colno}: {err.msg}"
        if not isinstance(record, dict):
            return f"line {number}: a JSON {type(record).__name__}, not an object (a record)"
    return None
