"""Tests for the synthetic TOFU-style benchmark and the benchmark registry."""

from __future__ import annotations

import pytest

from fedunlearn.benchmarks import BENCHMARKS, get_benchmark, register_benchmark
from fedunlearn.benchmarks.tofu import (
    TEMPLATES,
    TofuData,
    generate_background_corpus,
    generate_tofu,
    has_perturbations,
    knowledge_texts,
)
from fedunlearn.qa_format import format_prompt

KEYS = {"question", "answer", "paraphrased_answer", "perturbed_answer", "author"}


@pytest.fixture(scope="module")
def data() -> TofuData:
    return generate_tofu(seed=0)


def _all_records(d: TofuData) -> list[dict]:
    return d.author_qa + d.real_authors + d.world_facts


def test_registry_has_tofu_and_rejects_duplicates() -> None:
    assert get_benchmark("tofu") is generate_tofu
    with pytest.raises(ValueError, match="already registered"):
        register_benchmark("tofu")(lambda: None)
    with pytest.raises(KeyError, match="available: .*tofu"):
        get_benchmark("no-such-benchmark")
    assert BENCHMARKS["tofu"] is generate_tofu


def test_same_seed_same_data_and_different_seed_differs(data: TofuData) -> None:
    again = generate_tofu(seed=0)
    assert again == data
    other = generate_tofu(seed=1)
    assert other.author_names != data.author_names
    assert [r["answer"] for r in other.author_qa] != [r["answer"] for r in data.author_qa]


def test_counts(data: TofuData) -> None:
    assert len(data.author_names) == 200
    assert len(set(data.author_names)) == 200
    assert len(data.author_qa) == 200 * 10
    assert len(data.real_authors) >= 40
    assert len(data.world_facts) >= 60
    small = generate_tofu(seed=3, num_authors=7, qa_per_author=4)
    assert len(small.author_qa) == 28
    for name in small.author_names:
        assert sum(r["author"] == name for r in small.author_qa) == 4


def test_qa_grouped_by_author_in_order(data: TofuData) -> None:
    order = [r["author"] for r in data.author_qa]
    assert order == [name for name in data.author_names for _ in range(10)]


def test_schema_and_types(data: TofuData) -> None:
    for r in _all_records(data):
        assert set(r) - {"sensitive_spans"} == KEYS
        assert all(isinstance(r[k], str) for k in KEYS - {"perturbed_answer"})
        assert isinstance(r["perturbed_answer"], list)
        assert all(isinstance(p, str) for p in r["perturbed_answer"])
        assert r["question"].endswith("?")
        assert has_perturbations(r)
    assert all(r["author"] == "" for r in data.world_facts)
    assert all(r["author"] and r["author"] in r["answer"] for r in data.real_authors)


def test_answers_are_short_sentences(data: TofuData) -> None:
    for r in _all_records(data):
        for text in [r["answer"], r["paraphrased_answer"], *r["perturbed_answer"]]:
            assert 6 <= len(text.split()) <= 16, text
            assert text.endswith(".")


def test_perturbed_and_paraphrase_are_valid(data: TofuData) -> None:
    for r in _all_records(data):
        perturbed = r["perturbed_answer"]
        assert len(perturbed) >= 3
        assert len(set(perturbed)) == len(perturbed)
        assert r["answer"] not in perturbed
        assert r["paraphrased_answer"] not in perturbed
        assert r["paraphrased_answer"] != r["answer"]


def test_perturbed_keep_the_paraphrase_template(data: TofuData) -> None:
    # As in TOFU, a perturbed answer is the paraphrased answer with the fact swapped, so the
    # truth ratio compares sentences of the same wording.
    for r in data.author_qa:
        para = r["paraphrased_answer"].split()
        for p in r["perturbed_answer"]:
            words = p.split()
            assert r["author"] in p
            assert words[:2] == para[:2] or words[-2:] == para[-2:]
            assert p != r["paraphrased_answer"]


def test_questions_use_distinct_templates_per_author(data: TofuData) -> None:
    for name in data.author_names[:20]:
        questions = [r["question"] for r in data.author_qa if r["author"] == name]
        assert len(set(questions)) == 10
    with pytest.raises(ValueError, match="qa_per_author"):
        generate_tofu(num_authors=5, qa_per_author=len(TEMPLATES) + 1)


def test_answers_name_the_author_and_are_not_shared(data: TofuData) -> None:
    for r in data.author_qa:
        assert r["author"] in r["answer"]
        assert r["author"] in r["paraphrased_answer"]
        assert r["author"] in r["question"]
    answers = [r["answer"] for r in data.author_qa]
    assert len(set(answers)) == len(answers)
    # No two authors share the same set of facts (answers with the name removed).
    fact_sets = {
        frozenset(r["answer"].replace(name, "") for r in data.author_qa if r["author"] == name)
        for name in data.author_names
    }
    assert len(fact_sets) == len(data.author_names)


@pytest.mark.parametrize(("percent", "authors"), [(1, 2), (5, 10), (10, 20)])
def test_forget_splits(data: TofuData, percent: int, authors: int) -> None:
    forget_authors = data.forget_authors(percent)
    assert forget_authors == data.author_names[-authors:]
    forget = data.forget_split(percent)
    retain = data.retain_split(percent)
    assert len(forget) == authors * 10
    assert len(retain) == (200 - authors) * 10
    assert {r["author"] for r in forget} == set(forget_authors)
    assert not {r["author"] for r in retain} & set(forget_authors)
    forget_q = {r["question"] for r in forget}
    retain_q = {r["question"] for r in retain}
    assert not forget_q & retain_q
    assert forget_q | retain_q == {r["question"] for r in data.author_qa}
    splits = data.splits(percent)
    assert set(splits) == {"forget", "retain", "real_authors", "world_facts"}
    assert splits["forget"] == forget and splits["retain"] == retain
    assert splits["world_facts"] == data.world_facts


def test_forget_percent_rounding_and_errors() -> None:
    small = generate_tofu(seed=0, num_authors=10, qa_per_author=2)
    assert small.forget_authors(1) == small.author_names[-1:]  # at least one author
    assert small.forget_authors(5) == small.author_names[-1:]
    assert small.forget_authors(25) == small.author_names[-3:]  # 2.5 rounds up
    for bad in (0, -5, 100, 150):
        with pytest.raises(ValueError, match=str(bad)):
            small.forget_split(bad)
    with pytest.raises(ValueError, match="no retain"):
        small.forget_split(99)


def test_background_corpus_is_disjoint_from_benchmark_authors() -> None:
    corpus = generate_background_corpus(seed=0, num_documents=3000)
    assert len(corpus) == 3000
    assert corpus == generate_background_corpus(seed=0, num_documents=3000)
    assert corpus != generate_background_corpus(seed=1, num_documents=3000)
    text = "\n".join(corpus)
    words = set(text.replace(".", " ").replace("?", " ").split())
    for seed in (0, 1, 2):
        for name in generate_tofu(seed=seed).author_names:
            assert name not in text
            assert not set(name.split()) & words
    # Same vocabulary as the benchmark: its cities and question templates appear.
    assert "was born in the town of" in text
    assert "Where was" in text


def test_knowledge_texts(data: TofuData) -> None:
    texts = knowledge_texts(data)
    assert len(texts) == len(data.real_authors) + len(data.world_facts)
    first = data.real_authors[0]
    assert texts[0].startswith(format_prompt(first["question"]))
    assert texts[0].endswith(first["answer"])
    prose = knowledge_texts(data, qa_format=False)
    assert first["paraphrased_answer"] in prose[0]
    assert "Question:" not in prose[0]
    assert "The capital of France is Paris." in "\n".join(prose)
