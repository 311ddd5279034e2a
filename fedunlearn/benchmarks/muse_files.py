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
  texts rather than the whole raw splits); ``retain`` or, in older revisions, ``retain2`` ->
  ``privleak_retain`` (retain articles the target model was trained on).

The offline MUSE-News copy of this project (``shared/data/muse-news``, the GitHub layout with
the older names) is read by the tests: ``raw/forget.json`` (889 articles; ``raw/forget.txt``
beside it is ignored, JSON comes first), ``knowmem/forget_qa.json`` and ``retain2_qa.json``
(100 QA each), ``verbmem/forget.json`` (100 probes) and ``privleak/{forget,retain2,holdout}
.json`` (100 texts each). Its ``raw`` retain and holdout splits are missing (too large), so the
loaded retain and holdout passages are empty.

:func:`muse_subset` cuts what a small model is fine-tuned on and scored with out of these
published lists (first ``n`` items, texts cut to a few dozen words).

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
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedunlearn.benchmarks.data_files import DataFileError, Table, read_table
from fedunlearn.benchmarks.muse import MuseData
from fedunlearn.benchmarks.tofu_files import find_config_files

RAW_RETAIN_SPLITS = ("retain1", "retain2")
RETAIN_QA_SPLITS = ("retain_qa", "retain2_qa")  # current name first, older revisions second
PRIVLEAK_RETAIN_SPLITS = ("retain", "retain2")


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
        privleak_retain=[t for (t,) in read("privleak", PRIVLEAK_RETAIN_SPLITS, ["text"]) or []],
    )


# --- the CPU-sized subset a small pretrained model is fine-tuned on (issue 14) ---------------

#: VerbMem probes of the subset: the last words of the published prompt, the first words of
#: its ground truth (MUSE's own probes: about 900-token prompts, 128-token continuations)
VERBMEM_PROMPT_WORDS = 24
VERBMEM_GT_WORDS = 40
#: PrivLeak and retain texts of the subset: the first words of each published text (~8 kB)
PRIVLEAK_WORDS = 64


def head_words(text: str, n: int) -> str:
    """``text`` up to the end of its ``n``-th word (whitespace before and inside kept)."""
    words = list(re.finditer(r"\S+", text))
    return text[: words[n - 1].end()] if len(words) > n else text


def tail_words(text: str, n: int) -> str:
    """``text`` from the start of its ``n``-th last word (whitespace inside and after kept)."""
    words = list(re.finditer(r"\S+", text))
    return text[words[-n].start() :] if len(words) > n else text


def join_probe(prompt: str, gt: str, articles: str) -> str:
    """``prompt`` and its continuation ``gt`` as one text, as the article has them.

    MUSE cut its VerbMem probes at LLaMA tokens: ``gt`` may continue the prompt's last word
    (``"co" + "-leader"``) or follow a space the cut dropped (``"but" + "down"``). The joint
    ("" or " ") under which the junction occurs in ``articles`` (the raw forget articles)
    wins; without one, a space unless whitespace is already there.
    """
    for joint in ("", " "):
        if f"{prompt[-40:]}{joint}{gt[:40]}" in articles:
            return f"{prompt}{joint}{gt}"
    joint = "" if prompt[-1:].isspace() or gt[:1].isspace() else " "
    return f"{prompt}{joint}{gt}"


def muse_subset(data: MuseData, n: int | None = None) -> MuseData:
    """The first ``n`` items (all when None) of each published list, texts cut to a size a
    small model learns on a CPU; what a pretrained model is fine-tuned on and scored with.

    * forget passages: the VerbMem excerpts (book ``verbmem``: the last
      :data:`VERBMEM_PROMPT_WORDS` words of probe i's prompt joined to the first
      :data:`VERBMEM_GT_WORDS` words of its ground truth, :func:`join_probe`), then the
      PrivLeak forget texts (book ``privleak``: the first :data:`PRIVLEAK_WORDS` words of
      text i);
    * retain passages: the first :data:`PRIVLEAK_WORDS` words of the PrivLeak retain texts
      (MUSE-News ``privleak/retain2``), or of the raw retain passages where there are none;
    * holdout passages / PrivLeak non-members: the first :data:`PRIVLEAK_WORDS` words of the
      PrivLeak holdout texts; PrivLeak members: the cut forget texts, exactly as trained;
    * KnowMem forget / retain QA and the VerbMem probes (cut as above): the first ``n``.

    The raw forget articles are not trained on: the KnowMem questions cannot be traced to one
    article (a short answer such as a year occurs in many), so the QA themselves are the
    knowledge a model is fine-tuned on.

    Raises:
        ValueError: ``n < 1``, or no forget or no retain record left.
    """
    if n is not None and n < 1:
        raise ValueError(f"a MUSE subset needs n >= 1 items of each list, got {n}")

    def first(items: list) -> list:
        return list(items[:n])

    def cut(texts: list[str], split: str, book: str) -> list[dict[str, Any]]:
        kept = [head_words(t, PRIVLEAK_WORDS).strip() for t in first(texts)]
        return [{"text": t, "book": book, "split": split} for t in kept if t]

    members, nonmembers = data.privleak_texts()
    articles = "\n".join(r["text"] for r in data.forget_passages)
    cuts = [
        (
            tail_words(str(p["prompt"]), VERBMEM_PROMPT_WORDS),
            head_words(str(p["gt"]), VERBMEM_GT_WORDS),
        )
        for p in first(data.verbmem)
    ]
    verbmem = [{"prompt": prompt, "gt": gt.strip()} for prompt, gt in cuts]
    excerpts = [
        {"text": join_probe(prompt, gt, articles).strip(), "book": "verbmem", "split": "forget"}
        for prompt, gt in cuts
    ]
    forget = excerpts + cut(members, "forget", "privleak")
    retain_texts = data.privleak_retain or [r["text"] for r in data.retain_passages]
    retain = cut(retain_texts, "retain", "privleak-retain")
    holdout = cut(nonmembers, "holdout", "privleak-holdout")
    subset = MuseData(
        forget_passages=forget,
        retain_passages=retain,
        holdout_passages=holdout,
        forget_qa=first(data.forget_qa),
        retain_qa=first(data.retain_qa),
        verbmem=verbmem,
        seed=data.seed,
        privleak_forget=[r["text"] for r in forget if r["book"] == "privleak"],
        privleak_holdout=[r["text"] for r in holdout],
        privleak_retain=[r["text"] for r in retain],
    )
    if not (subset.forget_passages or subset.forget_qa):
        raise ValueError("the MUSE files leave no forget text (verbmem, privleak) and no forget QA")
    if not (subset.retain_passages or subset.retain_qa):
        raise ValueError("the MUSE files leave no retain text (privleak, raw) and no retain QA")
    return subset
