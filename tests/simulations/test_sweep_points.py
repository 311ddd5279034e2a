"""Whole Flower runs join a sweep as points only when they ran the sweep's config."""

import json

import pytest

from simulations.frontier import summary_markdown
from simulations.sweep import flower_run_point

CONFIG = {"merge": "firm", "gamma": 8.0, "num-rounds": 1, "seed": 0, "output-dir": "/a"}


def _results(tmp_path, name, **changes):
    config = {**CONFIG, **changes}
    after = {"forget_rouge_l": 0.5, "model_utility": 0.4, "extra": 1.0}
    path = tmp_path / f"{name}.json"
    merge = {"norm_final": 2.5}
    path.write_text(json.dumps({"config": config, "metrics": {"after": after}, "merge": merge}))
    return path


def test_a_run_of_another_merge_is_a_point(tmp_path):
    path = _results(tmp_path, "ties", merge="ties", gamma=4.0, **{"output-dir": "/b"})
    point = flower_run_point(path, CONFIG, ("forget_rouge_l", "model_utility"))
    assert point["strategy"] == "ties" and point["gamma"] == 4.0
    assert point["metrics"] == {"forget_rouge_l": 0.5, "model_utility": 0.4}
    assert str(path) in point["how"] and point["norm_final"] == 2.5


def test_a_run_point_goes_into_the_summary_table(tmp_path):
    path = _results(tmp_path, "sum", merge="sum")
    point = flower_run_point(path, CONFIG, ("forget_rouge_l", "model_utility"))
    summary = {
        "points": [point],
        "before": {},
        "reference": None,
        "metric_names": ["forget_rouge_l"],
    }
    assert "| sum | 8 |" in summary_markdown(summary)


@pytest.mark.parametrize(
    "changes",
    [{"seed": 1}, {"num-rounds": 2}, {"seed": 0, "lora.rank": 8}, {"wrapper": "mpu"}],
)
def test_a_run_of_another_config_is_refused(tmp_path, changes):
    path = _results(tmp_path, "other", **changes)
    with pytest.raises(ValueError, match="not a single-round run of the sweep's config"):
        flower_run_point(path, CONFIG, ("forget_rouge_l",))
