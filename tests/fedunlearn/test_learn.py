"""The federated learning stage's record layout: partitions and shards."""

import random
import sys

import pytest

from fedunlearn.learn import learn_shards, partition
from fedunlearn.scenarios import ScenarioParams, get_scenario

POOL = list(range(100, 160))
GROUPS = [f"author-{(i - 100) // 6}" for i in POOL]  # ten authors of six records


def test_iid_parts_are_equal_disjoint_seeded_and_cover_the_pool():
    parts = partition(POOL, GROUPS, 4, "iid", seed=3)
    assert sorted(i for p in parts for i in p) == POOL
    assert [len(p) for p in parts] == [15, 15, 15, 15]
    assert all(list(p) == sorted(p) for p in parts)  # the pool's order inside a part
    assert partition(POOL, GROUPS, 4, "iid", seed=3) == parts
    assert partition(POOL, GROUPS, 4, "iid", seed=4) != parts


def test_flower_datasets_iid_parts_are_the_round_robin_deal_of_the_seeded_shuffle():
    """IidPartitioner's contiguous parts of the dealt order are the parts earlier runs used."""
    for seed, parts in ((0, 4), (7, 6), (3, 1)):
        order = list(POOL)
        random.Random(seed).shuffle(order)
        dealt = [tuple(sorted(order[k::parts])) for k in range(parts)]
        assert partition(POOL, GROUPS, parts, "iid", seed=seed) == dealt


def _owners(parts) -> dict[str, list[int]]:
    """Each author's records per part."""
    out: dict[str, list[int]] = {}
    for k, part in enumerate(parts):
        for i in part:
            out.setdefault(GROUPS[POOL.index(i)], [0] * len(parts))[k] += 1
    return out


def test_dirichlet_parts_spread_authors_as_their_concentration_says():
    concentrated = partition(POOL, GROUPS, 4, "dirichlet", seed=1, alpha=0.05)
    spread = partition(POOL, GROUPS, 4, "dirichlet", seed=1, alpha=1000.0)
    for parts in (concentrated, spread):
        assert sorted(i for p in parts for i in p) == POOL and all(parts)
        assert all(list(p) == sorted(p) for p in parts)
    mostly_one = [max(c) / sum(c) for c in _owners(concentrated).values()]
    on_parts = [sum(1 for n in c if n) for c in _owners(spread).values()]
    assert sum(mostly_one) / len(mostly_one) > 0.8, mostly_one
    assert min(on_parts) >= 3, on_parts
    assert partition(POOL, GROUPS, 4, "dirichlet", seed=1, alpha=0.05) == concentrated
    assert partition(POOL, GROUPS, 4, "dirichlet", seed=2, alpha=0.05) != concentrated


def test_author_parts_keep_every_author_on_one_client():
    parts = partition(POOL, GROUPS, 3, "authors", seed=0)
    assert sorted(i for p in parts for i in p) == POOL
    owners: dict[str, set[int]] = {}
    for k, part in enumerate(parts):
        for i in part:
            owners.setdefault(GROUPS[POOL.index(i)], set()).add(k)
    assert all(len(v) == 1 for v in owners.values())
    assert sorted(len(p) for p in parts) == [18, 18, 24]  # ten authors dealt to the smallest


def test_bad_partitions_are_refused():
    with pytest.raises(ValueError, match="cannot split the 2 kept records into 3 parts"):
        partition([5, 6], ["a", "b"], 3, "dirichlet", seed=0)
    with pytest.raises(ValueError, match="unknown partitioner 'natural'"):
        partition(POOL, GROUPS, 2, "natural", seed=0)
    with pytest.raises(ValueError, match=">= 1 part"):
        partition(POOL, GROUPS, 0, "iid", seed=0)


def test_shards_put_forget_records_on_their_clients_and_share_the_kept_ones():
    forget = [(0, 1), (2, 3)]
    shards = learn_shards(forget, 3, POOL, GROUPS, partitioner="iid", seed=0)
    assert [s.forget for s in shards] == [(0, 1), (2, 3), ()]
    assert [len(s.indices) for s in shards] == [22, 22, 20]
    assert sorted(i for s in shards for i in s.retained) == POOL  # the reference's records
    with pytest.raises(ValueError, match="both kept and forgotten"):
        learn_shards([(100,)], 2, POOL, GROUPS, partitioner="iid", seed=0)
    with pytest.raises(ValueError, match="client 1 would hold no records"):
        learn_shards([(0,)], 3, [100], ["a"], partitioner="iid", seed=0)


def test_tofu_layout_holds_the_knowledge_of_the_central_fine_tune():
    params = ScenarioParams(
        num_authors=20, qa_per_author=10, forget_percent=10.0, retain_samples=100
    )
    scenario = get_scenario("tofu")(params)
    layout = scenario.learn_layout()
    records = scenario.records()
    forget_records = [records[i] for part in layout.forget for i in part]
    assert forget_records == scenario.data.forget_split(10.0)
    assert len(layout.forget) == params.num_forget_clients
    kept = [records[i] for i in layout.kept]
    assert kept == scenario.knowledge_records(include_forget=False)
    assert layout.kept_groups[0] == records[layout.kept[0]]["author"]


def _distance_after_training(model, examples, pad, **kwargs) -> float:
    from fedunlearn.training.full import train_full

    start = [p.detach().clone() for p in model.parameters()]
    train_full(
        model,
        examples,
        pad_token_id=pad,
        epochs=2,
        lr=1e-2,
        batch_size=4,
        show_progress=False,
        **kwargs,
    )
    return float(
        sum(((p - s) ** 2).sum() for p, s in zip(model.parameters(), start, strict=True)) ** 0.5
    )


def test_fedprox_term_keeps_local_weights_near_the_round_start(
    tiny_model, tiny_tokenizer, tiny_data
):
    import copy

    from fedunlearn.qa_format import encode_record

    examples = [encode_record(tiny_tokenizer, r) for r in tiny_data.author_qa[:16]]
    pad = tiny_tokenizer.pad_token_id
    free = _distance_after_training(copy.deepcopy(tiny_model), examples, pad)
    held = _distance_after_training(copy.deepcopy(tiny_model), examples, pad, proximal_mu=100.0)
    assert held < 0.5 * free, (held, free)
    constant = _distance_after_training(
        copy.deepcopy(tiny_model), examples, pad, lr_schedule="constant"
    )
    assert constant > free  # no warm-up or decay: more movement at the same peak rate
    with pytest.raises(ValueError, match="unknown lr_schedule 'linear'"):
        _distance_after_training(tiny_model, examples, pad, lr_schedule="linear")


def test_without_flower_datasets_a_partition_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "flwr_datasets.partitioner", None)  # not installed
    with pytest.raises(ImportError, match="pip install --no-deps 'flwr-datasets==0.6.1'"):
        partition(POOL, GROUPS, 2, "iid", seed=0)
    assert len(partition(POOL, GROUPS, 2, "authors", seed=0)) == 2  # needs no Flower Datasets
