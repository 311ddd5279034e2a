"""Tests for loading local WMDP, WMDP-corpora and MMLU files (small fakes in their schemas)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fedunlearn.benchmarks.data_files import DataFileError
from fedunlearn.benchmarks.wmdp import GENERAL
from fedunlearn.benchmarks.wmdp_files import (
    load_mmlu_questions,
    load_wmdp_files,
    load_wmdp_questions,
)
from tests.shared_paths import SHARED_DATA


def _mc_rows(prefix: str, n: int) -> list[dict]:
    return [
        {
            "answer": i % 4,
            "question": f"{prefix} question {i}?",
            "choices": [f"{prefix} option {i}-{k}" for k in range(4)],
        }
        for i in range(n)
    ]


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        path.write_text(json.dumps(rows))


def _bio_forget_rows(n: int) -> list[dict]:
    return [
        {
            "title": f"Paper {i}",
            "abstract": f"Abstract {i}.",
            "text": f"Body {i}.",
            "doi": f"10/{i}",
        }
        for i in range(n)
    ]


def _write_wmdp(root: Path) -> None:
    # cais/wmdp: a flat file for bio, the Hugging Face snapshot layout for cyber; no chem.
    _write(root / "wmdp-bio.parquet", _mc_rows("bio", 6))
    _write(root / "wmdp-cyber" / "test-00000-of-00001.parquet", _mc_rows("cyber", 5))
    # cais/wmdp-corpora: the gated bio forget corpus as jsonl, the others as parquet folders.
    _write(root / "bio-forget-corpus.jsonl", _bio_forget_rows(4))
    _write(
        root / "cyber-forget-corpus" / "train-00000-of-00001.parquet",
        [{"text": f"Cyber doc {i}."} for i in range(3)] + [{"text": ""}],
    )
    _write(
        root / "bio-retain-corpus" / "train-00000-of-00002.parquet",
        [{"text": f"Retain A{i}."} for i in range(2)],
    )
    _write(
        root / "bio-retain-corpus" / "train-00001-of-00002.parquet",
        [{"text": f"Retain B{i}."} for i in range(2)],
    )


def _mmlu_rows(subject: str, split: str, n: int) -> list[dict]:
    return [
        {
            "question": f"{subject} {split} {i}?",
            "subject": subject,
            "choices": [f"{subject} {split} {i} choice {k}" for k in range(4)],
            "answer": (i + 1) % 4,
        }
        for i in range(n)
    ]


def _write_mmlu_all(root: Path) -> None:
    for split, n in (("test", 7), ("validation", 3), ("dev", 2)):
        _write(root / "all" / f"{split}-00000-of-00001.parquet", _mmlu_rows("mixed", split, n))


def test_load_wmdp_files(tmp_path: Path) -> None:
    _write_wmdp(tmp_path / "wmdp")
    _write_mmlu_all(tmp_path / "mmlu")
    data = load_wmdp_files(
        tmp_path / "wmdp", mmlu_path=tmp_path / "mmlu", cache_dir=str(tmp_path / "cache")
    )
    assert data.domains == ["bio", "cyber"]  # chem has no file: skipped
    assert data.seed == 0
    bio = data.questions["bio"]
    assert len(bio) == 6 and len(data.questions["cyber"]) == 5
    assert bio[2] == {
        "question": "bio question 2?",
        "choices": [f"bio option 2-{k}" for k in range(4)],
        "answer": 2,
        "domain": "bio",
        "entity": "",
    }
    assert [r["text"] for r in data.corpora["bio"]] == [f"Body {i}." for i in range(4)]
    assert [r["text"] for r in data.corpora["cyber"]] == [f"Cyber doc {i}." for i in range(3)]
    assert {r["domain"] for r in data.corpora["cyber"]} == {"cyber"}
    assert sorted(r["text"] for r in data.general_corpus) == sorted(
        [f"Retain A{i}." for i in range(2)] + [f"Retain B{i}." for i in range(2)]
    )
    assert {r["domain"] for r in data.general_corpus} == {GENERAL}
    general = data.general_questions
    assert [q["question"] for q in general] == [f"mixed test {i}?" for i in range(7)]
    assert general[0]["answer"] == 1 and general[0]["subject"] == "mixed"
    assert general[0]["domain"] == GENERAL
    records = data.text_records()
    assert len(records) == 4 + 3 + 4
    assert data.text_indices("cyber") == [4, 5, 6]


def test_domains_corpora_path_and_limits(tmp_path: Path) -> None:
    _write_wmdp(tmp_path / "wmdp")
    questions_only = tmp_path / "questions"
    _write(questions_only / "wmdp-chem.json", _mc_rows("chem", 3))
    _write(questions_only / "wmdp-bio.jsonl", _mc_rows("bio", 2))
    data = load_wmdp_files(
        questions_only,
        domains=["chem", "bio"],
        corpora_path=tmp_path / "wmdp",
        max_corpus_documents=2,
        cache_dir=str(tmp_path / "cache"),
    )
    assert data.domains == ["chem", "bio"]
    assert data.corpora["chem"] == []  # WMDP has no chem corpus
    assert [r["text"] for r in data.corpora["bio"]] == ["Body 0.", "Body 1."]
    assert len(data.general_corpus) == 2
    assert data.general_questions == []
    # The gated repository name of the bio forget corpus works too.
    renamed = tmp_path / "renamed"
    _write(renamed / "wmdp-bio.parquet", _mc_rows("bio", 2))
    _write(renamed / "wmdp-bio-forget-corpus" / "data" / "train-0.parquet", _bio_forget_rows(2))
    assert len(load_wmdp_files(renamed, cache_dir=str(tmp_path / "cache")).corpora["bio"]) == 2
    # Without corpora on disk every corpus is empty.
    bare = load_wmdp_files(questions_only, cache_dir=str(tmp_path / "cache"))
    assert bare.domains == ["bio", "chem"]
    assert bare.corpora == {"bio": [], "chem": []} and bare.general_corpus == []


def test_mmlu_layouts_and_splits(tmp_path: Path) -> None:
    per_subject = tmp_path / "per_subject"
    for subject in ("astronomy", "anatomy"):
        for split, n in (("test", 3), ("dev", 1)):
            _write(
                per_subject / subject / f"{split}-00000-of-00001.parquet",
                _mmlu_rows(subject, split, n),
            )
    _write(
        per_subject / "auxiliary_train" / "train-00000-of-00001.parquet", _mmlu_rows("aux", "x", 5)
    )
    questions = load_mmlu_questions(per_subject, cache_dir=str(tmp_path / "cache"))
    assert [q["subject"] for q in questions] == ["anatomy"] * 3 + ["astronomy"] * 3
    dev = load_mmlu_questions(per_subject, split="dev", cache_dir=str(tmp_path / "cache"))
    assert [q["question"] for q in dev] == ["anatomy dev 0?", "astronomy dev 0?"]

    _write_mmlu_all(tmp_path / "all_layout")
    validation = load_mmlu_questions(
        tmp_path / "all_layout", split="validation", cache_dir=str(tmp_path / "cache")
    )
    assert len(validation) == 3

    flat = tmp_path / "flat"  # an unlabelled all.jsonl is taken whole
    _write(flat / "all.jsonl", _mmlu_rows("mixed", "any", 4))
    assert len(load_mmlu_questions(flat, cache_dir=str(tmp_path / "cache"))) == 4

    with pytest.raises(FileNotFoundError, match="no MMLU files for split 'validation'"):
        load_mmlu_questions(per_subject, split="validation", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="unknown MMLU split"):
        load_mmlu_questions(per_subject, split="holdout")


def test_answer_letters_and_digit_strings(tmp_path: Path) -> None:
    rows = _mc_rows("bio", 3)
    for row, answer in zip(rows, ("C", "b", "0"), strict=True):
        row["answer"] = answer
    _write(tmp_path / "wmdp-bio.json", rows)
    questions = load_wmdp_questions(tmp_path, cache_dir=str(tmp_path / "cache"))
    assert [q["answer"] for q in questions["bio"]] == [2, 1, 0]


def test_clear_errors(tmp_path: Path) -> None:
    cache = str(tmp_path / "cache")
    with pytest.raises(FileNotFoundError, match="WMDP directory not found"):
        load_wmdp_files(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no WMDP question files"):
        load_wmdp_files(empty)

    no_choices = tmp_path / "no_choices"
    _write(no_choices / "wmdp-cyber.parquet", [{"question": "q?", "answer": 0}])
    with pytest.raises(ValueError, match=r"wmdp-cyber\.parquet: missing column 'choices'"):
        load_wmdp_files(no_choices, cache_dir=cache)

    with pytest.raises(FileNotFoundError, match="'wmdp-chem'"):
        load_wmdp_files(no_choices, domains=["chem"], cache_dir=cache)
    with pytest.raises(ValueError, match="unknown WMDP domains"):
        load_wmdp_files(no_choices, domains=["physics"], cache_dir=cache)

    bad_answer = tmp_path / "bad_answer"
    _write(bad_answer / "wmdp-bio.jsonl", [{"question": "q?", "choices": ["a", "b"], "answer": 5}])
    with pytest.raises(ValueError, match=r"wmdp-bio\.jsonl row 0: answer 5 is out of range"):
        load_wmdp_files(bad_answer, cache_dir=cache)

    bad_corpus = tmp_path / "bad_corpus"
    _write(bad_corpus / "wmdp-bio.parquet", _mc_rows("bio", 2))
    _write(bad_corpus / "bio-forget-corpus.jsonl", [{"title": "t", "abstract": "a"}])
    with pytest.raises(ValueError, match=r"bio-forget-corpus\.jsonl: missing column 'text'"):
        load_wmdp_files(bad_corpus, cache_dir=cache)

    valid = tmp_path / "valid"
    _write(valid / "wmdp-bio.parquet", _mc_rows("bio", 2))
    with pytest.raises(FileNotFoundError, match="MMLU directory not found"):
        load_wmdp_files(valid, mmlu_path=tmp_path / "nope", cache_dir=cache)


# --- damaged copies of the real files (issue 13): errors name the file and the record --------

SHARED_WMDP = SHARED_DATA / "wmdp-bio-200" / "wmdp_bio_200.jsonl"


def _real_wmdp_lines(count: int) -> list[str]:
    assert SHARED_WMDP.is_file(), f"{SHARED_WMDP} is missing: the tests need shared/data"
    return SHARED_WMDP.read_text(encoding="utf-8").splitlines()[:count]


def test_damaged_real_wmdp_records_are_named(tmp_path: Path) -> None:
    cache = str(tmp_path / "cache")
    lines = _real_wmdp_lines(8)
    path = tmp_path / "wmdp-bio.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert len(load_wmdp_questions(tmp_path, ["bio"], cache_dir=cache)["bio"]) == 8

    record = json.loads(lines[5])
    del record["answer"]
    path.write_text("\n".join([*lines[:5], json.dumps(record), *lines[6:]]) + "\n")
    with pytest.raises(DataFileError, match=r"wmdp-bio\.jsonl row 5: no value in column 'answer'"):
        load_wmdp_questions(tmp_path, ["bio"], cache_dir=cache)

    path.write_text("\n".join([*lines[:3], lines[3][:50], *lines[4:]]) + "\n")
    with pytest.raises(DataFileError, match=r"wmdp-bio\.jsonl: not a readable json file: line 4 "):
        load_wmdp_questions(tmp_path, ["bio"], cache_dir=cache)

    path.unlink()
    (tmp_path / "wmdp-bio.parquet").write_text("\n".join(lines))
    with pytest.raises(DataFileError, match=r"wmdp-bio\.parquet: not a readable parquet file"):
        load_wmdp_questions(tmp_path, ["bio"], cache_dir=cache)
