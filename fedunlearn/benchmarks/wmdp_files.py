"""Load local copies of the published WMDP questions, WMDP corpora and MMLU as :class:`WmdpData`.

Nothing is fetched: files are read one at a time with ``datasets.load_dataset("parquet" |
"json", data_files=...)`` (:mod:`fedunlearn.benchmarks.data_files`: a damaged file, a missing
column or a missing value raises ``DataFileError`` naming the file and the row). A config is
found like the TOFU configs (:func:`fedunlearn.benchmarks.tofu_files.find_config_files`): a
file ``<config>.parquet``, ``<config>.jsonl`` or ``<config>.json``, or a folder ``<config>/``
holding such files (the layout of a Hugging Face snapshot, e.g.
``wmdp-bio/test-00000-of-00001.parquet``).

Schemas (checked against the dataset cards / file listings of the Hugging Face repositories
and code that reads them; see the notes at the end):

* ``cais/wmdp``: configs ``wmdp-bio``, ``wmdp-cyber``, ``wmdp-chem``, one split ``test``;
  columns ``question: string``, ``choices: list[string]``, ``answer: int64`` (index into
  ``choices``). -> ``WmdpData.questions[domain]``.
* ``cais/wmdp-corpora``: configs ``bio-retain-corpus``, ``cyber-forget-corpus``,
  ``cyber-retain-corpus`` (split ``train``, column ``text``); the gated ``bio-forget-corpus``
  is distributed as ``bio-forget-corpus.jsonl`` with ``title``, ``abstract``, ``text``,
  ``doi`` (also published as the gated repository ``cais/wmdp-bio-forget-corpus``, so a
  config named ``wmdp-<domain>-forget-corpus`` is accepted as well). Only ``text`` is used.
  Forget corpora -> ``WmdpData.corpora[domain]`` (chem has
  none: empty), retain corpora of the loaded domains -> ``WmdpData.general_corpus``. A missing
  corpus gives an empty list.
* ``cais/mmlu``: config ``all`` or one config per subject (``abstract_algebra``, ...), splits
  ``test``, ``validation``, ``dev`` (and ``auxiliary_train``) stored as
  ``<config>/<split>-*.parquet``; columns ``question: string``, ``subject: string``,
  ``choices: list[string]``, ``answer`` (a ClassLabel A-D, stored as int64).
  -> ``WmdpData.general_questions``.

Records get the generator's keys: questions ``{"question", "choices", "answer", "domain",
"entity": ""}`` (MMLU rows also keep ``subject``), texts ``{"text", "domain", "entity": ""}``
with domain ``"general"`` for retain corpora and MMLU. ``answer`` may also be a digit string
or a letter ("A" = 0).

Verified with a search over Hugging Face pages and public code: the ``cais/wmdp`` dataset
card (``dataset_info``: configs ``wmdp-bio`` / ``wmdp-chem`` / ``wmdp-cyber``, features
``answer: int64``, ``question: string``, ``choices: sequence[string]``, split ``test``, files
``wmdp-<domain>/test-*``); the ``cais/wmdp-corpora`` file tree
(``bio-retain-corpus/train-0000k-of-00004.parquet``,
``cyber-retain-corpus/train-00000-of-00001.parquet``, a ``cyber-forget-corpus/`` folder) and
code that loads ``bio-retain-corpus`` expecting a ``text`` column and the bio forget corpus
expecting ``title`` / ``abstract`` / ``text``; the MMLU card as reproduced by mirrors of
``cais/mmlu`` (``all`` config with ``question``, ``subject``, ``choices``, ``answer``
ClassLabel A-D; splits test 14042 / validation 1531 / dev 285; files ``all/<split>-*``). Not
verified directly: the ``doi`` column of the bio forget corpus (from the task description;
unused) and the ``text`` column of the two cyber corpora (inferred from code that trains on
them as plain text, like the bio retain corpus).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedunlearn.benchmarks.data_files import Table, read_table
from fedunlearn.benchmarks.tofu_files import EXTENSIONS, find_config_files
from fedunlearn.benchmarks.wmdp import GENERAL, HAZARD_DOMAINS, WmdpData

MC_COLUMNS = ("question", "choices", "answer")
SPLITS = ("test", "validation", "dev", "auxiliary_train", "train")

__all__ = ["load_wmdp_files", "load_wmdp_questions", "load_mmlu_questions"]


def _answer_index(value: Any, n_choices: int, where: str) -> int:
    if isinstance(value, str):
        text = value.strip()
        if text.isdigit():
            index = int(text)
        elif len(text) == 1 and text.isalpha():
            index = ord(text.upper()) - ord("A")
        else:
            raise ValueError(f"{where}: answer {value!r} is neither an index nor a letter")
    elif isinstance(value, bool) or value is None:
        raise ValueError(f"{where}: answer {value!r} is not an index")
    else:
        index = int(value)
    if not 0 <= index < n_choices:
        raise ValueError(f"{where}: answer {value!r} is out of range for {n_choices} choices")
    return index


def _mc_records(table: Table, domain: str) -> list[dict[str, Any]]:
    records = []
    for i, row in enumerate(table.rows):
        where = table.where(i)
        choices = row["choices"]
        if isinstance(choices, str) or not isinstance(choices, Sequence) or len(choices) < 2:
            raise ValueError(f"{where}: 'choices' must be a list of >= 2 options, got {choices!r}")
        choices = [str(c) for c in choices]
        record: dict[str, Any] = {
            "question": str(row["question"]),
            "choices": choices,
            "answer": _answer_index(row["answer"], len(choices), where),
            "domain": domain,
            "entity": "",
        }
        if "subject" in row:
            record["subject"] = str(row["subject"] or "")
        records.append(record)
    return records


def _text_records(
    root: Path, configs: Sequence[str], domain: str, cache_dir: str | None, limit: int | None
) -> list[dict[str, Any]]:
    """Text records of the first of ``configs`` present under ``root`` ([] if none is)."""
    for config in configs:
        files = find_config_files(root, config)
        if files is not None:
            break
    else:
        return []
    table = read_table(files, cache_dir, required=["text"], optional=(), limit=limit)
    return [
        {"text": str(r["text"]), "domain": domain, "entity": ""}
        for r in table.rows
        if str(r["text"]).strip()
    ]


def load_wmdp_questions(
    path: str | os.PathLike[str],
    domains: Sequence[str] | None = None,
    *,
    cache_dir: str | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """The ``wmdp-<domain>`` question configs under ``path`` (see the module docstring).

    ``domains=None`` loads every domain present (at least one is required); an explicitly
    named domain without its file is an error.
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"WMDP directory not found: {root}")
    if domains is None:
        chosen = [d for d in HAZARD_DOMAINS if find_config_files(root, f"wmdp-{d}") is not None]
        if not chosen:
            expected = ", ".join(f"wmdp-{d}{{{','.join(EXTENSIONS)}}}" for d in HAZARD_DOMAINS)
            raise FileNotFoundError(f"{root}: no WMDP question files; expected any of {expected}")
    else:
        chosen = list(domains)
        unknown = [d for d in chosen if d not in HAZARD_DOMAINS]
        if unknown:
            raise ValueError(f"unknown WMDP domains {unknown}; choose from {HAZARD_DOMAINS}")
    questions: dict[str, list[dict[str, Any]]] = {}
    for domain in chosen:
        files = find_config_files(root, f"wmdp-{domain}")
        if files is None:
            raise FileNotFoundError(
                f"{root}: no file for config 'wmdp-{domain}' "
                f"(wmdp-{domain}.parquet/.jsonl/.json or a wmdp-{domain}/ folder)"
            )
        table = read_table(files, cache_dir, required=MC_COLUMNS, optional=())
        questions[domain] = _mc_records(table, domain)
    return questions


def _split_of(file: Path, folder: Path) -> str | None:
    """The split a file belongs to, from a ``<split>/`` folder or a ``<split>-``/``<split>.``
    file-name prefix; None when neither says."""
    for part in file.relative_to(folder).parts[:-1]:
        if part in SPLITS:
            return part
    for split in SPLITS:
        if file.name.startswith((f"{split}-", f"{split}.")):
            return split
    return None


def _split_files(files: list[Path], folder: Path, split: str) -> list[Path]:
    """Files of ``split``; all files when none of them carries a split label."""
    labels = [_split_of(f, folder) for f in files]
    if all(label is None for label in labels):
        return files
    return [f for f, label in zip(files, labels, strict=True) if label == split]


def load_mmlu_questions(
    path: str | os.PathLike[str], *, split: str = "test", cache_dir: str | None = None
) -> list[dict[str, Any]]:
    """MMLU questions of ``split`` from a local copy of ``cais/mmlu``.

    Looks for the ``all`` config first (``all.parquet`` or ``all/<split>-*.parquet``), else
    every per-subject folder ``<subject>/<split>-*`` (sorted by name, ``auxiliary_train``
    skipped), else ``<split>-*`` files directly in ``path``. Unlabelled files (no split in
    their name or folder) are taken whole.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown MMLU split {split!r}; choose from {SPLITS}")
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"MMLU directory not found: {root}")
    groups: list[list[Path]] = []
    all_files = find_config_files(root, "all")
    if all_files is not None:
        folder = root / "all" if (root / "all").is_dir() else root
        groups.append(_split_files(all_files, folder, split))
    else:
        for sub in sorted(p for p in root.iterdir() if p.is_dir()):
            if sub.name == "auxiliary_train" or sub.name in SPLITS:
                continue
            files = find_config_files(root, sub.name)
            if files is not None:
                groups.append(_split_files(files, sub, split))
        if not any(groups):
            for ext in EXTENSIONS:
                direct = sorted(p for p in root.glob(f"*{ext}") if _split_of(p, root) == split)
                if direct:
                    groups.append(direct)
                    break
    groups = [g for g in groups if g]
    if not groups:
        raise FileNotFoundError(
            f"{root}: no MMLU files for split {split!r} (expected all/{split}-*.parquet, "
            f"<subject>/{split}-*.parquet or {split}-*.parquet)"
        )
    records: list[dict[str, Any]] = []
    for files in groups:
        table = read_table(files, cache_dir, required=MC_COLUMNS, optional=("subject",))
        records.extend(_mc_records(table, GENERAL))
    return records


def load_wmdp_files(
    path: str | os.PathLike[str],
    *,
    mmlu_path: str | os.PathLike[str] | None = None,
    domains: Sequence[str] | None = None,
    corpora_path: str | os.PathLike[str] | None = None,
    mmlu_split: str = "test",
    max_corpus_documents: int | None = None,
    cache_dir: str | None = None,
) -> WmdpData:
    """Build :class:`WmdpData` from local WMDP (and optionally MMLU) files.

    Args:
        path: folder with the ``wmdp-<domain>`` question configs (and, unless
            ``corpora_path`` is given, the ``<domain>-forget-corpus`` /
            ``<domain>-retain-corpus`` configs).
        mmlu_path: folder with a local ``cais/mmlu`` copy; None = no general questions.
        domains: hazard domains; None = every ``wmdp-<domain>`` config present.
        corpora_path: folder with the WMDP corpora (default: ``path``).
        mmlu_split: MMLU split used as the general set.
        max_corpus_documents: keep at most this many documents of each corpus (the corpora
            are large: the bio retain corpus is about 0.9 GB).
        cache_dir: passed to ``datasets.load_dataset``.

    Returns:
        The data with ``seed == 0``. Corpora missing on disk are empty lists.
    """
    questions = load_wmdp_questions(path, domains, cache_dir=cache_dir)
    corpora_root = Path(corpora_path) if corpora_path is not None else Path(path)
    if not corpora_root.is_dir():
        raise FileNotFoundError(f"WMDP corpora directory not found: {corpora_root}")
    corpora = {
        d: _text_records(
            corpora_root,
            [f"{d}-forget-corpus", f"wmdp-{d}-forget-corpus"],
            d,
            cache_dir,
            max_corpus_documents,
        )
        for d in questions
    }
    general_corpus: list[dict[str, Any]] = []
    for d in questions:
        general_corpus.extend(
            _text_records(
                corpora_root, [f"{d}-retain-corpus"], GENERAL, cache_dir, max_corpus_documents
            )
        )
    general_questions = (
        []
        if mmlu_path is None
        else load_mmlu_questions(mmlu_path, split=mmlu_split, cache_dir=cache_dir)
    )
    return WmdpData(
        questions=questions,
        general_questions=general_questions,
        corpora=corpora,
        general_corpus=general_corpus,
        seed=0,
    )
