"""Client layouts and substrate recipes of the wmdp and muse scenarios, and the registry."""

import pytest

from fedunlearn.scenarios import SCENARIOS, ScenarioParams, get_scenario


def test_registry_lists_the_three_scenarios():
    assert {"tofu", "wmdp", "muse"} <= set(SCENARIOS)
    with pytest.raises(KeyError, match="unknown scenario 'nope'.*muse"):
        get_scenario("nope")


def test_wmdp_three_disjoint_forget_shards_per_domain_and_a_general_retain_client():
    scenario = get_scenario("wmdp")(
        ScenarioParams(num_forget_clients=6, local_retain_samples=16, retain_samples=100)
    )
    records = scenario.records()
    clients = scenario.assignments()
    forget = [c for c in clients if c.role == "forget"]
    assert [c.domain for c in forget] == ["bio"] * 3 + ["cyber"] * 3
    for domain in ("bio", "cyber"):
        shards = [set(c.indices) for c in forget if c.domain == domain]
        assert all(a.isdisjoint(b) for i, a in enumerate(shards) for b in shards[i + 1 :])
        held = set().union(*shards)
        assert held == set(scenario.data.text_indices(domain))
        assert {records[i]["domain"] for i in held} == {domain}
        # entity-aligned shards: no entity's documents are split over two clients
        owners = {}
        for c, shard in enumerate(shards):
            for i in shard:
                owners.setdefault(records[i]["entity"], set()).add(c)
        assert all(len(o) == 1 for o in owners.values())
    (retain,) = [c for c in clients if c.role == "retain"]
    assert len(retain.indices) == 100 and {records[i]["domain"] for i in retain.indices} == {
        "general"
    }
    assert all(len(c.retain_indices) == 16 for c in forget) and retain.retain_indices == ()
    assert all(records[i]["domain"] == "general" for c in forget for i in c.retain_indices)


def test_wmdp_reference_leaves_out_exactly_the_forget_domains():
    scenario = get_scenario("wmdp")(ScenarioParams(forget_domains="bio"))
    full = scenario.knowledge_records(include_forget=True)
    reference = scenario.knowledge_records(include_forget=False)
    bio_docs = {r["text"] for r in scenario.data.corpora["bio"]}
    chem_docs = {r["text"] for r in scenario.data.corpora["chem"]}
    texts = {r["text"] for r in reference}
    assert bio_docs <= {r["text"] for r in full} and not bio_docs & texts
    assert chem_docs <= texts
    assert scenario.reference_name() == "reference-without-bio"
    with pytest.raises(ValueError, match="forget-domains"):
        get_scenario("wmdp")(ScenarioParams(forget_domains="bio,physics"))


def test_muse_forget_clients_split_the_forget_books():
    scenario = get_scenario("muse")(ScenarioParams(num_forget_clients=3, retain_samples=50))
    records = scenario.records()
    clients = scenario.assignments()
    forget = [c for c in clients if c.role == "forget"]
    assert len(forget) == 3
    held = [i for c in forget for i in c.indices]
    assert len(held) == len(set(held))  # disjoint
    data = scenario.data
    forget_texts = {r["text"] for r in data.forget_passages}
    forget_questions = {r["question"] for r in data.forget_qa}
    assert {records[i].get("text") for i in held} - {None} == forget_texts
    assert {records[i].get("question") for i in held} - {None} == forget_questions
    (retain,) = [c for c in clients if c.role == "retain"]
    assert len(retain.indices) == 50
    retain_books = {r["book"] for r in data.retain_passages}
    assert {records[i]["book"] for i in retain.indices} <= retain_books
    holdout = {r["text"] for r in data.holdout_passages}
    assert not holdout & {r.get("text") for r in records}  # holdout is never trainable
    reference = {r["text"] for r in scenario.knowledge_records(include_forget=False)}
    assert not forget_texts & reference
