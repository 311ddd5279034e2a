"""Deletion requests over time: the schedule, each round's roles, each request's metrics."""

import json

import numpy as np
import pytest
from scipy import stats

from fedunlearn.dp2u import DataShard, ForgetRequest
from fedunlearn.requests import (
    ScheduledRequest,
    read_schedule,
    request_metrics,
    round_assignments,
)


def test_schedule_rounds_are_checked_and_read_in_order(tmp_path):
    text = json.dumps({"2": {"1": {"authors": ["B"]}}, "1": {"0": {"records": [3, 4]}}})
    assert read_schedule(text, 2) == {
        1: [ForgetRequest(0, (), (3, 4))],
        2: [ForgetRequest(1, ("B",), ())],
    }
    (tmp_path / "schedule.json").write_text(text)
    assert read_schedule(str(tmp_path / "schedule.json")) == read_schedule(text)
    assert read_schedule("  ") == {}
    with pytest.raises(ValueError, match=r"names rounds \[1, 2\]: each round 1..3"):
        read_schedule(text, 3)
    with pytest.raises(ValueError, match="round '0' is not a round >= 1"):
        read_schedule('{"0": {"0": {"records": [1]}}}')
    with pytest.raises(ValueError, match="round 1: forget request for client 0: names nothing"):
        read_schedule('{"1": {"0": {}}}')
    with pytest.raises(ValueError, match="neither JSON nor a file"):
        read_schedule("missing.json")


SHARDS = [
    DataShard(indices=(0, 1, 10, 11, 12), forget=(0, 1)),
    DataShard(indices=(2, 3, 13, 14), forget=(2, 3)),
    DataShard(indices=(15, 16, 17), forget=()),
]


def test_a_round_unlearns_what_was_asked_and_nobody_retains_what_is_forgotten():
    serving = [ScheduledRequest(2, 1, ("B",), (2, 3))]
    forgotten = {0, 1, 2, 3}  # round 1 forgot client 0's records, round 2 client 1's
    roles = round_assignments(
        SHARDS, serving, forgotten, retain_samples=10, local_retain_samples=1, seed=0
    )
    assert [a.role for a in roles] == ["retain", "forget", "retain"]
    assert roles[1].indices == (2, 3) and set(roles[1].retain_indices) <= {13, 14}
    assert len(roles[1].retain_indices) == 1
    assert roles[0].indices == (10, 11, 12)  # its forgotten records are not retained
    assert roles[2].indices == (15, 16, 17)
    again = round_assignments(
        SHARDS, serving, forgotten, retain_samples=2, local_retain_samples=1, seed=0
    )
    assert again == round_assignments(
        SHARDS, serving, forgotten, retain_samples=2, local_retain_samples=1, seed=0
    )
    assert [len(a.indices) for a in again] == [2, 2, 2]


def test_request_metrics_are_the_means_and_ks_test_of_its_questions():
    rng = np.random.default_rng(0)
    rouge = rng.uniform(size=12).tolist()
    ratios = rng.uniform(0.2, 1.0, size=12).tolist()
    reference_ratios = rng.uniform(0.2, 1.0, size=12).tolist()
    metrics = {
        "scores": {"forget_rouge_l": rouge, "forget_truth_ratio": ratios},
        "score_sets": {"forget_rouge_l": "forget", "forget_truth_ratio": "forget"},
        "forget_truth_ratios": ratios,
    }
    positions = [1, 4, 5, 9, 11]
    values, intervals = request_metrics(
        metrics, positions, {"forget_truth_ratios": reference_ratios}, seed=0
    )
    assert values["forget_rouge_l"] == pytest.approx(np.mean([rouge[p] for p in positions]))
    expected_ks = stats.ks_2samp(
        [ratios[p] for p in positions], [reference_ratios[p] for p in positions]
    ).pvalue
    assert values["forget_quality"] == pytest.approx(expected_ks)
    low, high = intervals["forget_rouge_l"]
    assert min(rouge[p] for p in positions) <= low < values["forget_rouge_l"] < high
    assert high <= max(rouge[p] for p in positions)
    assert set(intervals) == {"forget_rouge_l", "forget_truth_ratio", "forget_quality"}
    assert request_metrics(metrics, positions, None, seed=0)[0]["forget_quality"] is None


def test_a_mixed_role_client_asked_to_forget_also_retains_what_it_keeps():
    serving = [ScheduledRequest(1, 0, ("A",), (0, 1)), ScheduledRequest(1, 1, ("B",), (2, 3))]
    forgotten = {0, 1, 2, 3}
    plain = round_assignments(
        SHARDS, serving, forgotten, retain_samples=2, local_retain_samples=1, seed=0
    )
    mixed = round_assignments(
        SHARDS,
        serving,
        forgotten,
        retain_samples=2,
        local_retain_samples=1,
        seed=0,
        mixed_clients=1,
    )
    assert [a.mixed for a in plain] == [False] * 3
    assert [a.mixed for a in mixed] == [True, False, False]  # client 1 is not among the first
    assert mixed[0].indices == (0, 1) and mixed[0].kept_domain == "retain"
    assert len(mixed[0].kept_indices) == 2 and set(mixed[0].kept_indices) <= {10, 11, 12}
    assert mixed[0].retain_indices == plain[0].retain_indices  # its local sample as before
