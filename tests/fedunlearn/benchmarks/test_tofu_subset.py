"""A CPU-sized subset of the published TOFU files that keeps the official split structure."""

import json

import pytest

from fedunlearn.benchmarks.tofu_files import load_tofu_files
from fedunlearn.scenarios import ScenarioParams, get_scenario
from tests.shared_paths import shared_data


def _questions(name: str) -> list[str]:
    with shared_data("tofu", f"{name}.json").open() as handle:
        return [json.loads(line)["question"] for line in handle]


@pytest.fixture(scope="module")
def published():
    return load_tofu_files(shared_data("tofu"))


def test_subset_keeps_forget01_and_the_first_retain_authors(published):
    subset = published.subset(6, forget_percent=1.0)
    assert subset.author_names == published.author_names[:4] + published.author_names[-2:]
    assert [r["question"] for r in subset.forget_split(1.0)] == _questions("forget01")
    retain = subset.retain_split(1.0)
    assert [r["question"] for r in retain] == _questions("full")[:80]
    # the first 20 authors are TOFU's retain_perturbed: every retain QA can be truth-rated
    assert all(r["perturbed_answer"] and r["paraphrased_answer"] for r in retain)
    assert len(subset.real_authors) == 100 and len(subset.world_facts) == 117


def test_subset_follows_the_forget_percent(published):
    subset = published.subset(14, forget_percent=5.0)
    assert [r["question"] for r in subset.forget_split(5.0)] == _questions("forget05")
    assert subset.author_names[:4] == published.author_names[:4]
    assert published.subset(200, forget_percent=1.0) is published


def test_subset_must_leave_a_retain_author(published):
    with pytest.raises(ValueError, match="2 authors leaves no retain author.*forget-1%"):
        published.subset(2, forget_percent=1.0)


def test_real_tofu_scenario_on_the_subset_fine_tunes_on_authors_only():
    params = ScenarioParams(
        data_path=str(shared_data("tofu")),
        subset_authors=4,
        eval_retain_samples=10,
        num_forget_clients=2,
        retain_samples=40,
    )
    scenario = get_scenario("tofu")(params)
    knowledge = scenario.knowledge_records(include_forget=True)
    reference = scenario.knowledge_records(include_forget=False)
    assert len(knowledge) == 80 and len(reference) == 40
    assert {r["question"] for r in knowledge} - {r["question"] for r in reference} == set(
        _questions("forget01")
    )
    splits = scenario.evaluation_splits()
    assert [len(splits[k]) for k in ("forget", "retain", "real_authors", "world_facts")] == [
        40,
        10,
        10,
        10,
    ]
    clients = scenario.assignments()
    assert [c.role for c in clients] == ["forget", "forget", "retain"]
    records = scenario.records()
    shards = [[records[i]["question"] for i in c.indices] for c in clients]
    assert shards[0] + shards[1] == _questions("forget01")  # contiguous author shards
    assert sorted(shards[2]) == sorted(_questions("full")[:40])
