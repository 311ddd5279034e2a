"""Load a local export of the published TOFU dataset (``locuslab/TOFU``) as :class:`TofuData`.

The directory holds one file per TOFU config, named after the config, as ``.parquet``,
``.jsonl`` or ``.json`` (``full.parquet``, ``forget01_perturbed.json``, ...); a sub-directory
named after the config with such files in it (the layout of a Hugging Face snapshot) works too.
Files are read with ``datasets.load_dataset("parquet" | "json", data_files=...)``; nothing is
fetched from the hub.

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


def _read_rows(files: list[Path], cache_dir: str | None) -> list[dict[str, Any]]:
    """All rows of ``files`` as dicts, via ``datasets.load_dataset`` on local files."""
    from datasets import load_dataset  # heavy import, only needed here

    builder = "parquet" if files[0].suffix == ".parquet" else "json"
    dataset = load_dataset(
        builder, data_files=[str(f) for f in files], split="train", cache_dir=cache_dir
    )
    return dataset.to_list()


class _ConfigReader:
    """Reads each config of one directory at most once."""

    def __init__(self, root: Path, cache_dir: str | None) -> None:
        self.root, self.cache_dir = root, cache_dir
        self._rows: dict[str, tuple[list[Path], list[dict[str, Any]]] | None] = {}

    def __call__(self, config: str) -> tuple[list[Path], list[dict[str, Any]]] | None:
        """``(files, rows)`` of ``config``, or None when the directory does not hold it."""
        if config not in self._rows:
            files = find_config_files(self.root, config)
            rows = None if files is None else _read_rows(files, self.cache_dir)
            self._rows[config] = None if files is None or rows is None else (files, rows)
        return self._rows[config]


def _require_columns(rows: list[dict[str, Any]], files: list[Path], columns: list[str]) -> None:
    present = set(rows[0]) if rows else set()
    for column in columns:
        if rows and column not in present:
            raise ValueError(f"{files[0]}: missing column {column!r} (columns: {sorted(present)})")


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def _norm(text: str) -> str:
    return " ".join(str(text).split())


def _extra_records(rows: list[dict[str, Any]], files: list[Path]) -> list[dict[str, Any]]:
    """Records of ``real_authors``/``world_facts`` rows (see the module docstring)."""
    _require_columns(rows, files, ["question", "answer"])
    records = []
    for row in rows:
        answer = str(row["answer"])
        if "perturbed_answer" in row:
            perturbed = _as_list(row["perturbed_answer"])
        else:
            options = sorted(
                (int(m.group(1)), key) for key in row if (m := _OPTION_COLUMN.match(key))
            )
            if not options:
                raise ValueError(
                    f"{files[0]}: missing column 'perturbed_answer' (or option1, option2, ...)"
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
    full_files, full_rows = full
    _require_columns(full_rows, full_files, ["question", "answer"])
    if not full_rows or len(full_rows) % qa_per_author:
        raise ValueError(
            f"{full_files[0]}: {len(full_rows)} rows is not a positive multiple of "
            f"qa_per_author={qa_per_author}"
        )

    num_authors = len(full_rows) // qa_per_author
    names = [f"author_{i}" for i in range(num_authors)]
    author_qa = [
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
        files, rows = loaded
        _require_columns(rows, files, ["question", "paraphrased_answer", "perturbed_answer"])
        for row in rows:
            matches = by_question.get(_norm(row["question"]))
            if not matches:
                raise ValueError(f"{files[0]}: question not found in full: {row['question']!r}")
            if "answer" in row and len(matches) > 1:
                same = [i for i in matches if _norm(author_qa[i]["answer"]) == _norm(row["answer"])]
                matches = same or matches
            for i in matches:
                author_qa[i]["paraphrased_answer"] = str(row["paraphrased_answer"])
                author_qa[i]["perturbed_answer"] = _as_list(row["perturbed_answer"])

    extras: dict[str, list[dict[str, Any]]] = {}
    for name in ("real_authors", "world_facts"):
        loaded = read(f"{name}_perturbed") or read(name)
        extras[name] = [] if loaded is None else _extra_records(loaded[1], loaded[0])
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
            files, rows = loaded
            expected = [_norm(r["question"]) for r in data.forget_split(percent)]
            _require_columns(rows, files, ["question"])
            found = [_norm(r["question"]) for r in rows]
            ok = sorted(found) == sorted(expected) if exact else set(found) <= set(expected)
            if not ok:
                raise ValueError(
                    f"{files[0]}: questions do not match the last "
                    f"{len(data.forget_authors(percent))} authors of full; "
                    "is qa_per_author right?"
                )
