"""Mixed-role nodes on the server: one reply, two uploads (docs/scenarios.md, "Mixed-role
clients").

A forget client that also keeps records (``ClientAssignment.kept_indices``) replies with its
forget upload and, under ``wire.messages.KEPT_PREFIX``, the retain upload of what it keeps.
Both are checked like any reply; the kept part becomes a retain ``ClientUpdate`` of its own
whose id, ``"<node>-kept"``, records the node it came from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from flwr.app import RecordDict

from fedunlearn.merging import ClientUpdate
from fedunlearn.scenarios import ClientAssignment
from strategies.reply_fields import ReplyRejected
from strategies.reply_validation import ReplySpec, validate_reply_content
from strategies.seeding import client_seed
from wire.messages import KEPT_PREFIX, decode_client_reply, kept_part

KEPT_SUFFIX = "-kept"


def kept_part_id(node_id: int) -> str:
    """The update id of node ``node_id``'s kept part."""
    return f"{node_id}{KEPT_SUFFIX}"


def is_kept_part(update_id: int | str) -> bool:
    """True for the id of a mixed-role node's kept part."""
    return isinstance(update_id, str) and update_id.endswith(KEPT_SUFFIX)


def node_of(update_id: int | str) -> int:
    """The node an update came from (its own id, or a kept part's node)."""
    return int(str(update_id).removesuffix(KEPT_SUFFIX))


def kept_config(
    assignment: ClientAssignment,
    nodes: Sequence[ClientAssignment],
    retain_config: Mapping[str, Any],
    seed: int,
    server_round: int,
) -> dict[str, Any]:
    """What a mixed-role node (``assignment``, one of the round's ``nodes`` in node order) is
    sent for its second part ({} for any other node): the records it keeps, the retain role's
    settings (``retain_config``) under ``kept-`` and the seed of the client it would be on its
    own — the k-th kept part takes merge position (nodes + k), where ``fold_mixed`` put that
    retain client's upload."""
    if not assignment.mixed:
        return {}
    mixed = [a for a in nodes if a.mixed]
    rank = next(k for k, a in enumerate(mixed) if a is assignment)
    return {
        "kept-indices": list(assignment.kept_indices),
        "kept-domain": assignment.kept_domain,
        **{f"kept-{key}": value for key, value in retain_config.items()},
        "kept-seed": client_seed(seed, len(nodes) + rank, server_round),
    }


def decode_kept_part(
    node_id: int, content: RecordDict, spec: ReplySpec, kept_domain: str
) -> tuple[ClientUpdate, dict[str, Any]]:
    """The kept part of node ``node_id``'s reply, validated as a retain reply of
    ``kept_domain`` against the node's ``spec`` (shapes, Fisher, rank), as a retain
    ``ClientUpdate`` and its report fields; :class:`ReplyRejected` naming the node when the
    part is missing or fails a check."""
    part = kept_part(content)
    if "task_vector" not in part:
        raise ReplyRejected(
            node_id,
            f"holds records to keep (mixed-role) but its reply has no "
            f"{KEPT_PREFIX + 'task_vector'!r} record",
        )
    part_id = kept_part_id(node_id)
    fields = validate_reply_content(part_id, part, replace(spec, role="retain", domain=kept_domain))
    update, _ = decode_client_reply(part_id, part, spec.shapes)
    return update, {"role": "retain", "domain": kept_domain, **fields}
