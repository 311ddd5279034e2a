"""Tests for multiple-choice accuracy by length-normalised answer likelihood (docs/algorithms.md,
"Evaluation metrics")."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from fedunlearn.benchmarks.wmdp import generate_wmdp
from fedunlearn.evaluation.likelihood import answer_nll
from fedunlearn.evaluation.multiple_choice import (
    choice_nll,
    evaluate_wmdp,
    multiple_choice_accuracy,
    multiple_choice_correct,
    predicted_choices,
)
from fedunlearn.qa_format import encode_qa, format_answer

QUESTIONS = [
    {
        "question": "Where was Ava Lind born?",
        "choices": ["Ava Lind was born in Lima.", "Ava Lind was born in Oslo.", "Perth.", "Bern"],
        "answer": 1,
    },
    {
        "question": "What does Bram Osei write?",
        "choices": ["poetry", "memoirs", "plays", "Bram Osei writes crime novels."],
        "answer": 3,
    },
    {
        "question": "What did Dario Venn love?",
        "choices": ["Dario Venn loved the old river house.", "history", "winter", "a river"],
        "answer": 0,
    },
]


def _manual_nll(model, tokenizer, question: str, answer: str) -> float:
    ids, labels = encode_qa(tokenizer, question, answer)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    log_probs = F.log_softmax(logits.float(), dim=-1)
    scored = [-float(log_probs[t - 1, labels[t]]) for t in range(1, len(ids)) if labels[t] != -100]
    return sum(scored) / len(scored)


class UnigramStub(torch.nn.Module):
    """A stub causal LM whose next-token logits ignore the context: ``bias`` at every position.

    Only for the metric tests: it makes the answer likelihoods known in advance.
    """

    def __init__(self, bias: torch.Tensor) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(bias.clone(), requires_grad=False)

    def forward(self, input_ids: torch.Tensor, attention_mask=None) -> SimpleNamespace:
        batch, width = input_ids.shape
        return SimpleNamespace(logits=self.bias.expand(batch, width, -1))


def test_choice_nll_matches_a_manual_computation(untrained_model, tokenizer) -> None:
    nll = choice_nll(untrained_model, tokenizer, QUESTIONS, batch_size=5)
    assert nll.shape == (len(QUESTIONS), 4) and nll.dtype == torch.float32
    expected = torch.tensor(
        [
            [_manual_nll(untrained_model, tokenizer, q["question"], c) for c in q["choices"]]
            for q in QUESTIONS
        ]
    )
    torch.testing.assert_close(nll, expected, atol=1e-5, rtol=0)
    flat = answer_nll(
        untrained_model,
        tokenizer,
        [q["question"] for q in QUESTIONS for _ in range(4)],
        [c for q in QUESTIONS for c in q["choices"]],
    )
    torch.testing.assert_close(nll.flatten(), flat, atol=1e-6, rtol=0)


def test_accuracy_is_the_share_of_argmin_hits(trained_model, untrained_model, tokenizer) -> None:
    for model in (trained_model, untrained_model):
        nll = torch.tensor(
            [
                [_manual_nll(model, tokenizer, q["question"], c) for c in q["choices"]]
                for q in QUESTIONS
            ]
        )
        by_hand = [
            int(torch.argmin(row)) == q["answer"] for row, q in zip(nll, QUESTIONS, strict=True)
        ]
        assert multiple_choice_correct(model, tokenizer, QUESTIONS, batch_size=2) == by_hand
        accuracy = multiple_choice_accuracy(model, tokenizer, QUESTIONS)
        assert accuracy == pytest.approx(sum(by_hand) / len(by_hand))
    # The model that memorised the three correct answers (conftest) gets them all.
    assert multiple_choice_correct(trained_model, tokenizer, QUESTIONS) == [True, True, True]


def test_ties_go_to_the_lower_index(tokenizer) -> None:
    assert predicted_choices(torch.tensor([[1.0, 0.5, 0.5, 2.0], [3.0, 3.0, 3.0, 3.0]])) == [1, 0]
    # Differences below TIE_TOLERANCE are float noise, not a preference.
    assert predicted_choices(torch.tensor([[0.9, 0.5 + 1e-7, 0.5]], dtype=torch.float64)) == [1]
    assert predicted_choices(torch.tensor([[0.9, 0.5 + 1e-3, 0.5]], dtype=torch.float64)) == [2]
    flat = UnigramStub(torch.zeros(len(tokenizer)))  # every choice gets NLL = log(vocab)
    questions = [{**q, "answer": a} for q, a in zip(QUESTIONS, (0, 2, 0), strict=True)]
    nll = choice_nll(flat, tokenizer, questions)
    torch.testing.assert_close(
        nll, torch.full_like(nll, float(torch.log(torch.tensor(len(tokenizer)))))
    )
    assert multiple_choice_correct(flat, tokenizer, questions) == [True, False, True]


def test_a_model_forced_toward_the_correct_choices_scores_one(tokenizer) -> None:
    questions = [
        {"question": "Pick a city.", "choices": ["Oslo", "Lima", "Perth", "Quito"], "answer": 2},
        {
            "question": "Pick a genre.",
            "choices": ["memoirs", "plays", "poetry", "history"],
            "answer": 0,
        },
        {
            "question": "Pick a season.",
            "choices": ["summer", "autumn", "spring", "winter"],
            "answer": 3,
        },
    ]

    def tokens(text: str) -> set[int]:
        return set(tokenizer(format_answer(text), add_special_tokens=False)["input_ids"])

    favoured = {tokenizer.eos_token_id}
    for q in questions:
        favoured |= tokens(q["choices"][q["answer"]])
    for q in questions:  # every distractor needs at least one token the stub does not favour
        for j, choice in enumerate(q["choices"]):
            if j != q["answer"]:
                assert tokens(choice) - favoured, choice
    bias = torch.zeros(len(tokenizer))
    bias[sorted(favoured)] = 10.0
    stub = UnigramStub(bias)
    assert multiple_choice_accuracy(stub, tokenizer, questions) == 1.0
    assert multiple_choice_correct(stub, tokenizer, questions, batch_size=1) == [True] * 3
    wrong = [{**q, "answer": (q["answer"] + 1) % 4} for q in questions]
    assert multiple_choice_accuracy(stub, tokenizer, wrong) == 0.0


def test_errors(untrained_model, tokenizer) -> None:
    with pytest.raises(ValueError, match="no questions"):
        multiple_choice_accuracy(untrained_model, tokenizer, [])
    mixed = [QUESTIONS[0], {**QUESTIONS[1], "choices": ["a", "b", "c"]}]
    with pytest.raises(ValueError, match="different numbers of choices"):
        choice_nll(untrained_model, tokenizer, mixed)


def test_evaluate_wmdp_report(untrained_model, tokenizer) -> None:
    data = generate_wmdp(
        seed=0, domains=("bio", "cyber"), entities_per_domain=2, general_entities=3
    )
    report = evaluate_wmdp(untrained_model, tokenizer, data, general_samples=7, n_samples=2)
    assert report["chance"] == pytest.approx(0.25)
    for domain in ("bio", "cyber"):
        expected = multiple_choice_accuracy(untrained_model, tokenizer, data.questions[domain])
        assert report[f"accuracy_{domain}"] == pytest.approx(expected)
    assert report["hazard_accuracy"] == pytest.approx(
        (report["accuracy_bio"] + report["accuracy_cyber"]) / 2
    )
    assert report["num_questions"] == {"bio": 10, "cyber": 10, "general": 7}
    assert 0.0 <= report["general_accuracy"] <= 1.0
    assert set(report["samples"]) == {"bio", "cyber", "general"}
    first = report["samples"]["bio"][0]
    q = data.questions["bio"][0]
    assert len(report["samples"]["bio"]) == 2
    assert first["question"] == q["question"] and first["correct"] == q["choices"][q["answer"]]
    assert first["chosen"] in q["choices"] and len(first["nll"]) == 4
    # general_samples is a seeded subsample: same seed, same report; None = everything.
    again = evaluate_wmdp(untrained_model, tokenizer, data, general_samples=7, n_samples=2)
    assert again == report
    only_bio = evaluate_wmdp(untrained_model, tokenizer, data, domains=["bio"], n_samples=0)
    assert "accuracy_cyber" not in only_bio and only_bio["num_questions"]["general"] == 15
    assert only_bio["hazard_accuracy"] == report["accuracy_bio"]
    assert only_bio["samples"]["bio"] == []
    with pytest.raises(KeyError, match="unknown domains"):
        evaluate_wmdp(untrained_model, tokenizer, data, domains=["chem"])


def test_evaluate_wmdp_with_empty_sets(untrained_model, tokenizer) -> None:
    data = generate_wmdp(seed=0, domains=("bio",), entities_per_domain=1, general_entities=1)
    data.general_questions = []
    report = evaluate_wmdp(untrained_model, tokenizer, data)
    assert report["general_accuracy"] is None
    assert report["num_questions"]["general"] == 0
    assert report["accuracy_bio"] is not None
