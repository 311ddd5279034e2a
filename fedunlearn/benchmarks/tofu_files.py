"""Load a local export of the published TOFU dataset (``locuslab/TOFU``) as :class:`TofuData`.

The directory holds one file per TOFU config, named after the config, as ``.parquet``,
``.jsonl`` or ``.json`` (``full.parquet``, ``forget01_perturbed.json``, ...); a sub-directory
named after the config with such files in it (the layout of a Hugging Face snapshot) works too.
Files are read with ``datasets.load_dataset("parquet" | "json", data_files=...)``, one at a
time (:mod:`fedunlearn.benchmarks.data_files`); nothing is fetched from the hub. A damaged file,
a missing column or a record without a value raises ``DataFileError`` (a ``ValueError``)
naming the file and the row.

Configs used:

* ``full`` (required; ``question``, ``answer``): all author QA, authors in order,
  ``qa_per_author`` consecutive rows each. Row ``i`` belongs to ``author_{i // qa_per_author}``.
* ``forget01_perturbed``, ``forget05_perturbed``, ``forget10_perturbed``, ``retain_perturbed``
  (optional; ``question``, ``paraphrased_answer``, ``perturbed_answer``, optionally
  ``answer``): their paraphrased/perturbed answers are attached to the row of ``full`` with
  the same question (and the same answer, when the question occurs more than once). A
  question absent from ``full`` is an error. Rows of ``full`` that no such file covers keep
  ``paraphrased_answer == ""`` and ``perturbed_answer == []`` (see
  :func:`fedunlearn.benchmarks.tofu.has_perturbations`); in the published data only the 400
  ``retain_perturbed`` rows of the retain set have them.
* ``real_authors_perturbed`` / ``world_facts_perturbed`` (optional, falling back to
  ``real_authors`` / ``world_facts``; ``question``, ``answer``): perturbed answers come from a
  ``perturbed_answer`` column (list or single string) or, failing that, from ``option1``,
  ``option2``, ... columns minus the correct answer. A missing ``paraphrased_answer`` column
  is filled with the answer itself (TOFU scores these two sets against the original answer).
  A missing config gives an empty set.
* ``forget01`` / ``forget05`` / ``forget10`` (optional): only checked, they must hold exactly
  the questions of :meth:`TofuData.forget_split` for that percent.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from fedunlearn.benchmarks.data_files import DataFileError, Table, read_table
from fedunlearn.benchmarks.tofu import TofuData

EXTENSIONS = (".parquet", ".jsonl", ".json")
AUTHOR_PERTURBED_CONFIGS = (
    "forget01_perturbed",
    "forget05_perturbed",
    "forget10_perturbed",
    "retain_perturbed",
)
FORGET_PERCENTS = {"forget01": 1, "forget05": 5, "forget10": 10}
_OPTION_COLUMN = re.compile(r"^option(\d+)$")


def find_config_files(root: Path, config: str) -> list[Path] | None:
    """Files holding ``config`` under ``root`` (``<config>.<ext>`` or ``<config>/**``), or None."""
    for ext in EXTENSIONS:
        path = root / f"{config}{ext}"
        if path.is_file():
            return [path]
    folder = root / config
    if folder.is_dir():
        for ext in EXTENSIONS:
            files = sorted(p for p in folder.rglob(f"*{ext}") if p.is_file())
            if files:
                return files
    return None


class _ConfigReader:
    """Reads each config of one directory at most once."""

    def __init__(self, root: Path, cache_dir: str | None) -> None:
        self.root, self.cache_dir = root, cache_dir
        self._tables: dict[str, Table | None] = {}

    def __call__(self, config: str) -> Table | None:
        """The rows of ``config``, or None when the directory does not hold it."""
        if config not in self._tables:
            files = find_config_files(self.root, config)
            self._tables[config] = None if files is None else read_table(files, self.cache_dir)
        return self._tables[config]


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def _norm(text: str) -> str:
    return " ".join(str(text).split())


def _extra_records(table: Table) -> list[dict[str, Any]]:
    """Records of ``real_authors``/``world_facts`` rows (see the module docstring)."""
    records = []
    for i, row in enumerate(table.require(["question", "answer"]).rows):
        answer = str(row["answer"])
        if "perturbed_answer" in row:
            perturbed = _as_list(row["perturbed_answer"])
        else:
            options = sorted(
                (int(m.group(1)), key) for key in row if (m := _OPTION_COLUMN.match(key))
            )
            if not options:
                raise DataFileError(
                    f"{table.where(i)}: no 'perturbed_answer' (nor option1, option2, ...)"
                )
            perturbed = [
                str(row[key])
                for _, key in options
                if row[key] is not None and _norm(row[key]) != _norm(answer)
            ]
        records.append(
            {
                "question": str(row["question"]),
                "answer": answer,
                "paraphrased_answer": str(row.get("paraphrased_answer") or answer),
                "perturbed_answer": perturbed,
                "author": "",
            }
        )
    return records


def load_tofu_files(
    path: str | os.PathLike[str], *, qa_per_author: int = 20, cache_dir: str | None = None
) -> TofuData:
    """Build :class:`TofuData` from the TOFU files in directory ``path``.

    ``qa_per_author`` is 20 for the published data (200 authors x 20 QA), which makes
    ``forget_split(1)`` the last 2 authors, exactly TOFU's ``forget01``. ``cache_dir`` is passed
    to ``datasets.load_dataset``. The returned data has ``seed == 0``.
    """
    if qa_per_author < 1:
        raise ValueError(f"qa_per_author must be >= 1, got {qa_per_author}")
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"TOFU directory not found: {root}")

    read = _ConfigReader(root, cache_dir)
    full = read("full")
    if full is None:
        expected = ", ".join(f"full{ext}" for ext in EXTENSIONS)
        raise FileNotFoundError(f"{root}: no 'full' config; expected one of {expected} or full/")
    full_rows = full.require(["question", "answer"]).rows
    if not full_rows or len(full_rows) % qa_per_author:
        raise DataFileError(
            f"{', '.join(map(str, full.files))}: {len(full_rows)} rows is not a positive "
            f"multiple of qa_per_author={qa_per_author}"
        )

    num_authors = len(full_rows) // qa_per_author
    names = [f"author_{i}" for i in range(num_authors)]
    author_qa: list[dict[str, Any]] = [
        {
            "question": str(row["question"]),
            "answer": str(row["answer"]),
            "paraphrased_answer": "",
            "perturbed_answer": [],
            "author": names[i // qa_per_author],
        }
        for i, row in enumerate(full_rows)
    ]
    by_question: dict[str, list[int]] = {}
    for i, record in enumerate(author_qa):
        by_question.setdefault(_norm(record["question"]), []).append(i)

    for config in AUTHOR_PERTURBED_CONFIGS:
        loaded = read(config)
        if loaded is None:
            continue
        rows = loaded.require(["question", "paraphrased_answer", "perturbed_answer"]).rows
        for i, row in enumerate(rows):
            matches = by_question.get(_norm(row["question"]))
            if not matches:
                raise DataFileError(
                    f"{loaded.where(i)}: question not found in full: {row['question']!r}"
                )
            if "answer" in row and len(matches) > 1:
                same = [i for i in matches if _norm(author_qa[i]["answer"]) == _norm(row["answer"])]
                matches = same or matches
            for i in matches:
                author_qa[i]["paraphrased_answer"] = str(row["paraphrased_answer"])
                author_qa[i]["perturbed_answer"] = _as_list(row["perturbed_answer"])

    extras: dict[str, list[dict[str, Any]]] = {}
    for name in ("real_authors", "world_facts"):
        loaded = read(f"{name}_perturbed") or read(name)
        extras[name] = [] if loaded is None else _extra_records(loaded)
    data = TofuData(
        author_names=names,
        author_qa=author_qa,
        real_authors=extras["real_authors"],
        world_facts=extras["world_facts"],
        seed=0,
    )
    _check_forget_configs(read, data)
    return data


def _check_forget_configs(read: _ConfigReader, data: TofuData) -> None:
    """Forget files must agree with the author split implied by ``qa_per_author``."""
    for config, percent in FORGET_PERCENTS.items():
        for name, exact in ((config, True), (f"{config}_perturbed", False)):
            loaded = read(name)
            if loaded is None:
                continue
            found = [_norm(r["question"]) for r in loaded.require(["question"]).rows]
            expected = [_norm(r["question"]) for r in data.forget_split(percent)]
            allowed = set(expected)
            stray = next((i for i, q in enumerate(found) if q not in allowed), None)
            if stray is not None or (exact and sorted(found) != sorted(expected)):
                place = ", ".join(map(str, loaded.files)) if stray is None else loaded.where(stray)
                raise DataFileError(
                    f"{place}: questions do not match the last "
                    f"{len(data.forget_authors(percent))} authors of full; "
                    "is qa_per_author right?"
                )
