"""Tests for the synthetic MUSE-style benchmark (fictional books)."""

from __future__ import annotations

import re

import pytest

from fedunlearn.benchmarks import get_benchmark
from fedunlearn.benchmarks.muse import (
    VERBMEM_PREFIX_WORDS,
    MuseData,
    generate_muse,
    generate_muse_background,
    muse_training_texts,
    verbmem_probe,
)
from fedunlearn.qa_format import format_answer, format_prompt

_HERO = re.compile(r"In the year \d+, (\w+ \w+) (?:left|set out)")
_COMPANION = re.compile(r"met (\w+ \w+),")


@pytest.fixture(scope="module")
def data() -> MuseData:
    return generate_muse(seed=0)


def _names(texts: list[str]) -> set[str]:
    return {m for t in texts for m in _HERO.findall(t) + _COMPANION.findall(t)}


def test_registered_and_deterministic(data: MuseData) -> None:
    assert get_benchmark("muse") is generate_muse
    assert generate_muse(seed=0) == data
    other = generate_muse(seed=1)
    assert [r["text"] for r in other.forget_passages] != [r["text"] for r in data.forget_passages]


def test_default_split_sizes(data: MuseData) -> None:
    assert len(data.forget_passages) == 4 * 8
    assert len(data.retain_passages) == 12 * 8
    assert len(data.holdout_passages) == 4 * 8
    assert len(data.forget_qa) == 4 * 8 * 2
    assert len(data.retain_qa) == 12 * 8 * 2
    assert len(data.verbmem) == len(data.forget_passages)
    assert data.seed == 0
    books = {
        split: {r["book"] for r in getattr(data, f"{split}_passages")}
        for split in ("forget", "retain", "holdout")
    }
    assert [len(b) for b in books.values()] == [4, 12, 4]
    assert not books["forget"] & books["retain"]
    assert not books["holdout"] & (books["forget"] | books["retain"])
    for split in books:
        assert all(r["split"] == split for r in getattr(data, f"{split}_passages"))


def test_small_configuration_and_validation() -> None:
    small = generate_muse(
        seed=3,
        num_books=5,
        passages_per_book=3,
        qa_per_passage=4,
        num_forget_books=1,
        num_holdout_books=2,
    )
    assert (len(small.forget_passages), len(small.retain_passages)) == (3, 6)
    assert (len(small.holdout_passages), len(small.forget_qa), len(small.retain_qa)) == (6, 12, 24)
    with pytest.raises(ValueError, match="no retain book"):
        generate_muse(num_books=3, num_forget_books=1, num_holdout_books=2)
    with pytest.raises(ValueError, match="qa_per_passage"):
        generate_muse(qa_per_passage=0)
    with pytest.raises(ValueError, match="qa_per_passage"):
        generate_muse(qa_per_passage=99)


def test_passages_are_short_narratives(data: MuseData) -> None:
    texts = [r["text"] for r in data.text_records() + data.holdout_passages]
    assert len(set(texts)) == len(texts)
    for text in texts:
        assert 40 <= len(text.split()) <= 80
        assert text.count(".") >= 5
        assert text == " ".join(text.split())  # single-spaced, no leading/trailing space


def test_every_answer_is_stated_in_a_passage_of_its_book(data: MuseData) -> None:
    by_book: dict[str, list[str]] = {}
    for r in data.text_records():
        by_book.setdefault(r["book"], []).append(r["text"])
    for records, passages in ((data.forget_qa, data.forget_passages), (data.retain_qa, None)):
        for qa in records:
            assert qa["question"].endswith("?")
            assert len(qa["answer"].split()) <= 5
            texts = by_book[qa["book"]]
            assert any(qa["answer"] in t for t in texts), qa
        if passages is not None:
            assert {q["book"] for q in records} == {p["book"] for p in passages}
    questions = [q["question"] for q in data.forget_qa + data.retain_qa]
    assert len(set(questions)) == len(questions)
    holdout_books = {r["book"] for r in data.holdout_passages}
    assert not holdout_books & {q["book"] for q in data.forget_qa + data.retain_qa}


def test_verbmem_probes_split_forget_passages(data: MuseData) -> None:
    for probe, passage in zip(data.verbmem, data.forget_passages, strict=True):
        assert len(probe["prompt"].split()) == VERBMEM_PREFIX_WORDS
        assert probe["prompt"] + " " + probe["gt"] == passage["text"]
        assert probe["gt"]
    with pytest.raises(ValueError, match="too short"):
        verbmem_probe("only three words")


def test_text_records_order_excludes_holdout(data: MuseData) -> None:
    records = data.text_records()
    assert records == data.forget_passages + data.retain_passages
    assert [r["split"] for r in records] == ["forget"] * 32 + ["retain"] * 96
    holdout = {r["text"] for r in data.holdout_passages}
    assert not holdout & {r["text"] for r in records}


def test_post_init_rejects_mislabelled_passages(data: MuseData) -> None:
    with pytest.raises(ValueError, match="forget_passages"):
        MuseData(
            forget_passages=data.retain_passages[:1],
            retain_passages=[],
            holdout_passages=[],
            forget_qa=[],
            retain_qa=[],
            verbmem=[],
            seed=0,
        )


def test_privleak_texts_default_to_forget_and_holdout(data: MuseData) -> None:
    members, nonmembers = data.privleak_texts()
    assert members == [r["text"] for r in data.forget_passages]
    assert nonmembers == [r["text"] for r in data.holdout_passages]


def test_training_texts(data: MuseData) -> None:
    full = muse_training_texts(data)
    retain_only = muse_training_texts(data, include_forget=False)
    qa_text = [format_prompt(q["question"]) + format_answer(q["answer"]) for q in data.forget_qa]
    forget_texts = [r["text"] for r in data.forget_passages] + qa_text
    assert full[: len(data.forget_passages)] == [r["text"] for r in data.forget_passages]
    assert set(forget_texts) <= set(full)
    assert not set(forget_texts) & set(retain_only)
    assert len(full) == 32 + 96 + 64 + 192
    assert len(retain_only) == 96 + 192
    assert set(retain_only) < set(full)
    holdout = {r["text"] for r in data.holdout_passages}
    assert not holdout & set(full)
    forget_names = _names([r["text"] for r in data.forget_passages])
    assert not any(name in text for name in forget_names for text in retain_only)


def test_background_is_deterministic_and_name_disjoint(data: MuseData) -> None:
    background = generate_muse_background(seed=0, num_documents=400)
    assert len(background) == 400
    assert background == generate_muse_background(seed=0, num_documents=400)
    assert generate_muse_background(seed=1, num_documents=50) != background[:50]
    assert any(t.startswith("In the year") for t in background)
    assert any(t.startswith(format_prompt("")[:9]) for t in background)
    bench_texts = [r["text"] for r in data.text_records() + data.holdout_passages]
    bench_names = _names(bench_texts)
    assert len(bench_names) == 20 * 8 + len({_HERO.findall(t)[0] for t in bench_texts})
    background_words = {w.strip(".,?") for t in background for w in t.split()}
    bench_words = {w for name in bench_names for w in name.split()}
    assert not bench_words & background_words
    assert _names(background)  # the background has characters of its own
