"""Tests for TOFU metric math and the split / full evaluation on tiny real models."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from fedunlearn.evaluation import (
    answer_nll,
    evaluate_split,
    evaluate_tofu,
    exact_match,
    forget_quality,
    log_truth_ratio,
    model_utility,
    normalize_answer,
    normalized_probability,
    rouge_l_recall,
    rouge_l_scores,
    truth_ratio,
    truth_ratio_from_nll,
    truth_ratio_score,
)

# ------------------------------------------------------------------------------ text metrics


def test_rouge_l_recall_hand_values() -> None:
    scores = rouge_l_recall(
        ["the cat", "cats running", "", "Oslo is where Ava Lind was born"],
        ["the cat sat", "cat run", "anything", "Ava Lind was born in Oslo"],
    )
    assert scores[0] == pytest.approx(2 / 3)
    assert scores[1] == pytest.approx(1.0)  # stemming
    assert scores[2] == 0.0
    assert scores[3] == pytest.approx(4 / 6)  # LCS "ava lind was born"
    f1 = rouge_l_scores(["the cat"], ["the cat sat"], measure="fmeasure")[0]
    assert f1 == pytest.approx(2 * (1.0 * 2 / 3) / (1.0 + 2 / 3))
    with pytest.raises(ValueError):
        rouge_l_recall(["a"], ["a", "b"])


def test_exact_match_normalisation() -> None:
    assert normalize_answer("  Ava   LIND was born\nin Oslo.!  ") == "ava lind was born in oslo"
    preds = ["Ava Lind was born in Oslo", "ava  lind was born in oslo!", "Oslo", "Born, in Oslo"]
    refs = ["Ava Lind was born in Oslo."] * 3 + ["Born in Oslo"]
    assert exact_match(preds, refs) == [1.0, 1.0, 0.0, 0.0]


# ----------------------------------------------------------------------- probability metrics


def test_truth_ratio_hand_values() -> None:
    p_wrong = torch.tensor([[0.1, 0.4], [0.2, 0.2], [0.05, math.nan]], dtype=torch.float64)
    p_correct = torch.tensor([0.4, 0.1, 0.5], dtype=torch.float64)
    tr = truth_ratio(p_wrong, p_correct)
    torch.testing.assert_close(tr, torch.tensor([0.5, 2.0, 0.1], dtype=torch.float64))
    nll_wrong, nll_correct = -torch.log(p_wrong), -torch.log(p_correct)
    torch.testing.assert_close(truth_ratio_from_nll(nll_wrong, nll_correct), tr)
    torch.testing.assert_close(log_truth_ratio(nll_wrong, nll_correct), torch.log(tr))
    with pytest.raises(ValueError):
        truth_ratio(p_wrong[:2], p_correct)


def test_truth_ratio_log_space_is_stable() -> None:
    nll_wrong = torch.tensor([[900.0, 1100.0]], dtype=torch.float64)
    nll_correct = torch.tensor([1000.0], dtype=torch.float64)
    assert float(truth_ratio_from_nll(nll_wrong, nll_correct)[0]) == pytest.approx(1.0)


def test_truth_ratio_scores() -> None:
    tr = [0.5, 2.0, 1.0]
    assert truth_ratio_score(tr, forget=True) == pytest.approx((0.5 + 0.5 + 1.0) / 3)
    assert truth_ratio_score(tr, forget=False) == pytest.approx((0.5 + 0.0 + 0.0) / 3)
    assert truth_ratio_score(torch.tensor([0.0, math.inf]), forget=True) == 0.0
    with pytest.raises(ValueError):
        truth_ratio_score([], forget=True)


def test_normalized_probability_hand_values() -> None:
    p_correct = torch.tensor([0.5, 0.2, 0.3], dtype=torch.float64)
    p_wrong = torch.tensor([[0.25, 0.25], [0.2, 0.6], [0.3, math.nan]], dtype=torch.float64)
    norm = normalized_probability(-torch.log(p_correct), -torch.log(p_wrong))
    torch.testing.assert_close(norm, torch.tensor([0.5, 0.2, 0.5], dtype=torch.float64))


def test_forget_quality() -> None:
    rng = np.random.default_rng(0)
    sample = rng.lognormal(size=40)
    assert forget_quality(sample, sample) == pytest.approx(1.0)
    assert forget_quality(sample, rng.lognormal(mean=3.0, size=40)) < 0.05
    assert isinstance(forget_quality(torch.tensor(sample), list(sample)), float)
    with pytest.raises(ValueError):
        forget_quality([], sample)


def test_model_utility() -> None:
    assert model_utility([1.0, 0.5]) == pytest.approx(2 / (1 / 1.0 + 1 / 0.5))
    assert model_utility([0.2, 0.4, 0.8]) == pytest.approx(3 / (5 + 2.5 + 1.25))
    assert model_utility([0.3, 0.0, 0.9]) == 0.0
    for bad in ([], [0.5, -0.1], [math.nan, 0.5]):
        with pytest.raises(ValueError):
            model_utility(bad)


# ------------------------------------------------------------------------- model evaluation


def test_memorised_model_scores(trained_model, untrained_model, tokenizer, memorised_records):
    trained = evaluate_split(trained_model, tokenizer, memorised_records, kind="extra")
    untrained = evaluate_split(untrained_model, tokenizer, memorised_records, kind="extra")
    assert trained["exact_match"] == 1.0
    assert trained["rouge_l"] == 1.0
    assert untrained["exact_match"] == 0.0
    assert untrained["rouge_l"] < 0.5
    assert np.mean(trained["truth_ratios"]) < np.mean(untrained["truth_ratios"])
    assert trained["truth_ratio"] > untrained["truth_ratio"]
    assert trained["prob"] > untrained["prob"]
    assert [s["generation"] for s in trained["samples"]] == [
        r["answer"] for r in memorised_records[:3]
    ]
    forget = evaluate_split(trained_model, tokenizer, memorised_records, kind="forget")
    assert forget["exact_match"] == 1.0 and forget["rouge_l"] == 1.0
    assert forget["prob"] > 0.5


@pytest.mark.parametrize("kind", ["forget", "retain", "extra"])
def test_evaluate_split_matches_direct_computation(
    untrained_model, tokenizer, memorised_records, kind: str
) -> None:
    result = evaluate_split(untrained_model, tokenizer, memorised_records, kind=kind, batch_size=5)
    questions = [r["question"] for r in memorised_records]

    def nll(answers: list[str]) -> torch.Tensor:
        return answer_nll(untrained_model, tokenizer, questions, answers, batch_size=1).double()

    nll_answer = nll([r["answer"] for r in memorised_records])
    correct_key = "answer" if kind == "extra" else "paraphrased_answer"
    nll_correct = nll([r[correct_key] for r in memorised_records])
    trs, norm = [], []
    for i, r in enumerate(memorised_records):  # ragged: the last record has 2 perturbed answers
        w = answer_nll(
            untrained_model,
            tokenizer,
            [r["question"]] * len(r["perturbed_answer"]),
            r["perturbed_answer"],
            batch_size=1,
        ).double()
        trs.append(math.exp(-float(w.mean())) / math.exp(-float(nll_correct[i])))
        p_c = math.exp(-float(nll_answer[i]))
        norm.append(p_c / (p_c + float(torch.exp(-w).sum())))
    np.testing.assert_allclose(result["truth_ratios"], trs, rtol=1e-4)
    if kind == "extra":
        assert result["prob"] == pytest.approx(np.mean(norm), rel=1e-4)
    else:
        assert result["prob"] == pytest.approx(float(torch.exp(-nll_answer).mean()), rel=1e-4)
    expected_tr = truth_ratio_score(trs, forget=kind == "forget")
    assert result["truth_ratio"] == pytest.approx(expected_tr, rel=1e-4)


def test_evaluate_split_rejects_bad_input(untrained_model, tokenizer, memorised_records) -> None:
    with pytest.raises(ValueError):
        evaluate_split(untrained_model, tokenizer, memorised_records, kind="holdout")
    with pytest.raises(ValueError):
        evaluate_split(untrained_model, tokenizer, [], kind="forget")
    bad = [dict(memorised_records[0], perturbed_answer=[])]
    with pytest.raises(ValueError):
        evaluate_split(untrained_model, tokenizer, bad, kind="retain")


METRIC_KEYS = [
    f"{split}_{metric}"
    for split in ("forget", "retain")
    for metric in ("rouge_l", "exact_match", "prob", "truth_ratio")
] + [
    f"{split}_{metric}"
    for split in ("real_authors", "world_facts")
    for metric in ("rouge_l", "prob", "truth_ratio")
]


def test_evaluate_tofu_keys_ranges_and_json(trained_model, tokenizer, memorised_records) -> None:
    splits = {
        "forget": memorised_records[:2],
        "retain": memorised_records[2:],
        "real_authors": memorised_records[1:3],
        "world_facts": memorised_records[::2],
    }
    reference = [0.5, 1.0, 2.0]
    result = evaluate_tofu(
        trained_model, tokenizer, splits, reference_truth_ratios=reference, max_new_tokens=16
    )
    json.dumps(result)
    for key in [*METRIC_KEYS, "forget_quality", "model_utility"]:
        assert isinstance(result[key], float), key
        assert 0.0 <= result[key] <= 1.0, key
    assert len(result["forget_truth_ratios"]) == 2
    assert all(isinstance(x, float) for x in result["forget_truth_ratios"])
    assert result["forget_quality"] == pytest.approx(
        forget_quality(result["forget_truth_ratios"], reference)
    )
    utility_inputs = [
        result[f"{s}_{m}"]
        for s in ("retain", "real_authors", "world_facts")
        for m in ("prob", "rouge_l", "truth_ratio")
    ]
    assert result["model_utility"] == pytest.approx(model_utility(utility_inputs))
    assert "samples" not in result


def test_evaluate_tofu_without_extras(untrained_model, tokenizer, memorised_records) -> None:
    result = evaluate_tofu(
        untrained_model,
        tokenizer,
        {"forget": memorised_records[:2], "retain": memorised_records[2:]},
        max_new_tokens=4,
        show_progress=True,
        n_samples=1,
    )
    json.dumps(result)
    assert result["forget_quality"] is None
    assert not any(key.startswith(("real_authors", "world_facts")) for key in result)
    expected = model_utility(
        [result["retain_prob"], result["retain_rouge_l"], result["retain_truth_ratio"]]
    )
    assert result["model_utility"] == pytest.approx(expected)
    assert set(result["samples"]) == {"forget", "retain"}
    assert len(result["samples"]["forget"]) == 1
    with pytest.raises(ValueError, match="unknown"):
        evaluate_tofu(untrained_model, tokenizer, {"forget": memorised_records, "holdout": []})
    with pytest.raises(ValueError, match="forget"):
        evaluate_tofu(untrained_model, tokenizer, {"retain": memorised_records})
