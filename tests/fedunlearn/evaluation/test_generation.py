"""Tests for batched greedy generation with left padding."""

from __future__ import annotations

from fedunlearn.evaluation import greedy_generate

QUESTIONS = [
    "Where was Ava Lind born?",
    "Who?",
    "Which city did Cleo Marsh move to after the old river house was sold in winter?",
    "What does Bram Osei write?",
    "What did Dario Venn love?",
]


def test_batched_equals_unbatched_untrained(untrained_model, tokenizer) -> None:
    single = [
        greedy_generate(untrained_model, tokenizer, [q], max_new_tokens=12)[0] for q in QUESTIONS
    ]
    for batch_size in (2, 5):
        batched = greedy_generate(
            untrained_model, tokenizer, QUESTIONS, max_new_tokens=12, batch_size=batch_size
        )
        assert batched == single


def test_batched_equals_unbatched_trained(trained_model, tokenizer, memorised_records) -> None:
    questions = [r["question"] for r in memorised_records] + QUESTIONS
    single = [greedy_generate(trained_model, tokenizer, [q])[0] for q in questions]
    assert greedy_generate(trained_model, tokenizer, questions, batch_size=16) == single


def test_memorised_answers_are_reproduced(trained_model, tokenizer, memorised_records) -> None:
    questions = [r["question"] for r in memorised_records]
    generations = greedy_generate(trained_model, tokenizer, questions, batch_size=3)
    assert generations == [r["answer"] for r in memorised_records]
    assert all("Question:" not in g and "<|" not in g for g in generations)


def test_empty_and_zero_budget(untrained_model, tokenizer) -> None:
    assert greedy_generate(untrained_model, tokenizer, []) == []
    assert greedy_generate(untrained_model, tokenizer, QUESTIONS[:2], max_new_tokens=0) == ["", ""]
