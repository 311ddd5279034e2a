"""Which node plays which part: roles declared in the SuperNodes' node config.

In a deployment every SuperNode holds its own data, so the node, not the server, knows
whether it is a forget or a retain client::

    flower-supernode ... --node-config "role='forget' partition-id=0 data-path='/data/shard0'"

Before the first round the server asks every node for its ``role`` and ``partition-id``
with one QUERY message (answered by ``clients.client_app.query``) and maps the scenario's
assignments onto the nodes that declared the matching role, in ``partition-id`` order.
When no node declares a role (simulation, where the node config only has ``partition-id``
and ``num-partitions``), node i in sorted node-id order gets assignment i, as before.

The same query asks for the sha256 of the node's ``base-checkpoint``, if it declares one
(``clients.base_checkpoint``): where it matches the server's initial weights, the node is
sent only the weights that differ from them (``strategies.model_delivery``). A hash that is
not 64 hex digits counts as no base (logged); the node keeps its role.

No single node can abort the run from here (issue 13): a node whose answer cannot be read
(an error, no ``node-info`` record, a ``role`` that is no short string, a ``partition-id``
that is no whole number >= 0) is refused — logged with the problem and counted as having
declared nothing, exactly like a node that did not answer. Where other nodes declare roles, a
node that declared nothing stays idle as long as the declared nodes fill the scenario.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from logging import INFO, WARNING

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from fedunlearn.scenarios import ClientAssignment
from wire.delivery import BASE_OFFER_KEY, BASE_PROBLEM_KEY, BASE_SHA_KEY, SHARED_MACHINE_KEY

ROLE_KEY = "role"
PARTITION_KEY = "partition-id"
QUERY_KEY = "node-info"  # the record a node's QUERY reply carries


@dataclass(frozen=True)
class NodeDeclaration:
    """What one node declared in its ``--node-config`` (``None``: not declared)."""

    node_id: int
    role: str | None = None
    partition_id: int | None = None
    base_sha256: str | None = None  # the hash of its base-checkpoint
    base_problem: str | None = None  # why its declared base-checkpoint cannot be used
    shared_machine: bool = False  # a simulated node: it reads files the server writes

    def describe(self) -> str:
        partition = "" if self.partition_id is None else f" (partition-id={self.partition_id})"
        return f"{self.node_id}{partition}"


class NodeRoleError(ValueError):
    """The roles the nodes declared do not fit the clients the scenario needs."""


#: Longest ``role`` a node may declare (the scenario's roles are short names).
MAX_ROLE_CHARS = 64


def _partition_order(declaration: NodeDeclaration) -> tuple[bool, int, int]:
    pid = declaration.partition_id
    return (pid is None, pid if pid is not None else 0, declaration.node_id)


def assign_by_declared_roles(
    node_ids: Sequence[int],
    assignments: Sequence[ClientAssignment],
    declarations: Mapping[int, NodeDeclaration],
) -> dict[int, ClientAssignment]:
    """Map the scenario's ``assignments`` onto nodes (pure function).

    Parameters
    ----------
    node_ids : the connected nodes.
    assignments : the scenario's clients, in the scenario's order.
    declarations : what each node declared (nodes missing here declared nothing).

    Returns
    -------
    ``{node id: assignment}`` in the scenario's assignment order. Without any declared role:
    node i in sorted node-id order gets assignment i (surplus nodes stay idle). With declared
    roles: the k-th assignment of a role goes to the node with the k-th smallest
    ``partition-id`` among the nodes declaring that role; nodes that declare no role (or
    whose declaration was refused) stay idle.

    Raises
    ------
    NodeRoleError
        when a node declares a role the scenario does not use, two nodes of a role share a
        ``partition-id``, or the number of nodes declaring a role differs from the number of
        clients of that role (the message also names the nodes that declared no role); the
        message names the nodes concerned.
    """
    ordered = sorted(int(n) for n in node_ids)
    declared = [
        declarations[n] for n in ordered if n in declarations and declarations[n].role is not None
    ]
    if not declared:
        return dict(zip(ordered, assignments, strict=False))

    problems: list[str] = []
    undeclared = [n for n in ordered if n not in {d.node_id for d in declared}]
    needed = Counter(a.role for a in assignments)
    by_role: dict[str, list[NodeDeclaration]] = defaultdict(list)
    for declaration in declared:
        by_role[str(declaration.role)].append(declaration)
    for role in sorted(set(by_role) - set(needed)):
        names = ", ".join(d.describe() for d in by_role[role])
        problems.append(
            f"nodes {names} declare role {role!r}, which this scenario does not use "
            f"(it needs {_count_text(needed)})"
        )
    for role, count in needed.items():
        nodes = sorted(by_role.get(role, []), key=_partition_order)
        names = ", ".join(d.describe() for d in nodes) or "none"
        if len(nodes) != count:
            problems.append(
                f"the scenario needs {count} {role} node(s) but {len(nodes)} declare "
                f"{ROLE_KEY}={role!r}: nodes {names}"
            )
        pids = Counter(d.partition_id for d in nodes if d.partition_id is not None)
        for pid, times in sorted(pids.items()):
            if times > 1:
                same = [d.node_id for d in nodes if d.partition_id == pid]
                problems.append(
                    f"nodes {same} all declare {ROLE_KEY}={role!r} {PARTITION_KEY}={pid}; "
                    "give every node of a role its own partition-id"
                )
        by_role[role] = nodes
    if problems and undeclared:
        problems.append(
            f"nodes {undeclared} declare no role while {len(declared)} other node(s) do: set "
            f"{ROLE_KEY}='forget' or {ROLE_KEY}='retain' in every SuperNode's --node-config "
            "(or in none)"
        )
    if problems:
        raise NodeRoleError(
            "the SuperNodes' declared roles do not match the scenario:\n  - "
            + "\n  - ".join(problems)
        )
    if undeclared:
        log(WARNING, "nodes %s declare no role while the others do: they stay idle", undeclared)
    queues = {role: list(nodes) for role, nodes in by_role.items()}
    mapping: dict[int, ClientAssignment] = {}
    for assignment in assignments:
        mapping[queues[assignment.role].pop(0).node_id] = assignment
    return mapping


def _count_text(needed: Counter) -> str:
    return ", ".join(f"{count} {role}" for role, count in sorted(needed.items()))


def declaration_from_record(node_id: int, record: ConfigRecord) -> NodeDeclaration:
    """A node's QUERY reply (``role`` / ``partition-id`` when set) as a declaration.

    Raises ``NodeRoleError`` naming the node and the value when ``role`` is not a string of
    at most :data:`MAX_ROLE_CHARS` characters or ``partition-id`` not a whole number >= 0.
    """
    role, pid = record.get(ROLE_KEY), record.get(PARTITION_KEY)
    if role is not None and not (isinstance(role, str) and len(role) <= MAX_ROLE_CHARS):
        raise NodeRoleError(
            f"node {node_id} declares {ROLE_KEY}={_shown(role)}, not a name of at most "
            f"{MAX_ROLE_CHARS} characters"
        )
    base_sha256, base_problem = _base(node_id, record)
    return NodeDeclaration(
        node_id=int(node_id),
        role=None if role is None or role == "" else role,
        partition_id=None if pid is None else _partition_id(node_id, pid),
        base_sha256=base_sha256,
        base_problem=base_problem,
        shared_machine=record.get(SHARED_MACHINE_KEY) is True,
    )


def _base(node_id: int, record: ConfigRecord) -> tuple[str | None, str | None]:
    """(sha256, problem) of the node's base-checkpoint; a malformed hash is a problem."""
    sha256, problem = record.get(BASE_SHA_KEY), record.get(BASE_PROBLEM_KEY)
    if problem is not None:
        return None, str(problem)[:300]
    if sha256 is None:
        return None, None
    if isinstance(sha256, str) and re.fullmatch(r"[0-9a-f]{64}", sha256):
        return sha256, None
    log(
        WARNING,
        "node %s: %s=%s is no sha256; it counts as no base",
        node_id,
        BASE_SHA_KEY,
        _shown(sha256),
    )
    return None, f"{BASE_SHA_KEY}={_shown(sha256)} is no sha256"


def _partition_id(node_id: int, pid: object) -> int:
    if isinstance(pid, float) and math.isfinite(pid) and pid.is_integer():
        pid = int(pid)
    if isinstance(pid, bool) or not isinstance(pid, int) or pid < 0:
        raise NodeRoleError(
            f"node {node_id} declares {PARTITION_KEY}={_shown(pid)}, not a whole number >= 0"
        )
    return pid


def _shown(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def query_declarations(
    grid: Grid, node_ids: Iterable[int], timeout: float, offer: str | None = None
) -> dict[int, NodeDeclaration]:
    """Ask every node (one QUERY message each) for the role it declared (and the hash of its
    base checkpoint: a simulated node's is ``offer``, the server's own, when it declares none).

    Nodes that answer with an error, not within ``timeout`` seconds, or with a declaration
    that cannot be read (``declaration_from_record``) count as having declared nothing
    (logged with the node and the problem); answers of nodes not asked are ignored.
    """
    node_ids = [int(n) for n in node_ids]
    ask = ConfigRecord(
        {
            "ask": [ROLE_KEY, PARTITION_KEY, BASE_SHA_KEY],
            **({BASE_OFFER_KEY: offer} if offer else {}),
        }
    )
    messages = [
        Message(
            content=RecordDict({QUERY_KEY: ask}),
            message_type=MessageType.QUERY,
            dst_node_id=node_id,
            group_id="node-roles",
        )
        for node_id in node_ids
    ]
    declarations: dict[int, NodeDeclaration] = {}
    answered: set[int] = set()
    for reply in grid.send_and_receive(messages, timeout=timeout):
        node_id = int(reply.metadata.src_node_id)
        if node_id not in node_ids or node_id in answered:
            log(WARNING, "ignoring a role reply from node %s (not asked, or a second one)", node_id)
            continue
        answered.add(node_id)
        if reply.has_error():
            reason = _shown(str(reply.error.reason), 500)
            log(WARNING, "node %s did not answer the role query: %s", node_id, reason)
            continue
        if QUERY_KEY not in reply.content:
            log(WARNING, "node %s answered the role query without %r", node_id, QUERY_KEY)
            continue
        record = reply.content[QUERY_KEY]
        if not isinstance(record, ConfigRecord):
            log(WARNING, "node %s answered the role query with a %s", node_id, type(record))
            continue
        try:
            declarations[node_id] = declaration_from_record(node_id, record)
        except NodeRoleError as err:
            log(WARNING, "refusing the role declaration of %s; it counts as none", err)
    missing = sorted(set(node_ids) - set(declarations))
    if missing and len(missing) < len(node_ids):
        log(WARNING, "no role reply from nodes %s within %.0f s", missing, timeout)
    return declarations


def assign_nodes(
    grid: Grid,
    node_ids: Sequence[int],
    assignments: Sequence[ClientAssignment],
    timeout: float,
    previous: Mapping[int, ClientAssignment] | None = None,
) -> dict[int, ClientAssignment]:
    """``{node id: assignment}`` for this round, from the nodes' declared roles.

    ``previous`` (the last round's mapping) is kept when all its nodes are still connected,
    so a node keeps its shard across rounds and is queried only once.
    """
    return assign_and_declare(grid, node_ids, assignments, timeout, previous)[0]


def assign_and_declare(
    grid: Grid,
    node_ids: Sequence[int],
    assignments: Sequence[ClientAssignment],
    timeout: float,
    previous: Mapping[int, ClientAssignment] | None = None,
    offer: str | None = None,
) -> tuple[dict[int, ClientAssignment], dict[int, NodeDeclaration] | None]:
    """:func:`assign_nodes` and the declarations it read (None: ``previous`` was kept and no
    node was queried; ``offer``: :func:`query_declarations`)."""
    if (
        previous
        and len(previous) == len(assignments)
        and set(previous) <= {int(n) for n in node_ids}
        and list(previous.values()) == list(assignments)
    ):
        return dict(previous), None
    declarations = query_declarations(grid, node_ids, timeout, offer)
    mapping = assign_by_declared_roles(node_ids, assignments, declarations)
    if any(d.role is not None for d in declarations.values()):
        log(
            INFO,
            "roles from the nodes' --node-config: %s",
            ", ".join(
                f"{node_id}={a.role}"
                + (
                    f"(partition-id={declarations[node_id].partition_id})"
                    if declarations[node_id].partition_id is not None
                    else ""
                )
                for node_id, a in mapping.items()
            ),
        )
    return mapping, declarations
