"""Mixed-role nodes (``scenario.mixed-clients``): one reply carries a forget upload and the
retain upload of what the node keeps; the server merges each part by its role, records both
under the node, and refuses a node whose second part is missing or bad without stopping the
round — real Flower messages into the real ``aggregate_train``."""

from __future__ import annotations

import math

import pytest
import torch
from flwr.app import ArrayRecord, Message

from fedunlearn.scenarios import ClientAssignment, fold_mixed
from strategies.merge_strategy import MergeStrategy
from strategies.upload_spool import UploadSpool
from tests.strategies.replies import reply_metadata
from tests.strategies.test_round_safety import ASSIGNMENTS, NODES, STATE, _honest, _metrics
from wire.messages import add_kept_part, encode_client_reply

MIXED = fold_mixed(ASSIGNMENTS, 1)  # node 11 forgets its records and keeps node 14's
MIXED_NODES = NODES[:3]


def _content(node: int, role: str, domain: str, scale: float = 1.0, examples: int = 4):
    tv, fisher = _honest(node)
    return encode_client_reply(
        role=role,
        domain=domain,
        objective="ga" if role == "forget" else "nll",
        num_examples=examples,
        task_vector={k: scale * v for k, v in tv.items()},
        fisher=fisher,
        metrics=_metrics(),
    )


def _separate_replies() -> list[Message]:
    return [
        Message(_content(n, a.role, a.domain, examples=4 + k), metadata=reply_metadata(n))
        for k, (n, a) in enumerate(zip(NODES, ASSIGNMENTS, strict=True))
    ]


def _mixed_replies(kept_role: str = "retain", kept_scale: float = 1.0, kept: bool = True):
    """Node 11 sends its own upload and, as its kept part, what node 14 sent on its own."""
    replies = []
    for k, node in enumerate(MIXED_NODES):
        content = _content(node, "forget", "d", examples=4 + k)
        if node == 11 and kept:
            add_kept_part(content, _content(14, kept_role, "retain", kept_scale, examples=7))
        replies.append(Message(content, metadata=reply_metadata(node)))
    return replies


def _strategy(assignments, nodes, **kwargs) -> MergeStrategy:
    strategy = MergeStrategy(
        merge="firm", merge_parameters={"gamma": 1.0}, assignments=assignments, **kwargs
    )
    strategy.node_assignment = dict(zip(nodes, assignments, strict=True))
    strategy.global_arrays = ArrayRecord({k: v.clone() for k, v in STATE.items()})
    return strategy


def _weights(arrays: ArrayRecord) -> dict[str, torch.Tensor]:
    return arrays.to_torch_state_dict()


def test_fold_mixed_puts_the_last_retain_clients_on_the_first_forget_nodes():
    layout = [ClientAssignment("forget", "d", (i,)) for i in range(3)] + [
        ClientAssignment("retain", "r", (10 + i,)) for i in range(3)
    ]
    folded = fold_mixed(layout, 2)
    assert [(a.indices, a.kept_indices, a.kept_domain) for a in folded] == [
        ((0,), (11,), "r"),
        ((1,), (12,), "r"),
        ((2,), (), ""),
        ((10,), (), ""),
    ]
    assert fold_mixed(layout, 0) == layout
    with pytest.raises(ValueError, match="mixed-clients=4: .* 3 forget and 3 retain"):
        fold_mixed(layout, 4)


@pytest.mark.parametrize("stream", [False, True])
def test_a_mixed_node_merges_bit_for_bit_as_the_same_uploads_from_separate_nodes(tmp_path, stream):
    spool = (lambda name: UploadSpool(tmp_path / name)) if stream else (lambda name: None)
    separate = _strategy(ASSIGNMENTS, NODES, spool=spool("a"))
    want, _ = separate.aggregate_train(1, _separate_replies())
    mixed = _strategy(MIXED, MIXED_NODES, spool=spool("b"))
    got, metrics = mixed.aggregate_train(1, _mixed_replies())
    assert metrics["num-updates"] == 4
    new, old = _weights(got), _weights(want)
    assert all(torch.equal(new[k], old[k]) for k in STATE)
    assert any(not torch.equal(new[k], STATE[k]) for k in STATE)

    record = mixed.round_record()
    reports = {r["node_id"]: r for r in record["clients"]}
    assert sorted(reports) == list(MIXED_NODES) and not any(
        "excluded" in r for r in reports.values()
    )
    kept = reports[11]["kept"]  # both uploads recorded under the one node
    assert (reports[11]["role"], kept["role"], kept["domain"]) == ("forget", "retain", "retain")
    assert (reports[11]["num_examples"], kept["num_examples"]) == (4, 7)
    assert kept["objective"] == "nll" and "upload_norm" in kept
    assert record["assignments"][0]["kept_indices"] == [3]
    assert [u.node_id for u in mixed.last_updates] == [11, 12, 13, "11-kept"]


def test_a_mixed_node_without_its_kept_part_is_excluded_and_the_others_merge():
    strategy = _strategy(MIXED, MIXED_NODES)
    arrays, metrics = strategy.aggregate_train(1, _mixed_replies(kept=False))
    assert metrics["num-updates"] == 2
    excluded = {r["node_id"]: r["excluded"] for r in strategy.client_reports if "excluded" in r}
    assert list(excluded) == [11]
    assert (
        "holds records to keep (mixed-role) but its reply has no 'kept-task_vector'"
        in (excluded[11])
    )
    assert all(torch.isfinite(t).all() for t in _weights(arrays).values())


@pytest.mark.parametrize(
    ("role", "scale", "problem"),
    [
        ("forget", 1.0, "client 11-kept: replied as role 'forget' but was assigned 'retain'"),
        ("retain", math.nan, "client 11-kept: task-vector"),
    ],
)
def test_a_bad_kept_part_excludes_its_node_by_name(role, scale, problem):
    strategy = _strategy(MIXED, MIXED_NODES)
    strategy.aggregate_train(1, _mixed_replies(kept_role=role, kept_scale=scale))
    excluded = {r["node_id"]: r["excluded"] for r in strategy.client_reports if "excluded" in r}
    assert list(excluded) == [11] and problem in excluded[11], excluded


def test_a_mixed_node_may_send_twice_the_upload_limit_of_a_single_one():
    strategy = _strategy(MIXED, MIXED_NODES)
    assert strategy.upload_limit_bytes(11) == 2 * strategy.upload_limit_bytes(12) > 0
    capped = _strategy(MIXED, MIXED_NODES, max_upload_mb=1.5)
    assert capped.upload_limit_bytes(11) == 2 * capped.upload_limit_bytes(12) == 3 * 2**20
