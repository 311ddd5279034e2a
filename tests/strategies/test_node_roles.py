"""Mapping the scenario's clients onto nodes from the roles they declare in --node-config."""

from collections.abc import Iterable

import pytest
from flwr.app import Context, Message, MessageType, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from clients.client_app import app as client_app
from fedunlearn.scenarios import ClientAssignment
from strategies.node_roles import (
    NodeDeclaration,
    NodeRoleError,
    assign_by_declared_roles,
    assign_nodes,
    query_declarations,
)

FORGET_A = ClientAssignment("forget", "tofu-forget", (0, 1))
FORGET_B = ClientAssignment("forget", "tofu-forget", (2, 3))
RETAIN = ClientAssignment("retain", "retain", (10, 11))
SCENARIO = [FORGET_A, FORGET_B, RETAIN]


def declare(
    node_id: int, role: str | None, pid: int | None = None, *, shared: bool = False
) -> NodeDeclaration:
    return NodeDeclaration(node_id=node_id, role=role, partition_id=pid, shared_machine=shared)


def test_without_declared_roles_sorted_node_order_as_before():
    nodes = [30, 10, 20, 40]  # one surplus node stays idle
    expected = {10: FORGET_A, 20: FORGET_B, 30: RETAIN}
    assert assign_by_declared_roles(nodes, SCENARIO, {}) == expected
    # simulation: every node has a partition-id but no role
    sim = {n: declare(n, None, i) for i, n in enumerate(reversed(nodes))}
    mapping = assign_by_declared_roles(nodes, SCENARIO, sim)
    assert mapping == expected and list(mapping) == [10, 20, 30]


def test_declared_roles_win_over_node_order_and_partition_id_orders_a_role():
    declarations = {
        10: declare(10, "retain", 0),  # smallest id, would be forget in sorted order
        20: declare(20, "forget", 5),
        30: declare(30, "forget", 1),
    }
    mapping = assign_by_declared_roles([30, 20, 10], SCENARIO, declarations)
    assert mapping == {30: FORGET_A, 20: FORGET_B, 10: RETAIN}
    assert list(mapping.values()) == SCENARIO  # scenario order: seeds and merge order


def test_missing_partition_ids_go_last_in_node_id_order():
    declarations = {
        5: declare(5, "forget"),
        9: declare(9, "forget", 0),
        7: declare(7, "retain"),
    }
    mapping = assign_by_declared_roles([5, 7, 9], SCENARIO, declarations)
    assert mapping == {9: FORGET_A, 5: FORGET_B, 7: RETAIN}


def test_too_many_nodes_of_a_role_names_them():
    declarations = {
        1: declare(1, "forget", 0),
        2: declare(2, "retain", 1),
        3: declare(3, "retain", 2),
    }
    with pytest.raises(NodeRoleError) as err:
        assign_by_declared_roles([1, 2, 3], SCENARIO, declarations)
    text = str(err.value)
    assert "needs 1 retain node(s) but 2 declare role='retain'" in text
    assert "2 (partition-id=1), 3 (partition-id=2)" in text
    assert "needs 2 forget node(s) but 1 declare" in text and "nodes 1 (partition-id=0)" in text


def test_unknown_role_partial_declarations_and_shared_partition_ids_are_errors():
    with pytest.raises(NodeRoleError, match=r"nodes 4 declare role 'keep'.*2 forget, 1 retain"):
        assign_by_declared_roles(
            [1, 2, 3, 4],
            SCENARIO,
            {1: declare(1, "forget"), 2: declare(2, "forget"), 3: declare(3, "retain")}
            | {4: declare(4, "keep")},
        )
    with pytest.raises(NodeRoleError, match=r"nodes \[3\] declare no role"):
        assign_by_declared_roles(
            [1, 2, 3], SCENARIO, {1: declare(1, "forget"), 2: declare(2, "forget")}
        )
    with pytest.raises(NodeRoleError, match=r"nodes \[1, 2\] all declare role='forget' partition"):
        assign_by_declared_roles(
            [1, 2, 3],
            SCENARIO,
            {1: declare(1, "forget", 0), 2: declare(2, "forget", 0), 3: declare(3, "retain", 0)},
        )


class ClientAppGrid:
    """Delivers messages to the real ClientApp, each node with its own node config."""

    def __init__(self, node_configs: dict[int, dict]) -> None:
        self.node_configs = node_configs
        self.sent: list[Message] = []

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None):
        replies = []
        for msg in messages:
            self.sent.append(msg)
            context = Context(
                run_id=1,
                node_id=msg.metadata.dst_node_id,
                node_config=self.node_configs[msg.metadata.dst_node_id],
                state=RecordDict(),
                run_config={},
            )
            replies.append(client_app(msg, context))
        return replies


@pytest.fixture()
def server_identity(monkeypatch):
    """Messages can only be created inside a Flower task: pretend to be the ServerApp."""
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)


def test_query_round_through_the_client_app(server_identity):
    grid = ClientAppGrid(
        {
            11: {"role": "forget", "partition-id": 1, "data-path": "/secret/shard1"},
            12: {"role": "retain", "partition-id": 2},
            13: {"role": "forget", "partition-id": 0},
        }
    )
    declarations = query_declarations(grid, [11, 12, 13], timeout=5)
    assert {m.metadata.message_type for m in grid.sent} == {MessageType.QUERY}
    assert sorted(m.metadata.dst_node_id for m in grid.sent) == [11, 12, 13]
    assert declarations == {
        11: declare(11, "forget", 1),
        12: declare(12, "retain", 2),
        13: declare(13, "forget", 0),
    }
    mapping = assign_nodes(grid, [11, 12, 13], SCENARIO, timeout=5)
    assert mapping == {13: FORGET_A, 11: FORGET_B, 12: RETAIN}
    # the next round keeps the mapping without asking again
    grid.sent.clear()
    assert assign_nodes(grid, [11, 12, 13], SCENARIO, timeout=5, previous=mapping) == mapping
    assert grid.sent == []


def test_simulation_node_config_falls_back_to_sorted_order(server_identity):
    grid = ClientAppGrid(
        {n: {"partition-id": i, "num-partitions": 3} for i, n in enumerate([9, 8, 7])}
    )
    declarations = query_declarations(grid, [9, 8, 7], timeout=5)
    # a simulated node says it shares the server's machine (it can read the server's files)
    assert declarations[9] == declare(9, None, 0, shared=True)
    assert assign_nodes(grid, [9, 8, 7], SCENARIO, timeout=5) == {
        7: FORGET_A,
        8: FORGET_B,
        9: RETAIN,
    }


# ---- issue 13: no node aborts the run with what it declares ---------------------------------


def test_unreadable_partition_ids_are_refused_in_simulation(server_identity, caplog):
    """Without declared roles a refused node still trains: its partition-id is not used."""
    grid = ClientAppGrid(
        {7: {"partition-id": "abc"}, 8: {"partition-id": 1}, 9: {"partition-id": float("inf")}}
    )
    assert query_declarations(grid, [7, 8, 9], timeout=5) == {8: declare(8, None, 1, shared=True)}
    assert "node 7 declares partition-id='abc', not a whole number >= 0" in caplog.text
    assert "node 9 declares partition-id=inf" in caplog.text
    assert assign_nodes(grid, [7, 8, 9], SCENARIO, timeout=5) == {
        7: FORGET_A,
        8: FORGET_B,
        9: RETAIN,
    }


def test_a_refused_node_stays_idle_when_the_declared_nodes_fill_the_scenario(server_identity):
    grid = ClientAppGrid(
        {
            11: {"role": "forget", "partition-id": 0},
            12: {"role": "forget", "partition-id": 1.0},  # a whole float is read as 1
            13: {"role": "retain", "partition-id": 0},
            14: {"role": "forget", "partition-id": "x"},
            15: {"role": "f" * 100, "partition-id": 2},
        }
    )
    mapping = assign_nodes(grid, [11, 12, 13, 14, 15], SCENARIO, timeout=5)
    assert mapping == {11: FORGET_A, 12: FORGET_B, 13: RETAIN}


def test_a_refused_node_the_scenario_needs_is_named_in_the_error(server_identity, caplog):
    grid = ClientAppGrid(
        {
            11: {"role": "forget", "partition-id": 0},
            12: {"role": "forget", "partition-id": "abc"},
            13: {"role": "retain", "partition-id": 0},
        }
    )
    with pytest.raises(NodeRoleError) as err:
        assign_nodes(grid, [11, 12, 13], SCENARIO, timeout=5)
    assert "needs 2 forget node(s) but 1 declare" in str(err.value)
    assert "nodes [12] declare no role" in str(err.value)
    assert "node 12 declares partition-id='abc'" in caplog.text


def test_undeclared_surplus_nodes_stay_idle():
    declarations = {1: declare(1, "forget", 0), 2: declare(2, "forget", 1), 3: declare(3, "retain")}
    mapping = assign_by_declared_roles([1, 2, 3, 4], SCENARIO, declarations)
    assert mapping == {1: FORGET_A, 2: FORGET_B, 3: RETAIN}
