"""Tests for loading a local TOFU export (small fake files in the published layout)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fedunlearn.benchmarks.data_files import DataFileError
from fedunlearn.benchmarks.tofu import has_perturbations
from fedunlearn.benchmarks.tofu_files import load_tofu_files
from tests.shared_paths import SHARED_DATA

AUTHORS, QA = 10, 4


def _full_rows() -> list[dict]:
    return [
        {"question": f"Q{a}-{k}: what about author {a}?", "answer": f"Answer {a}-{k}."}
        for a in range(AUTHORS)
        for k in range(QA)
    ]


def _perturbed(rows: list[dict]) -> list[dict]:
    return [
        {
            **r,
            "paraphrased_answer": f"Paraphrase of {r['answer']}",
            "perturbed_answer": [f"Wrong {i} {r['answer']}" for i in range(3)],
        }
        for r in rows
    ]


def _write(root: Path, config: str, rows: list[dict], fmt: str) -> None:
    if fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), root / f"{config}.parquet")
    elif fmt == "jsonl":
        (root / f"{config}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        (root / f"{config}.json").write_text(json.dumps(rows))


def _write_export(root: Path, fmt: str, real_with_options: bool = False) -> list[dict]:
    full = _full_rows()
    _write(root, "full", full, fmt)
    for name, authors in (("forget01", 1), ("forget05", 1), ("forget10", 1)):
        _write(root, f"{name}_perturbed", _perturbed(full[-authors * QA :]), fmt)
    _write(root, "forget10", full[-QA:], fmt)
    _write(root, "retain_perturbed", _perturbed(full[:3]), fmt)
    if real_with_options:
        real = [
            {
                "question": "Who wrote Emma?",
                "answer": "Jane Austen",
                "option1": "Jane Austen",
                "option2": "Homer",
                "option3": "Mark Twain",
                "option4": "Leo Tolstoy",
            },
        ]
    else:
        real = [
            {
                "question": "Who wrote Emma?",
                "answer": "Jane Austen wrote Emma.",
                "paraphrased_answer": "Emma is by Jane Austen.",
                "perturbed_answer": [
                    "Homer wrote Emma.",
                    "Mark Twain wrote Emma.",
                    "Leo Tolstoy wrote Emma.",
                ],
            },
        ]
    _write(root, "real_authors_perturbed", real, fmt)
    world = [
        {
            "question": f"Capital {i}?",
            "answer": f"City {i}.",
            "perturbed_answer": [f"City {j}." for j in range(4) if j != i],
        }
        for i in range(4)
    ]
    _write(root, "world_facts_perturbed", world, fmt)
    return full


@pytest.mark.parametrize("fmt", ["parquet", "json", "jsonl"])
def test_load_structure_and_splits(tmp_path: Path, fmt: str) -> None:
    full = _write_export(tmp_path, fmt)
    data = load_tofu_files(tmp_path, qa_per_author=QA, cache_dir=str(tmp_path / "cache"))

    assert data.author_names == [f"author_{i}" for i in range(AUTHORS)]
    assert [r["question"] for r in data.author_qa] == [r["question"] for r in full]
    assert [r["answer"] for r in data.author_qa] == [r["answer"] for r in full]
    assert [r["author"] for r in data.author_qa[QA : 2 * QA]] == ["author_1"] * QA

    # forget01 of 10 authors = the last author = the file's forget01 rows.
    forget = data.forget_split(1)
    assert [r["question"] for r in forget] == [r["question"] for r in full[-QA:]]
    assert len(data.retain_split(1)) == (AUTHORS - 1) * QA
    assert data.forget_authors(10) == ["author_9"]

    # Perturbations attached to the matching question, absent elsewhere.
    for r in forget:
        assert r["paraphrased_answer"] == f"Paraphrase of {r['answer']}"
        assert r["perturbed_answer"] == [f"Wrong {i} {r['answer']}" for i in range(3)]
    with_info = [r["question"] for r in data.author_qa if has_perturbations(r)]
    assert with_info == [r["question"] for r in full[:3] + full[-QA:]]
    middle = data.author_qa[5]
    assert middle["paraphrased_answer"] == "" and middle["perturbed_answer"] == []

    assert len(data.real_authors) == 1 and len(data.world_facts) == 4
    real = data.real_authors[0]
    assert real["paraphrased_answer"] == "Emma is by Jane Austen."
    assert len(real["perturbed_answer"]) == 3
    world = data.world_facts[2]
    assert world["answer"] == "City 2."
    assert world["paraphrased_answer"] == "City 2."  # no paraphrase column: the answer itself
    assert world["perturbed_answer"] == ["City 0.", "City 1.", "City 3."]
    assert data.splits(5)["world_facts"] == data.world_facts


def test_option_columns_become_perturbed_answers(tmp_path: Path) -> None:
    _write_export(tmp_path, "parquet", real_with_options=True)
    data = load_tofu_files(tmp_path, qa_per_author=QA, cache_dir=str(tmp_path / "cache"))
    real = data.real_authors[0]
    assert real["answer"] == "Jane Austen"
    assert real["perturbed_answer"] == ["Homer", "Mark Twain", "Leo Tolstoy"]


def test_only_full_is_required(tmp_path: Path) -> None:
    _write(tmp_path, "full", _full_rows(), "parquet")
    data = load_tofu_files(tmp_path, qa_per_author=QA, cache_dir=str(tmp_path / "cache"))
    assert len(data.author_qa) == AUTHORS * QA
    assert data.real_authors == [] and data.world_facts == []
    assert not any(has_perturbations(r) for r in data.author_qa)


def test_hf_snapshot_layout(tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    pq.write_table(pa.Table.from_pylist(_full_rows()), tmp_path / "full" / "train-0.parquet")
    data = load_tofu_files(tmp_path, qa_per_author=QA, cache_dir=str(tmp_path / "cache"))
    assert len(data.author_names) == AUTHORS


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not found"):
        load_tofu_files(tmp_path / "nope")


def test_missing_full_names_expected_files(tmp_path: Path) -> None:
    _write(tmp_path, "retain_perturbed", _perturbed(_full_rows()[:2]), "json")
    with pytest.raises(FileNotFoundError, match=r"full\.parquet.*full\.json"):
        load_tofu_files(tmp_path, qa_per_author=QA)


def test_missing_column_names_file_and_column(tmp_path: Path) -> None:
    _write(tmp_path, "full", _full_rows(), "parquet")
    rows = [
        {k: v for k, v in r.items() if k != "paraphrased_answer"}
        for r in _perturbed(_full_rows()[-QA:])
    ]
    _write(tmp_path, "forget01_perturbed", rows, "parquet")
    with pytest.raises(ValueError, match=r"forget01_perturbed\.parquet.*'paraphrased_answer'"):
        load_tofu_files(tmp_path, qa_per_author=QA, cache_dir=str(tmp_path / "cache"))

    bad_full = tmp_path / "other"
    bad_full.mkdir()
    _write(bad_full, "full", [{"question": "q?"}] * QA, "json")
    with pytest.raises(ValueError, match=r"full\.json.*'answer'"):
        load_tofu_files(bad_full, qa_per_author=QA, cache_dir=str(tmp_path / "cache"))


def test_row_count_and_question_mismatches(tmp_path: Path) -> None:
    _write(tmp_path, "full", _full_rows(), "parquet")
    cache = str(tmp_path / "cache")
    with pytest.raises(ValueError, match="multiple of qa_per_author=3"):
        load_tofu_files(tmp_path, qa_per_author=3, cache_dir=cache)

    # forget01 file inconsistent with qa_per_author: the split check catches it.
    _write(tmp_path, "forget01", _full_rows()[-2 * QA :], "parquet")
    with pytest.raises(ValueError, match="is qa_per_author right"):
        load_tofu_files(tmp_path, qa_per_author=QA, cache_dir=cache)
    assert len(load_tofu_files(tmp_path, qa_per_author=2 * QA, cache_dir=cache).author_names) == 5

    unknown = [{"question": "Never asked?", "paraphrased_answer": "p", "perturbed_answer": ["x"]}]
    _write(tmp_path, "retain_perturbed", unknown, "parquet")
    with pytest.raises(ValueError, match="not found in full"):
        load_tofu_files(tmp_path, qa_per_author=2 * QA, cache_dir=cache)


# --- damaged copies of the real files (issue 13): errors name the file and the record --------

SHARED_TOFU = SHARED_DATA / "tofu"
REAL_QA = 20  # the published files: 20 questions per author


def _real_lines(name: str, count: int) -> list[str]:
    """The first ``count`` JSON lines of a real TOFU file (read only; copies go to tmp_path)."""
    path = SHARED_TOFU / name
    assert path.is_file(), f"{path} is missing: the tests need shared/data"
    return path.read_text(encoding="utf-8").splitlines()[:count]


def _load_real_copy(root: Path):
    return load_tofu_files(root, qa_per_author=REAL_QA, cache_dir=str(root / "cache"))


def test_real_records_copy_loads(tmp_path: Path) -> None:
    lines = _real_lines("full.json", 2 * REAL_QA)
    (tmp_path / "full.json").write_text("\n".join(lines) + "\n")
    data = _load_real_copy(tmp_path)
    assert [r["question"] for r in data.author_qa] == [json.loads(x)["question"] for x in lines]


def test_truncated_json_line_names_file_and_line(tmp_path: Path) -> None:
    lines = _real_lines("full.json", 2 * REAL_QA)
    lines[-1] = lines[-1][:60]  # the file ends in the middle of its 40th record
    (tmp_path / "full.json").write_text("\n".join(lines))
    with pytest.raises(DataFileError, match=r"full\.json: not a readable json file: line 40 "):
        _load_real_copy(tmp_path)


def test_record_without_a_question_names_file_and_row(tmp_path: Path) -> None:
    lines = _real_lines("full.json", 2 * REAL_QA)
    record = json.loads(lines[6])
    lines[6] = json.dumps({"query": record.pop("question"), **record})
    (tmp_path / "full.json").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataFileError, match=r"full\.json row 6: no value in column 'question'"):
        _load_real_copy(tmp_path)


def test_file_that_is_not_parquet_is_named(tmp_path: Path) -> None:
    lines = _real_lines("full.json", 2 * REAL_QA)
    (tmp_path / "full.parquet").write_text("\n".join(lines))  # JSON under a parquet name
    with pytest.raises(DataFileError, match=r"full\.parquet: not a readable parquet file: .*"):
        _load_real_copy(tmp_path)


def test_damaged_second_shard_is_the_one_named(tmp_path: Path) -> None:
    rows = [json.loads(x) for x in _real_lines("full.json", 2 * REAL_QA)]
    (tmp_path / "full").mkdir()
    pq.write_table(pa.Table.from_pylist(rows[:REAL_QA]), tmp_path / "full" / "train-0.parquet")
    shard = tmp_path / "full" / "train-1.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"question": r["question"]} for r in rows[REAL_QA:]]), shard
    )
    with pytest.raises(DataFileError, match=r"train-1\.parquet: missing column 'answer'"):
        _load_real_copy(tmp_path)
    shard.write_bytes(shard.read_bytes()[:-20])  # cut off the footer
    with pytest.raises(DataFileError, match=r"train-1\.parquet: not a readable parquet file"):
        _load_real_copy(tmp_path)


def test_perturbed_record_names_its_row(tmp_path: Path) -> None:
    (tmp_path / "full.json").write_text("\n".join(_real_lines("full.json", 2 * REAL_QA)) + "\n")
    perturbed = [json.loads(x) for x in _real_lines("retain_perturbed.json", 5)]
    perturbed[3]["paraphrased_answer"] = None
    (tmp_path / "retain_perturbed.json").write_text(
        "".join(json.dumps(r) + "\n" for r in perturbed)
    )
    with pytest.raises(DataFileError, match=r"retain_perturbed\.json row 3: no value in column "):
        _load_real_copy(tmp_path)
