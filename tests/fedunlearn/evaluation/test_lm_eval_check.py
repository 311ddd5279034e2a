"""harness_mc's MMLU scores against lm-evaluation-harness itself (the lm-eval package)."""

from fedunlearn.benchmarks.mmlu_files import load_mmlu_csv, mmlu_subset
from fedunlearn.evaluation.lm_eval_check import compare_with_lm_eval
from tests.shared_paths import shared_data


def test_every_choice_scores_as_lm_eval_scores_it(tiny_model, tiny_tokenizer):
    """Real MMLU questions (some longer than the tiny model's 256 positions, so truncated from
    the left) on a real model: every one of the 4 × 12 log-likelihoods equals lm-eval's
    ``loglikelihood`` of the same request to float rounding, and so does every prediction."""
    records = mmlu_subset(load_mmlu_csv(shared_data("mmlu")), subjects=4, per_subject=3, seed=1)
    tiny_model.eval()
    result = compare_with_lm_eval(tiny_model, tiny_tokenizer, records)
    assert result["questions"] == 12
    assert result["max_abs_difference"] < 1e-4
    assert result["predictions_differ"] == []
    # the scores are no constant: equal tables say something (48 distinct values)
    assert len({round(x, 5) for row in result["lm_eval"] for x in row}) > 40
