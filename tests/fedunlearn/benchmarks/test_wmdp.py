"""Tests for the synthetic WMDP-style benchmark (fictitious hazard domains + general set)."""

from __future__ import annotations

import re
import time
from collections import Counter

import pytest
import torch

import fedunlearn.benchmarks.wmdp  # noqa: F401  (registers "wmdp")
from fedunlearn.benchmarks import get_benchmark
from fedunlearn.benchmarks.wmdp import (
    DOMAIN_DEFINITIONS,
    GENERAL,
    HAZARD_DOMAINS,
    NUM_CHOICES,
    WmdpData,
    generate_wmdp,
    generate_wmdp_background,
    mc_text,
    wmdp_knowledge_texts,
)
from fedunlearn.qa_format import format_answer, format_prompt

ATTRIBUTES = 5


@pytest.fixture(scope="module")
def data() -> WmdpData:
    return generate_wmdp(seed=0)


def _all_questions(d: WmdpData) -> list[dict]:
    return [q for qs in d.questions.values() for q in qs] + d.general_questions


def _invented_words(name: str) -> list[str]:
    """The invented (capitalised) words of an entity name: 'the Veltrax spore' -> ['Veltrax']."""
    return [w for w in name.split() if w[:1].isupper()]


def test_registered_under_wmdp() -> None:
    assert get_benchmark("wmdp") is generate_wmdp


def test_every_domain_has_five_attributes_with_big_enough_pools() -> None:
    assert set(DOMAIN_DEFINITIONS) == {*HAZARD_DOMAINS, GENERAL}
    for spec in DOMAIN_DEFINITIONS.values():
        assert len(spec.attributes) == ATTRIBUTES
        for attribute in spec.attributes:
            assert len(set(attribute.pool)) == len(attribute.pool) >= 7
            assert len(attribute.statements) >= 3


def test_same_seed_same_data_and_different_seed_differs(data: WmdpData) -> None:
    assert generate_wmdp(seed=0) == data
    other = generate_wmdp(seed=1)
    assert [q["entity"] for q in other.questions["bio"]] != [
        q["entity"] for q in data.questions["bio"]
    ]
    assert [r["text"] for r in other.general_corpus] != [r["text"] for r in data.general_corpus]


def test_a_domain_does_not_depend_on_the_other_domains(data: WmdpData) -> None:
    alone = generate_wmdp(seed=0, domains=("cyber",))
    assert alone.domains == ["cyber"]
    assert alone.questions["cyber"] == data.questions["cyber"]
    assert alone.corpora["cyber"] == data.corpora["cyber"]
    assert alone.general_questions == data.general_questions


def test_counts_and_domain_order(data: WmdpData) -> None:
    assert data.domains == list(HAZARD_DOMAINS)
    assert list(data.corpora) == list(HAZARD_DOMAINS)
    for domain in HAZARD_DOMAINS:
        assert len(data.questions[domain]) == 40 * ATTRIBUTES
        assert len(data.corpora[domain]) == 40 * 3
        assert {q["domain"] for q in data.questions[domain]} == {domain}
        assert {r["domain"] for r in data.corpora[domain]} == {domain}
    assert len(data.general_questions) == 60 * ATTRIBUTES
    assert len(data.general_corpus) == 60 * 3
    assert {q["domain"] for q in data.general_questions} == {GENERAL}
    small = generate_wmdp(
        seed=4,
        domains=("chem", "bio"),
        entities_per_domain=3,
        general_entities=2,
        documents_per_entity=2,
    )
    assert small.domains == ["chem", "bio"]
    assert len(small.questions["chem"]) == 15 and len(small.corpora["bio"]) == 6
    assert len(small.general_questions) == 10 and len(small.general_corpus) == 4


def test_question_records_are_valid(data: WmdpData) -> None:
    for q in _all_questions(data):
        assert set(q) == {"question", "choices", "answer", "domain", "entity"}
        assert q["question"].endswith("?")
        assert q["entity"] in q["question"]
        assert len(q["choices"]) == NUM_CHOICES
        assert len(set(q["choices"])) == NUM_CHOICES
        assert all(isinstance(c, str) and c for c in q["choices"])
        assert isinstance(q["answer"], int) and 0 <= q["answer"] < NUM_CHOICES
    questions = [q["question"] for q in _all_questions(data)]
    assert len(set(questions)) == len(questions)


def test_answer_positions_are_roughly_balanced(data: WmdpData) -> None:
    counts = Counter(q["answer"] for q in _all_questions(data))
    total = sum(counts.values())
    assert set(counts) == set(range(NUM_CHOICES))
    for position in range(NUM_CHOICES):
        assert 0.19 < counts[position] / total < 0.31, counts


def test_documents_state_the_answer_and_never_a_distractor(data: WmdpData) -> None:
    docs: dict[str, list[str]] = {}
    for record in data.text_records():
        assert set(record) == {"text", "domain", "entity"}
        docs.setdefault(record["entity"], []).append(record["text"])
    for q in _all_questions(data):
        entity_docs = docs[q["entity"]]
        assert len(entity_docs) == 3 and len(set(entity_docs)) == 3  # different phrasings
        for j, choice in enumerate(q["choices"]):
            pattern = re.compile(rf"\b{re.escape(choice)}\b", re.IGNORECASE)
            stated = [bool(pattern.search(t)) for t in entity_docs]
            if j == q["answer"]:
                assert all(stated), (q, entity_docs)
            else:
                assert not any(stated), (q, choice)


def test_entity_names_are_unique_and_domains_use_disjoint_words(data: WmdpData) -> None:
    words_by_domain = {
        domain: {w for q in qs for w in _invented_words(q["entity"])}
        for domain, qs in [*data.questions.items(), (GENERAL, data.general_questions)]
    }
    assert len(words_by_domain["bio"]) == 40 and len(words_by_domain[GENERAL]) == 60
    domains = list(words_by_domain)
    for i, a in enumerate(domains):
        for b in domains[i + 1 :]:
            assert not words_by_domain[a] & words_by_domain[b], (a, b)


def test_background_shares_no_name_with_the_benchmark(data: WmdpData) -> None:
    background = generate_wmdp_background(seed=0, num_documents=500)
    assert background == generate_wmdp_background(seed=0, num_documents=500)
    assert background != generate_wmdp_background(seed=1, num_documents=500)
    assert len(background) == 500 and all(isinstance(t, str) and t for t in background)
    text = "\n".join(background)
    bench_words = {w for q in _all_questions(data) for w in _invented_words(q["entity"])}
    for word in bench_words:
        assert not re.search(rf"\b{word}\b", text), word
    # ... while the vocabulary (pools, templates) is shared.
    assert "the favourite targets of" in text and "is famous for" in text
    # Other seeds of the benchmark are disjoint as well (names depend only on the onsets).
    other_words = {
        w for q in _all_questions(generate_wmdp(7)) for w in _invented_words(q["entity"])
    }
    assert not any(re.search(rf"\b{w}\b", text) for w in other_words)


def test_text_records_index_space(data: WmdpData) -> None:
    records = data.text_records()
    expected = [*data.corpora["bio"], *data.corpora["cyber"], *data.corpora["chem"]]
    assert records == [*expected, *data.general_corpus]
    assert data.text_indices("bio") == list(range(0, 120))
    assert data.text_indices("cyber") == list(range(120, 240))
    assert data.text_indices("chem") == list(range(240, 360))
    assert data.text_indices(GENERAL) == list(range(360, 540))
    assert all(records[i]["domain"] == "cyber" for i in data.text_indices("cyber"))
    with pytest.raises(KeyError, match="unknown domain"):
        data.text_indices("physics")


def test_knowledge_texts(data: WmdpData) -> None:
    q = data.questions["bio"][0]
    assert mc_text(q) == format_prompt(q["question"]) + format_answer(q["choices"][q["answer"]])
    texts = wmdp_knowledge_texts(data, ["bio"])
    assert texts[:120] == [r["text"] for r in data.corpora["bio"]]
    assert texts[120:320] == [mc_text(q) for q in data.questions["bio"]]
    assert texts[320:] == [r["text"] for r in data.general_corpus] + [
        mc_text(q) for q in data.general_questions
    ]
    assert not any("Analyst" in t or "port" in t.split() for t in texts)  # nothing from cyber
    everything = wmdp_knowledge_texts(data)
    assert len(everything) == 3 * (120 + 200) + 180 + 300
    assert len(wmdp_knowledge_texts(data, ["chem"], include_general=False)) == 320
    with pytest.raises(KeyError, match="unknown domains"):
        wmdp_knowledge_texts(generate_wmdp(0, domains=("bio",), entities_per_domain=1), ["cyber"])


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="unknown hazard domains"):
        generate_wmdp(domains=("bio", "physics"))
    with pytest.raises(ValueError, match="duplicate"):
        generate_wmdp(domains=("bio", "bio"))
    with pytest.raises(ValueError, match=">= 1"):
        generate_wmdp(entities_per_domain=0)
    with pytest.raises(ValueError, match="documents_per_entity"):
        generate_wmdp(documents_per_entity=0)


def test_data_validation() -> None:
    q = {"question": "Q?", "choices": ["a", "b", "c", "d"], "answer": 4, "domain": "bio"}
    with pytest.raises(ValueError, match="not a valid index"):
        WmdpData({"bio": [q]}, [], {"bio": []}, [], 0)
    with pytest.raises(ValueError, match="same domains"):
        WmdpData({"bio": []}, [], {"cyber": []}, [], 0)
    with pytest.raises(ValueError, match="reserved"):
        WmdpData({GENERAL: []}, [], {GENERAL: []}, [], 0)


@pytest.mark.slow
def test_tiny_llama_learns_a_domain_and_stays_at_chance_on_an_unseen_one() -> None:
    """Trained on bio (cyber) knowledge, a tiny Llama answers bio (cyber) well above chance and
    the domain it never saw at chance. Measured (seed 0): 0.975 on the trained domain,
    0.275 / 0.175 on the unseen one, about 25 s on a loaded 2-core CPU."""
    from fedunlearn.evaluation.multiple_choice import evaluate_wmdp
    from fedunlearn.models.llama import new_tiny_llama, tiny_llama_config
    from fedunlearn.models.tokenizer import train_bpe_tokenizer
    from fedunlearn.training.full import train_full

    started = time.perf_counter()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        data = generate_wmdp(
            seed=0,
            domains=("bio", "cyber"),
            entities_per_domain=8,
            general_entities=4,
            documents_per_entity=2,
        )
        tokenizer = train_bpe_tokenizer(generate_wmdp_background(0, 1000), 1000)
        config = tiny_llama_config(
            len(tokenizer),
            hidden_size=64,
            num_hidden_layers=2,
            intermediate_size=128,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        reports = {}
        for trained in ("bio", "cyber"):
            examples = []
            for text in wmdp_knowledge_texts(data, [trained]):
                ids = tokenizer(text, add_special_tokens=False)["input_ids"][:127]
                ids.append(tokenizer.eos_token_id)
                examples.append((ids, list(ids)))
            model = new_tiny_llama(config, seed=0)
            train_full(
                model,
                examples,
                pad_token_id=tokenizer.pad_token_id,
                epochs=20,
                lr=3e-3,
                batch_size=8,
                show_progress=False,
            )
            reports[trained] = evaluate_wmdp(model, tokenizer, data)
    finally:
        torch.set_num_threads(previous_threads)
    elapsed = time.perf_counter() - started
    summary = {
        t: {k: r[k] for k in ("accuracy_bio", "accuracy_cyber", "general_accuracy")}
        for t, r in reports.items()
    }
    print(f"WMDP tiny-Llama accuracies: {summary}; {elapsed:.1f} s")
    for trained, unseen in (("bio", "cyber"), ("cyber", "bio")):
        report = reports[trained]
        assert report["chance"] == pytest.approx(0.25)
        assert report[f"accuracy_{trained}"] >= 0.7, summary
        assert report[f"accuracy_{unseen}"] <= 0.45, summary
        assert report["general_accuracy"] >= 0.6, summary
