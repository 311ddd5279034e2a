"""Tests for batched answer likelihoods against a hand-written per-example computation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fedunlearn.evaluation import answer_nll, answer_probability
from fedunlearn.qa_format import encode_qa

QUESTIONS = [
    "Where was Ava Lind born?",
    "Who?",
    "Which city did Cleo Marsh move to after the old river house was sold in winter?",
    "What does Bram Osei write?",
    "What did Dario Venn love?",
]
ANSWERS = [
    "Ava Lind was born in Oslo.",
    "Bram.",
    "Cleo Marsh moved to Riga, then to Cork, and finally to Bern where she wrote plays.",
    "Poetry.",
    "The quiet river.",
]


def _manual_nll(model, tokenizer, question: str, answer: str) -> float:
    ids, labels = encode_qa(tokenizer, question, answer)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    log_probs = F.log_softmax(logits.float(), dim=-1)
    total, count = 0.0, 0
    for t in range(1, len(ids)):
        if labels[t] != -100:
            total -= float(log_probs[t - 1, labels[t]])
            count += 1
    return total / count


def test_answer_nll_matches_manual_per_example(untrained_model, tokenizer) -> None:
    nll = answer_nll(untrained_model, tokenizer, QUESTIONS, ANSWERS, batch_size=3)
    expected = torch.tensor(
        [
            _manual_nll(untrained_model, tokenizer, q, a)
            for q, a in zip(QUESTIONS, ANSWERS, strict=True)
        ]
    )
    assert nll.shape == (len(QUESTIONS),)
    assert nll.dtype == torch.float32
    torch.testing.assert_close(nll, expected, atol=1e-5, rtol=0)


def test_answer_nll_matches_manual_on_trained_model(trained_model, tokenizer) -> None:
    nll = answer_nll(trained_model, tokenizer, QUESTIONS, ANSWERS, batch_size=5)
    expected = torch.tensor(
        [
            _manual_nll(trained_model, tokenizer, q, a)
            for q, a in zip(QUESTIONS, ANSWERS, strict=True)
        ]
    )
    torch.testing.assert_close(nll, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("batch_size", [1, 2, 4, 32])
def test_answer_nll_invariant_to_batch_size(untrained_model, tokenizer, batch_size: int) -> None:
    reference = answer_nll(untrained_model, tokenizer, QUESTIONS, ANSWERS, batch_size=1)
    nll = answer_nll(untrained_model, tokenizer, QUESTIONS, ANSWERS, batch_size=batch_size)
    torch.testing.assert_close(nll, reference, atol=1e-5, rtol=0)


def test_answer_probability_is_exp_of_negative_nll(untrained_model, tokenizer) -> None:
    nll = answer_nll(untrained_model, tokenizer, QUESTIONS, ANSWERS)
    prob = answer_probability(untrained_model, tokenizer, QUESTIONS, ANSWERS)
    torch.testing.assert_close(prob, torch.exp(-nll))
    assert bool(((prob > 0) & (prob <= 1)).all())


def test_answer_nll_edge_cases(untrained_model, tokenizer) -> None:
    assert answer_nll(untrained_model, tokenizer, [], []).shape == (0,)
    with pytest.raises(ValueError, match="answers"):
        answer_nll(untrained_model, tokenizer, ["a", "b"], ["c"])
    with pytest.raises(ValueError, match="no labelled"):
        answer_nll(untrained_model, tokenizer, [QUESTIONS[2]], ["x"], max_length=4)


def test_answer_nll_restores_training_flag(tokenizer, untrained_model) -> None:
    untrained_model.train()
    try:
        answer_nll(untrained_model, tokenizer, QUESTIONS[:2], ANSWERS[:2])
        assert untrained_model.training
    finally:
        untrained_model.eval()


def test_large_logits_are_scored_in_chunks_of_rows_with_the_same_result(
    untrained_model, tokenizer, monkeypatch
) -> None:
    from fedunlearn.evaluation import likelihood

    questions = [f"Question number {i} about the author?" for i in range(6)]
    answers = [f"Answer {i} is a fairly long sentence of words." for i in range(6)]
    whole = answer_nll(untrained_model, tokenizer, questions, answers, batch_size=6)
    passes: list[int] = []
    hook = untrained_model.register_forward_hook(
        lambda m, a, k, out: passes.append(1), with_kwargs=True
    )
    # a budget of two rows' logits: the batch of six runs as three forward passes
    width = max(len(encode_qa(tokenizer, q, a)[0]) for q, a in zip(questions, answers, strict=True))
    monkeypatch.setattr(
        likelihood, "LOGITS_BUDGET_BYTES", 2 * width * untrained_model.config.vocab_size * 4
    )
    chunked = answer_nll(untrained_model, tokenizer, questions, answers, batch_size=6)
    hook.remove()
    assert len(passes) == 3
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)
