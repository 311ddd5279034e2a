"""Client assignments of the TOFU scenario."""

import pytest

from fedunlearn.benchmarks.tofu import generate_tofu
from fedunlearn.scenarios import all_records, tofu_assignments


@pytest.fixture(scope="module")
def data():
    return generate_tofu(seed=0, num_authors=200, qa_per_author=10)


def test_default_is_the_firm_paper_setup(data):
    clients = tofu_assignments(
        data,
        forget_percent=1.0,
        num_forget_clients=5,
        num_retain_clients=1,
        retain_samples=200,
        seed=0,
    )
    forget = [c for c in clients if c.role == "forget"]
    retain = [c for c in clients if c.role == "retain"]
    assert len(forget) == 5 and len(retain) == 1
    shards = [set(c.indices) for c in forget]
    assert all(len(s) == 4 for s in shards)  # forget-1 % of 200 authors × 10 QA = 20 QA
    assert set().union(*shards) == {
        i for i, r in enumerate(data.author_qa) if r["author"] in data.forget_authors(1.0)
    }
    assert sum(len(s) for s in shards) == len(set().union(*shards))  # disjoint
    assert len(retain[0].indices) == 200
    retain_authors = {data.author_qa[i]["author"] for i in retain[0].indices}
    assert not retain_authors & set(data.forget_authors(1.0))


def test_retain_clients_are_disjoint_and_seeded(data):
    a = tofu_assignments(data, num_retain_clients=3, retain_samples=50, seed=1)
    b = tofu_assignments(data, num_retain_clients=3, retain_samples=50, seed=1)
    c = tofu_assignments(data, num_retain_clients=3, retain_samples=50, seed=2)
    assert a == b and a != c
    retain = [set(x.indices) for x in a if x.role == "retain"]
    assert len(retain) == 3 and not (retain[0] & retain[1] or retain[1] & retain[2])


def test_bad_sizes_are_clear_errors(data):
    with pytest.raises(ValueError, match="fewer than num_forget_clients=30"):
        tofu_assignments(data, num_forget_clients=30)
    with pytest.raises(ValueError, match="exceed"):
        tofu_assignments(data, num_retain_clients=2, retain_samples=1000)


def test_forget_domains_split_authors(data):
    clients = tofu_assignments(
        data, forget_percent=5.0, num_forget_clients=4, num_forget_domains=4, num_retain_clients=1
    )
    forget = [c for c in clients if c.role == "forget"]
    assert [c.domain for c in forget] == [f"tofu-forget-{d}" for d in range(4)]
    authors = [{data.author_qa[i]["author"] for i in c.indices} for c in forget]
    assert all(a and not (a & b) for a in authors for b in authors if a is not b)
    assert set().union(*authors) == set(data.forget_authors(5.0))  # 10 authors over 4 domains
    with pytest.raises(ValueError, match="num_forget_domains=3 must be between 1 and the 2"):
        tofu_assignments(data, forget_percent=1.0, num_forget_domains=3)


def test_heterogeneous_retain_layout(data):
    clients = tofu_assignments(
        data, num_retain_clients=3, retain_samples=100, retain_layout="heterogeneous"
    )
    retain = [c for c in clients if c.role == "retain"]
    assert [c.domain for c in retain] == ["retain-authors-a", "retain-world", "retain-authors-b"]
    records = all_records(data)
    world = [records[i] for i in retain[1].indices]
    assert len(world) == 100 and all(r in data.real_authors + data.world_facts for r in world)
    first = {records[i]["author"] for i in retain[0].indices}
    last = {records[i]["author"] for i in retain[2].indices}
    assert first and last and not first & last
    assert not (first | last) & set(data.forget_authors(1.0))


def test_tofu_holdout_is_never_trained_and_privleak_is_relative(tiny_model, tiny_tokenizer):
    from fedunlearn.scenarios import ScenarioParams, get_scenario

    scenario = get_scenario("tofu")(ScenarioParams(num_authors=20, forget_percent=10.0))
    holdout = scenario.holdout_records()
    names = {r["author"] for r in holdout}
    assert len(names) == len(scenario.data.forget_authors(10.0)) == 2
    assert not names & set(scenario.data.author_names)
    assert len(holdout) == 2 * scenario.params.qa_per_author
    assert holdout == scenario.holdout_records()  # seeded
    alone = scenario.privleak_metrics(tiny_model, tiny_tokenizer, None)
    assert 0.0 <= alone["privleak_auc"] <= 1.0 and alone["privleak"] is None
    relative = scenario.privleak_metrics(tiny_model, tiny_tokenizer, {"privleak_auc": 0.5})
    assert relative["privleak"] == pytest.approx((alone["privleak_auc"] - 0.5) / 0.5 * 100)


def test_tofu_evaluation_splits_of_named_records():
    from fedunlearn.scenarios import ScenarioParams, get_scenario

    scenario = get_scenario("tofu")(
        ScenarioParams(num_authors=20, forget_percent=10.0, eval_retain_samples=30)
    )
    qa = scenario.data.author_qa
    forget_authors = set(scenario.data.forget_authors(10.0))
    percent = [i for i, r in enumerate(qa) if r["author"] in forget_authors]
    # the percent split named record by record gives the same splits, sample included
    assert scenario.evaluation_splits(percent) == scenario.evaluation_splits()
    named = scenario.evaluation_splits([17, 3])
    assert named["forget"] == [qa[3], qa[17]]  # dataset order
    assert len(named["retain"]) == 30 and qa[3] not in named["retain"]
    assert named["real_authors"] == scenario.data.real_authors
