"""MMLU as per-subject CSV files and multiple-choice questions as JSON lines (real files).

MMLU (Hendrycks et al., 2021) is read from ``<folder>/<split>/<subject>_<split>.csv``, one
file per subject, each with the header ``question,choice0,choice1,choice2,choice3,answer``
and ``answer`` the index (0-3) of the correct choice (the layout of the offline copy in
``shared/data/mmlu``; the headerless letter-answer files of the original tarball are not
accepted). Records are ``{"question", "choices" (4 strings), "answer" (int), "subject"}``
in a stable order: subjects by name, then rows in file order. Rows count from 0 after the
header, as in pandas; errors also give the file's line number.

:func:`load_mc_jsonl` reads JSON lines ``{"question", "choices", "answer"}`` such as the
``wmdp_bio_200.jsonl`` copy of the first 200 WMDP-bio questions (Li et al., 2024), which
:func:`fedunlearn.benchmarks.wmdp_files.load_wmdp_questions` does not find (it looks for a
``wmdp-bio`` config file or folder).

:func:`mmlu_subset` draws a seeded subset: ``subjects`` subjects, then ``per_subject``
questions of each, the questions of a subject drawn with a generator seeded by
``f"{seed}/{subject}"`` so they do not depend on which other subjects were drawn.
"""

from __future__ import annotations

import csv
import json
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedunlearn.benchmarks.data_files import DataFileError

MMLU_COLUMNS = ("question", "choice0", "choice1", "choice2", "choice3", "answer")
N_CHOICES = 4

__all__ = ["MMLU_COLUMNS", "load_mc_jsonl", "load_mmlu_csv", "mmlu_subjects", "mmlu_subset"]


def _answer(value: Any, where: str) -> int:
    """The answer index in ``0..3``; :class:`DataFileError` naming ``where`` otherwise."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < N_CHOICES:
        raise DataFileError(f"{where}: answer {value!r} is not an index in 0..{N_CHOICES - 1}")
    return value


def mmlu_subjects(folder: str | os.PathLike[str], split: str = "test") -> list[str]:
    """Names of the subjects with a ``<subject>_<split>.csv`` file in ``folder/split``, sorted."""
    root = Path(folder) / split
    if not root.is_dir():
        raise FileNotFoundError(f"MMLU split folder not found: {root}")
    suffix = f"_{split}.csv"
    names = sorted(p.name[: -len(suffix)] for p in root.glob(f"*{suffix}"))
    if not names:
        raise FileNotFoundError(f"{root}: no MMLU files named <subject>{suffix}")
    return names


def _read_subject_csv(path: Path, subject: str) -> list[dict[str, Any]]:
    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.reader(handle, strict=True)
        try:
            header = next(reader, None)
            if header is None:
                raise DataFileError(f"{path}: empty file (expected the header {MMLU_COLUMNS})")
            missing = [c for c in MMLU_COLUMNS if c not in header]
            if missing:
                raise DataFileError(f"{path}: missing column {missing[0]!r} (header: {header})")
            index = {name: header.index(name) for name in MMLU_COLUMNS}
            records = []
            for row_number, row in enumerate(reader):
                where = f"{path} row {row_number} (line {reader.line_num})"
                if len(row) != len(header):
                    raise DataFileError(f"{where}: {len(row)} fields, the header has {len(header)}")
                records.append(
                    {
                        "question": row[index["question"]],
                        "choices": [row[index[f"choice{k}"]] for k in range(N_CHOICES)],
                        "answer": _answer(row[index["answer"]], where),
                        "subject": subject,
                    }
                )
        except csv.Error as err:
            raise DataFileError(f"{path} line {reader.line_num}: not valid CSV: {err}") from err
        except UnicodeDecodeError as err:
            raise DataFileError(f"{path}: byte {err.start}: not UTF-8 text") from err
    return records


def load_mmlu_csv(
    folder: str | os.PathLike[str], split: str = "test", subjects: Sequence[str] | None = None
) -> list[dict[str, Any]]:
    """MMLU questions of ``split`` (``test`` or ``dev``) from ``folder/<split>/*.csv``.

    ``subjects=None`` reads every subject present; named subjects must all have a file.
    Records come subject by subject (sorted by name), each in file order.
    """
    available = mmlu_subjects(folder, split)
    chosen = available if subjects is None else sorted(set(subjects))
    unknown = [s for s in chosen if s not in available]
    if unknown:
        raise FileNotFoundError(
            f"{Path(folder) / split}: no file for MMLU subjects {unknown} "
            f"({len(available)} subjects present)"
        )
    records: list[dict[str, Any]] = []
    for subject in chosen:
        path = Path(folder) / split / f"{subject}_{split}.csv"
        records.extend(_read_subject_csv(path, subject))
    return records


def mmlu_subset(
    records: Sequence[dict[str, Any]],
    *,
    subjects: int | tuple[str, ...],
    per_subject: int,
    seed: int,
) -> list[dict[str, Any]]:
    """A seeded subset: ``per_subject`` questions of each of ``subjects``.

    ``subjects`` is a number of subjects drawn (without replacement, ``random.Random(seed)``
    over the sorted subject names) or a tuple of names. Each subject's questions are drawn
    with ``random.Random(f"{seed}/{subject}")``. The result keeps the order of ``records``
    (subjects by name, questions in file order).
    """
    by_subject: dict[str, list[int]] = {}
    for i, record in enumerate(records):
        by_subject.setdefault(record["subject"], []).append(i)
    names = sorted(by_subject)
    if isinstance(subjects, int):
        if not 0 < subjects <= len(names):
            raise ValueError(f"subjects={subjects}: the records hold {len(names)} subjects")
        chosen = random.Random(seed).sample(names, subjects)
    else:
        chosen = list(subjects)
        unknown = [s for s in chosen if s not in by_subject]
        if unknown:
            raise ValueError(f"subjects {unknown} are not in the records")
    if per_subject < 1:
        raise ValueError(f"per_subject must be >= 1, got {per_subject}")
    keep: list[int] = []
    for subject in chosen:
        rows = by_subject[subject]
        if per_subject > len(rows):
            raise ValueError(f"subject {subject!r} has {len(rows)} questions < {per_subject}")
        keep.extend(random.Random(f"{seed}/{subject}").sample(rows, per_subject))
    return [records[i] for i in sorted(keep)]


def _mc_record(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise DataFileError(f"{where}: a JSON {type(value).__name__}, not an object")
    for key in ("question", "choices", "answer"):
        if value.get(key) is None:
            raise DataFileError(f"{where}: no value for {key!r}")
    choices = value["choices"]
    if not isinstance(choices, list) or len(choices) != N_CHOICES:
        raise DataFileError(f"{where}: 'choices' must be a list of {N_CHOICES}, got {choices!r}")
    return {
        "question": str(value["question"]),
        "choices": [str(c) for c in choices],
        "answer": _answer(value["answer"], where),
    }


def load_mc_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Four-choice questions ``{"question", "choices", "answer"}`` from a JSON-lines file.

    Blank lines are skipped; errors name the file and its (1-based) line.
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"question file not found: {file}")
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise DataFileError(f"{file}: byte {err.start}: not UTF-8 text") from err
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{file} line {number}"
        try:
            value = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataFileError(f"{where} column {err.colno}: {err.msg}") from err
        records.append(_mc_record(value, where))
    if not records:
        raise DataFileError(f"{file}: no questions")
    return records
