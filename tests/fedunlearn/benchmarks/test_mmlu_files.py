"""Tests for the MMLU CSV and multiple-choice JSON-lines loaders on the real shared files."""

from __future__ import annotations

import csv
import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from fedunlearn.benchmarks.data_files import DataFileError
from fedunlearn.benchmarks.mmlu_files import (
    load_mc_jsonl,
    load_mmlu_csv,
    mmlu_subjects,
    mmlu_subset,
)
from tests.shared_paths import SHARED_DATA

SHARED_MMLU = SHARED_DATA / "mmlu"
SHARED_WMDP = SHARED_DATA / "wmdp-bio-200" / "wmdp_bio_200.jsonl"


@pytest.fixture(scope="module")
def mmlu_test() -> list[dict]:
    assert SHARED_MMLU.is_dir(), f"{SHARED_MMLU} is missing: the tests need shared/data"
    return load_mmlu_csv(SHARED_MMLU, "test")


def test_real_mmlu_test_split_has_the_published_size(mmlu_test: list[dict]) -> None:
    # 14,042 test questions in 57 subjects (Hendrycks et al.; cais/mmlu "all" test split).
    assert len(mmlu_test) == 14042
    counts = Counter(r["subject"] for r in mmlu_test)
    assert len(counts) == 57
    assert min(counts.values()) == 100  # the smallest subjects have 100 test questions
    assert list(counts) == sorted(counts)  # subjects come in name order, each contiguous
    assert all(len(r["choices"]) == 4 and r["answer"] in (0, 1, 2, 3) for r in mmlu_test)
    first = mmlu_test[0]
    assert first == {
        "question": "Find the degree for the given field extension Q(sqrt(2), sqrt(3), "
        "sqrt(18)) over Q.",
        "choices": ["0", "4", "2", "6"],
        "answer": 1,
        "subject": "abstract_algebra",
    }


def test_real_mmlu_dev_split_and_named_subjects() -> None:
    dev = load_mmlu_csv(SHARED_MMLU, "dev")
    assert len(dev) == 57 * 5  # five few-shot examples per subject
    assert mmlu_subjects(SHARED_MMLU, "dev") == mmlu_subjects(SHARED_MMLU, "test")
    two = load_mmlu_csv(SHARED_MMLU, "dev", subjects=["virology", "anatomy"])
    assert [r["subject"] for r in two] == ["anatomy"] * 5 + ["virology"] * 5
    with pytest.raises(FileNotFoundError, match=r"no file for MMLU subjects \['astrology'\]"):
        load_mmlu_csv(SHARED_MMLU, "dev", subjects=["astrology"])


def test_mmlu_subset_is_seeded_and_stated(mmlu_test: list[dict]) -> None:
    subset = mmlu_subset(mmlu_test, subjects=10, per_subject=10, seed=0)
    assert len(subset) == 100
    counts = Counter(r["subject"] for r in subset)
    assert len(counts) == 10 and set(counts.values()) == {10}
    positions = [next(i for i, r in enumerate(mmlu_test) if r is s) for s in subset]
    assert positions == sorted(positions)  # order of the records is kept
    assert mmlu_subset(mmlu_test, subjects=10, per_subject=10, seed=0) == subset
    other = mmlu_subset(mmlu_test, subjects=10, per_subject=10, seed=1)
    assert other != subset
    # A subject's questions do not depend on which other subjects were drawn.
    name = subset[0]["subject"]
    alone = mmlu_subset(mmlu_test, subjects=(name,), per_subject=10, seed=0)
    assert alone == [r for r in subset if r["subject"] == name]
    with pytest.raises(ValueError, match="has 100 questions < 101"):
        mmlu_subset(mmlu_test, subjects=("global_facts",), per_subject=101, seed=0)


def _copy_subject(tmp_path: Path, subject: str = "anatomy") -> Path:
    target = tmp_path / "test" / f"{subject}_test.csv"
    target.parent.mkdir(parents=True)
    shutil.copy(SHARED_MMLU / "test" / f"{subject}_test.csv", target)
    return target


def _rewrite(path: Path, edit) -> None:
    with path.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.reader(handle))
    edit(rows)
    with path.open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows(rows)


def test_damaged_mmlu_copies_name_file_and_row(tmp_path: Path) -> None:
    path = _copy_subject(tmp_path)
    assert len(load_mmlu_csv(tmp_path)) == 135  # anatomy: 135 test questions

    def bad_answer(rows: list[list[str]]) -> None:
        rows[8][5] = "4"  # data row 7 (after the header)

    _rewrite(path, bad_answer)
    with pytest.raises(DataFileError, match=r"anatomy_test\.csv row 7 \(line 9\): answer 4 "):
        load_mmlu_csv(tmp_path)

    _copy_subject(tmp_path / "b")
    _rewrite(tmp_path / "b" / "test" / "anatomy_test.csv", lambda rows: rows[3].pop())
    with pytest.raises(DataFileError, match=r"anatomy_test\.csv row 2 \(line 4\): 5 fields"):
        load_mmlu_csv(tmp_path / "b")

    _copy_subject(tmp_path / "c")

    def drop_answer_column(rows: list[list[str]]) -> None:
        for row in rows:
            row.pop()

    _rewrite(tmp_path / "c" / "test" / "anatomy_test.csv", drop_answer_column)
    with pytest.raises(DataFileError, match=r"anatomy_test\.csv: missing column 'answer'"):
        load_mmlu_csv(tmp_path / "c")


def test_real_wmdp_bio_200_jsonl() -> None:
    assert SHARED_WMDP.is_file(), f"{SHARED_WMDP} is missing: the tests need shared/data"
    records = load_mc_jsonl(SHARED_WMDP)
    assert len(records) == 200
    raw = [json.loads(line) for line in SHARED_WMDP.read_text(encoding="utf-8").splitlines()]
    assert records == [
        {"question": r["question"], "choices": r["choices"], "answer": r["answer"]} for r in raw
    ]


def test_damaged_jsonl_names_file_and_line(tmp_path: Path) -> None:
    lines = SHARED_WMDP.read_text(encoding="utf-8").splitlines()[:6]
    path = tmp_path / "q.jsonl"
    record = json.loads(lines[4])
    record["answer"] = 7
    path.write_text("\n".join([*lines[:4], json.dumps(record), lines[5]]) + "\n")
    with pytest.raises(DataFileError, match=r"q\.jsonl line 5: answer 7 is not an index"):
        load_mc_jsonl(path)
    del record["choices"]
    path.write_text("\n".join([*lines[:4], json.dumps(record), lines[5]]) + "\n")
    with pytest.raises(DataFileError, match=r"q\.jsonl line 5: no value for 'choices'"):
        load_mc_jsonl(path)
    path.write_text("\n".join([*lines[:2], lines[2][:40], *lines[3:]]) + "\n")
    with pytest.raises(DataFileError, match=r"q\.jsonl line 3 column \d+: Unterminated"):
        load_mc_jsonl(path)
