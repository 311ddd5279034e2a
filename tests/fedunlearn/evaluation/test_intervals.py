"""Percentile-bootstrap intervals of the metrics from their per-question scores."""

import numpy as np
import pytest

from fedunlearn.evaluation.intervals import metric_intervals
from fedunlearn.evaluation.tofu_metrics import forget_quality, model_utility


def _stage(scores: dict[str, list[float]], sets: dict[str, str], **metrics) -> dict:
    means = {k: float(np.mean(v)) for k, v in scores.items()}
    return {**means, **metrics, "scores": scores, "score_sets": sets}


def test_a_mean_metrics_interval_covers_the_true_mean_about_95_percent_of_the_time():
    """Coverage on constructed scores of a known mean: 300 samples of 80 Bernoulli(0.6)
    questions; the 95 % interval holds 0.6 in 90-99 % of them."""
    rng = np.random.default_rng(0)
    covered = 0
    for trial in range(300):
        hits = (rng.random(80) < 0.6).astype(float).tolist()
        low, high = metric_intervals(_stage({"acc": hits}, {"acc": "q"}), seed=trial)["acc"]
        covered += low <= 0.6 <= high
    assert 0.90 <= covered / 300 <= 0.99


def test_an_interval_recomputed_independently_agrees():
    """numpy's own resampling (another generator, 20 000 resamples) gives the same bounds
    within the Monte Carlo error of 1000 resamples."""
    values = np.random.default_rng(1).beta(2, 5, size=60)
    low, high = metric_intervals(_stage({"rouge": values.tolist()}, {"rouge": "q"}))["rouge"]
    rng = np.random.default_rng(12345)
    means = values[rng.integers(0, values.size, size=(20000, values.size))].mean(axis=1)
    assert low == pytest.approx(np.percentile(means, 2.5), abs=0.006)
    assert high == pytest.approx(np.percentile(means, 97.5), abs=0.006)
    assert low < values.mean() < high


def test_lists_of_one_question_set_are_resampled_together_and_seeds_repeat():
    values = np.random.default_rng(2).random(40).tolist()
    stage = _stage({"a": values, "b": values, "c": values}, {"a": "q", "b": "q", "c": "other"})
    first = metric_intervals(stage, seed=3)
    assert first["a"] == first["b"] != first["c"]  # one set: the same resamples
    assert metric_intervals(stage, seed=3) == first
    assert metric_intervals(stage, seed=4)["a"] != first["a"]
    with pytest.raises(ValueError, match="question set 'q' has lists of 40 and 3"):
        metric_intervals(_stage({"a": values, "b": values[:3]}, {"a": "q", "b": "q"}))


def test_tofu_utility_and_forget_quality_are_recomputed_per_resample():
    rng = np.random.default_rng(4)
    scores, sets = {}, {}
    for split in ("forget", "retain", "real_authors", "world_facts"):
        for metric in ("prob", "rouge_l", "truth_ratio"):
            scores[f"{split}_{metric}"] = rng.uniform(0.2, 0.9, 30).tolist()
            sets[f"{split}_{metric}"] = split
    ratios = rng.lognormal(0, 0.5, 30).tolist()
    reference = rng.lognormal(0.3, 0.5, 30).tolist()
    utility = model_utility([np.mean(v) for k, v in scores.items() if not k.startswith("forget")])
    stage = _stage(
        scores,
        sets,
        model_utility=utility,
        forget_truth_ratios=ratios,
        forget_quality=forget_quality(ratios, reference),
    )
    ci = metric_intervals(stage, {"forget_truth_ratios": reference})
    low, high = ci["model_utility"]
    assert low < utility < high and high - low < 0.2
    low, high = ci["forget_quality"]
    assert 0.0 <= low <= stage["forget_quality"] <= high <= 1.0
    # without the reference's truth ratios there is nothing to test against
    assert "forget_quality" not in metric_intervals(stage)


def test_wmdp_forget_accuracy_is_the_mean_of_its_domains_resampled():
    rng = np.random.default_rng(5)
    bio = (rng.random(50) < 0.7).astype(float).tolist()
    cyber = (rng.random(40) < 0.4).astype(float).tolist()
    stage = _stage(
        {"accuracy_bio": bio, "accuracy_cyber": cyber},
        {"accuracy_bio": "bio", "accuracy_cyber": "cyber"},
        forget_accuracy=(np.mean(bio) + np.mean(cyber)) / 2,
        forget_domains=["bio", "cyber"],
    )
    ci = metric_intervals(stage)
    assert ci["forget_accuracy"][0] < stage["forget_accuracy"] < ci["forget_accuracy"][1]
    # narrower than either domain's: it averages two independent samples
    width = ci["forget_accuracy"][1] - ci["forget_accuracy"][0]
    assert width < min(ci["accuracy_bio"][1] - ci["accuracy_bio"][0], 0.4)


def test_metrics_without_scores_get_no_interval_and_bad_arguments_are_refused():
    stage = _stage({"acc": [1.0, 0.0, 1.0]}, {"acc": "q"}, privleak=3.5)
    assert set(metric_intervals(stage)) == {"acc"}
    assert metric_intervals({"privleak": 3.5}) == {}
    with pytest.raises(ValueError, match="resamples >= 1"):
        metric_intervals(stage, resamples=0)
