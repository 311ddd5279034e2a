"""Tests for loading local MUSE files (small fake files in the published layouts)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fedunlearn.benchmarks.data_files import DataFileError
from fedunlearn.benchmarks.muse_files import chunk_text, find_split_files, load_muse_files
from tests.shared_paths import SHARED_DATA

RAW = {
    "forget": ["Forget article one.", "Forget article two."],
    "retain1": ["Retain one A."],
    "retain2": ["Retain two A.", "Retain two B."],
    "holdout": ["Holdout A.", "Holdout B.", "Holdout C."],
}
FORGET_QA = [{"question": "Who wrote forget article one?", "answer": "Ann"}]
RETAIN_QA = [{"question": "What is retain two A?", "answer": "A retain fact"}]
ICL = [{"question": "ICL question?", "answer": "ICL answer"}]
VERBMEM = [{"prompt": "Forget article", "gt": "one."}, {"prompt": "Forget", "gt": "article two."}]
PRIVLEAK = {"forget": ["pf1", "pf2"], "retain": ["pr1"], "holdout": ["ph1", "ph2", "ph3"]}


def _parquet(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def _json(path: Path, payload: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload))


def _write_hf_snapshot(root: Path, retain_qa_name: str = "retain_qa") -> None:
    """``<config>/<split>-00000-of-00001.parquet`` as in the Hugging Face snapshot."""

    def shard(config: str, split: str, rows: list[dict]) -> None:
        _parquet(root / config / f"{split}-00000-of-00001.parquet", rows)

    for split, texts in RAW.items():
        shard("raw", split, [{"text": t} for t in texts])
    shard("knowmem", "forget_qa", FORGET_QA)
    shard("knowmem", retain_qa_name, RETAIN_QA)
    shard("knowmem", "forget_qa_icl", ICL)
    shard("verbmem", "forget", VERBMEM)
    for split, texts in PRIVLEAK.items():
        shard("privleak", split, [{"text": t} for t in texts])


def test_hf_snapshot_layout(tmp_path: Path) -> None:
    _write_hf_snapshot(tmp_path)
    # An older upload left a legacy JSON next to the parquet shard: the shards win.
    _json(tmp_path / "verbmem" / "forget.json", [{"prompt": "legacy", "gt": "legacy"}])
    data = load_muse_files(tmp_path, cache_dir=str(tmp_path / "cache"))
    assert [r["text"] for r in data.forget_passages] == RAW["forget"]
    assert {r["book"] for r in data.forget_passages} == {"forget"}
    assert [r["text"] for r in data.retain_passages] == RAW["retain1"] + RAW["retain2"]
    assert [r["book"] for r in data.retain_passages] == ["retain1", "retain2", "retain2"]
    assert all(r["split"] == "retain" for r in data.retain_passages)
    assert [r["text"] for r in data.holdout_passages] == RAW["holdout"]
    assert data.forget_qa == [{**FORGET_QA[0], "book": "forget"}]
    assert data.retain_qa == [{**RETAIN_QA[0], "book": "retain2"}]
    assert data.verbmem == VERBMEM
    assert data.privleak_texts() == (PRIVLEAK["forget"], PRIVLEAK["holdout"])
    assert data.text_records() == data.forget_passages + data.retain_passages
    assert data.seed == 0


def test_older_retain2_qa_name_and_sharded_splits(tmp_path: Path) -> None:
    _write_hf_snapshot(tmp_path, retain_qa_name="retain2_qa")
    _parquet(tmp_path / "raw" / "forget-00001-of-00002.parquet", [{"text": "Third forget."}])
    data = load_muse_files(tmp_path, cache_dir=str(tmp_path / "cache"))
    assert data.retain_qa == [{**RETAIN_QA[0], "book": "retain2"}]
    assert [r["text"] for r in data.forget_passages] == RAW["forget"] + ["Third forget."]
    shards = find_split_files(tmp_path, "raw", "forget")
    assert shards is not None and len(shards) == 2


def test_github_json_and_txt_layout(tmp_path: Path) -> None:
    """``data/<corpus>/``: JSON lists of strings / records and a plain ``.txt`` document."""
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "forget.txt").write_text("Whole forget book.\n\nSecond paragraph.\n")
    _json(tmp_path / "raw" / "retain1.json", RAW["retain1"])
    _json(tmp_path / "knowmem" / "forget_qa.json", FORGET_QA)
    _json(tmp_path / "knowmem" / "retain2_qa.json", RETAIN_QA)
    _json(tmp_path / "verbmem" / "forget.json", VERBMEM)
    _json(tmp_path / "privleak" / "forget.json", PRIVLEAK["forget"])
    _json(tmp_path / "privleak" / "holdout.json", PRIVLEAK["holdout"])
    data = load_muse_files(tmp_path, cache_dir=str(tmp_path / "cache"))
    assert [r["text"] for r in data.forget_passages] == [
        "Whole forget book.\n\nSecond paragraph.\n"
    ]
    assert [r["text"] for r in data.retain_passages] == RAW["retain1"]
    assert data.holdout_passages == []
    assert data.forget_qa[0]["answer"] == "Ann"
    assert data.retain_qa[0]["question"] == RETAIN_QA[0]["question"]
    assert data.verbmem == VERBMEM
    assert data.privleak_forget == PRIVLEAK["forget"]
    assert data.privleak_holdout == PRIVLEAK["holdout"]


def test_missing_optional_parts_are_empty(tmp_path: Path) -> None:
    _parquet(tmp_path / "raw" / "forget-00000-of-00001.parquet", [{"text": "Only forget."}])
    data = load_muse_files(tmp_path, cache_dir=str(tmp_path / "cache"))
    assert [r["text"] for r in data.forget_passages] == ["Only forget."]
    assert data.retain_passages == data.holdout_passages == []
    assert data.forget_qa == data.retain_qa == data.verbmem == []
    assert data.privleak_texts() == (["Only forget."], [])


def test_chunking_long_documents(tmp_path: Path) -> None:
    book = " ".join(f"word{i}" for i in range(50))
    _json(tmp_path / "raw" / "forget.json", [book])
    data = load_muse_files(tmp_path, chunk_chars=60, cache_dir=str(tmp_path / "cache"))
    pieces = [r["text"] for r in data.forget_passages]
    assert len(pieces) > 1
    assert all(len(p) <= 60 for p in pieces)
    assert " ".join(pieces) == book
    assert chunk_text("abcdefghij klm", 4) == ["abcdefghij", "klm"]
    assert chunk_text("  a b  ", 10) == ["a b"]
    with pytest.raises(ValueError, match="max_chars"):
        chunk_text("x", 0)


def test_errors_name_file_and_column(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not found"):
        load_muse_files(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="raw forget"):
        load_muse_files(tmp_path)
    _parquet(tmp_path / "raw" / "forget-00000-of-00001.parquet", [{"text": "x y z"}])
    # The earliest verbmem revision only had a ``text`` column.
    _parquet(tmp_path / "verbmem" / "forget-00000-of-00001.parquet", [{"text": "no prompt"}])
    with pytest.raises(ValueError, match=r"verbmem/forget-00000-of-00001\.parquet.*'prompt'"):
        load_muse_files(tmp_path, cache_dir=str(tmp_path / "cache"))
    (tmp_path / "verbmem" / "forget-00000-of-00001.parquet").unlink()
    _json(tmp_path / "knowmem" / "forget_qa.json", [{"question": "q?", "reply": "a"}])
    with pytest.raises(ValueError, match=r"forget_qa\.json.*'answer'"):
        load_muse_files(tmp_path, cache_dir=str(tmp_path / "cache"))


# --- damaged copies of the real files (issue 13): errors name the file and the record --------

SHARED_MUSE = SHARED_DATA / "muse-news"


def _real_muse(root: Path, qa_count: int) -> list[dict]:
    """``raw/forget.txt`` (its first 2 kB) and the first ``qa_count`` forget QA of MUSE-News."""
    assert SHARED_MUSE.is_dir(), f"{SHARED_MUSE} is missing: the tests need shared/data"
    (root / "raw").mkdir(parents=True)
    text = (SHARED_MUSE / "raw" / "forget.txt").read_text(encoding="utf-8")[:2000]
    (root / "raw" / "forget.txt").write_text(text, encoding="utf-8")
    qa = json.loads((SHARED_MUSE / "knowmem" / "forget_qa.json").read_text(encoding="utf-8"))
    return qa[:qa_count]


def test_damaged_real_muse_files_are_named(tmp_path: Path) -> None:
    cache = str(tmp_path / "cache")
    qa = _real_muse(tmp_path, 6)
    path = tmp_path / "knowmem" / "forget_qa.json"
    _json(path, qa)
    assert [r["answer"] for r in load_muse_files(tmp_path, cache_dir=cache).forget_qa] == [
        r["answer"] for r in qa
    ]

    _json(path, [*qa[:4], {"question": qa[4]["question"]}, qa[5]])
    with pytest.raises(DataFileError, match=r"forget_qa\.json row 4: no value in column 'answer'"):
        load_muse_files(tmp_path, cache_dir=cache)

    path.write_text(json.dumps(qa, indent=1)[:-40])  # a JSON array cut short
    with pytest.raises(DataFileError, match=r"forget_qa\.json: not a readable json file: line \d+"):
        load_muse_files(tmp_path, cache_dir=cache)

    (tmp_path / "raw" / "forget.txt").write_bytes(b"valid start \xff\xfe broken")
    with pytest.raises(DataFileError, match=r"forget\.txt: byte 12: not UTF-8"):
        load_muse_files(tmp_path, cache_dir=cache)
