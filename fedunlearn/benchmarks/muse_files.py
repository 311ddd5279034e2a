"""Load a local copy of a published MUSE corpus (``muse-bench/MUSE-News`` / ``MUSE-Books``).

``path`` is the corpus folder. Each config is a sub-folder and each split one or more files
in it; for a split the first of these that exists is read:

1. ``<config>/<split>-*.parquet`` (the shards of a Hugging Face snapshot, e.g.
   ``knowmem/forget_qa-00000-of-00001.parquet``);
2. ``<config>/<split>.parquet`` / ``.jsonl`` / ``.json`` or a ``<config>/<split>/`` folder of
   such files (:func:`fedunlearn.benchmarks.tofu_files.find_config_files`), which covers the
   GitHub repository's ``data/<corpus>/`` folders (``knowmem/forget_qa.json`` ...);
3. ``<config>/<split>.txt``: the whole file is ONE document (as MUSE's own code reads its raw
   ``.txt`` files before chunking them by tokens).

Parquet and JSON files are read one at a time with ``datasets.load_dataset("parquet" |
"json", data_files=...)`` (:mod:`fedunlearn.benchmarks.data_files`); nothing is fetched from
the hub. A JSON file holding a list of strings (the GitHub ``raw/*.json`` and
``privleak/*.json`` files) becomes a ``text`` column.

Configs and splits used (``raw/forget`` is required, every other part is optional and empty
when missing; a damaged file, a missing column or a record without a value raises
``DataFileError`` naming the file, the row and the column):

* ``raw`` (column ``text``): ``forget`` -> forget passages; ``retain1`` then ``retain2`` ->
  retain passages (both were seen by MUSE's target model; retain1 is the set unlearning methods
  may use, retain2 the one KnowMem-retain asks about); ``holdout`` -> holdout passages.
  ``book`` is the split name. ``chunk_chars`` optionally cuts long documents (MUSE-Books
  ``raw`` holds whole books) into pieces at whitespace.
* ``knowmem`` (``question``, ``answer``): ``forget_qa`` -> forget QA (``book="forget"``),
  ``retain_qa`` or, in older revisions, ``retain2_qa`` -> retain QA (``book="retain2"``). The
  ``*_icl`` few-shot splits are not loaded.
* ``verbmem`` (``prompt``, ``gt``): ``forget`` -> verbatim probes.
* ``privleak`` (``text``): ``forget`` / ``holdout`` -> ``MuseData.privleak_forget`` /
  ``privleak_holdout``, the member / non-member texts of PrivLeak (MUSE scores these 100 + 100
  texts rather than the whole raw splits).

How this was verified (July 2024 revisions, read through the documentation and code search
corpora, not downloaded): the Hugging Face dataset cards of MUSE-News and MUSE-Books list the
configs ``raw`` (splits ``forget``, ``retain1``, ``retain2``, ``holdout``; feature ``text``),
``knowmem`` (``forget_qa``, ``retain_qa``, ``forget_qa_icl``, ``retain_qa_icl``; earlier
revisions ``retain2_qa``/``retain2_qa_icl``; features ``question``, ``answer``), ``verbmem``
(``forget``; features ``prompt``, ``gt``, an earlier revision also ``rougeL_target``) and
``privleak`` (``forget``, ``retain`` (earlier ``retain2``), ``holdout``; feature ``text``),
with ``data_files`` patterns ``<config>/<split>-*``; the file listings show
``<config>/<split>-00000-of-00001.parquet`` next to older ``<config>/<split>.json`` uploads.
In the GitHub repository ``jaechan-repo/muse_bench``, ``data/bbc/knowmem/forget_qa.json`` is
a JSON list of ``{"question", "answer"}``, ``data/bbc/verbmem/forget.json`` a list of
``{"prompt", "gt"}``, ``data/*/privleak/*.json`` and ``data/hp/raw/retain1.json`` lists of
strings, and ``data/hp/raw/holdout.txt`` plain text; ``data/upload_to_hf.py`` builds the hub
configs from exactly these folders (one split per ``.json`` file).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedunlearn.benchmarks.data_files import DataFileError, Table, read_table
from fedunlearn.benchmarks.muse import MuseData
from fedunlearn.benchmarks.tofu_files import find_config_files

RAW_RETAIN_SPLITS = ("retain1", "retain2")
RETAIN_QA_SPLITS = ("retain_qa", "retain2_qa")  # current name first, older revisions second


def find_split_files(root: Path, config: str, split: str) -> list[Path] | None:
    """Files holding ``split`` of ``config`` under ``root`` (see the module docstring), or None."""
    folder = root / config
    if not folder.is_dir():
        return None
    shards = sorted(p for p in folder.glob(f"{split}-*.parquet") if p.is_file())
    if shards:
        return shards
    files = find_config_files(folder, split)
    if files is not None:
        return files
    text = folder / f"{split}.txt"
    return [text] if text.is_file() else None


def _read_table(files: list[Path], cache_dir: str | None) -> Table:
    """Rows of ``files``: a ``.txt`` file is one ``{"text": ...}`` row, others via datasets."""
    if files[0].suffix != ".txt":
        return read_table(files, cache_dir)
    rows = []
    for path in files:
        try:
            rows.append({"text": path.read_text(encoding="utf-8")})
        except UnicodeDecodeError as err:
            raise DataFileError(f"{path}: byte {err.start}: not UTF-8 text") from None
    return Table(tuple(files), (("text",),) * len(files), tuple(range(len(files))), rows)


def chunk_text(text: str, max_chars: int) -> list[str]:
    """``text`` cut at whitespace into stripped pieces of at most ``max_chars`` characters.

    A single word longer than ``max_chars`` stays whole. Empty pieces are dropped.
    """
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    pieces: list[str] = []
    rest = text.strip()
    while len(rest) > max_chars:
        cut = max(rest.rfind(" ", 0, max_chars + 1), rest.rfind("\n", 0, max_chars + 1))
        if cut <= 0:  # no whitespace in reach: cut after the over-long word instead
            found = [i for i in (rest.find(" ", max_chars), rest.find("\n", max_chars)) if i > 0]
            cut = min(found) if found else len(rest)
        pieces.append(rest[:cut].strip())
        rest = rest[cut:].strip()
    pieces.append(rest)
    return [p for p in pieces if p]


class _Reader:
    def __init__(self, root: Path, cache_dir: str | None) -> None:
        self.root, self.cache_dir = root, cache_dir

    def __call__(
        self, config: str, splits: Sequence[str], columns: Sequence[str]
    ) -> list[tuple[str, ...]] | None:
        """Column values of the first of ``splits`` present in ``config``, or None."""
        for split in splits:
            files = find_split_files(self.root, config, split)
            if files is not None:
                rows = _read_table(files, self.cache_dir).require(columns).rows
                return [tuple(str(row[c]) for c in columns) for row in rows]
        return None


def load_muse_files(
    path: str | os.PathLike[str],
    *,
    chunk_chars: int | None = None,
    retain_splits: Sequence[str] = RAW_RETAIN_SPLITS,
    cache_dir: str | None = None,
) -> MuseData:
    """Build :class:`~fedunlearn.benchmarks.muse.MuseData` from the MUSE files in ``path``.

    Args:
        path: the corpus folder (a snapshot of ``muse-bench/MUSE-News`` or ``MUSE-Books``, or
            the GitHub repository's ``data/bbc`` / ``data/hp``).
        chunk_chars: when set, every raw document longer than this is cut at whitespace into
            pieces of at most ``chunk_chars`` characters (one passage each).
        retain_splits: the ``raw`` splits that make up the retain passages, in order.
        cache_dir: passed to ``datasets.load_dataset``.

    The returned data has ``seed == 0``; text records are the forget passages followed by the
    retain passages, as for generated data.
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"MUSE directory not found: {root}")
    read = _Reader(root, cache_dir)

    def passages(split: str, kind: str) -> list[dict[str, Any]]:
        rows = read("raw", [split], ["text"]) or []
        texts = [text for (text,) in rows]
        if chunk_chars is not None:
            texts = [piece for text in texts for piece in chunk_text(text, chunk_chars)]
        return [{"text": t, "book": split, "split": kind} for t in texts if t.strip()]

    if find_split_files(root, "raw", "forget") is None:
        raise FileNotFoundError(
            f"{root}: no raw forget split; expected raw/forget-*.parquet, "
            "raw/forget.{parquet,jsonl,json,txt} or raw/forget/"
        )

    def qa(splits: Sequence[str], book: str) -> list[dict[str, Any]]:
        rows = read("knowmem", splits, ["question", "answer"]) or []
        return [{"question": q, "answer": a, "book": book} for q, a in rows]

    probes = read("verbmem", ["forget"], ["prompt", "gt"]) or []
    return MuseData(
        forget_passages=passages("forget", "forget"),
        retain_passages=[p for split in retain_splits for p in passages(split, "retain")],
        holdout_passages=passages("holdout", "holdout"),
        forget_qa=qa(["forget_qa"], "forget"),
        retain_qa=qa(RETAIN_QA_SPLITS, "retain2"),
        verbmem=[{"prompt": p, "gt": g} for p, g in probes],
        seed=0,
        privleak_forget=[t for (t,) in read("privleak", ["forget"], ["text"]) or []],
        privleak_holdout=[t for (t,) in read("privleak", ["holdout"], ["text"]) or []],
    )
