"""Evaluation: answer likelihoods, greedy generation and TOFU-style metrics (docs/algorithms.md,
"Evaluation metrics")."""

from fedunlearn.evaluation.generation import greedy_generate
from fedunlearn.evaluation.harness_mc import harness_accuracy
from fedunlearn.evaluation.likelihood import answer_nll, answer_probability
from fedunlearn.evaluation.tofu_metrics import (
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

__all__ = [
    "answer_nll",
    "answer_probability",
    "evaluate_split",
    "evaluate_tofu",
    "exact_match",
    "forget_quality",
    "greedy_generate",
    "harness_accuracy",
    "log_truth_ratio",
    "model_utility",
    "normalize_answer",
    "normalized_probability",
    "rouge_l_recall",
    "rouge_l_scores",
    "truth_ratio",
    "truth_ratio_from_nll",
    "truth_ratio_score",
]
