"""What the server sends a node each round: the full model, or only what differs from its base.

A node that holds the checkpoint the server started from, θ_base, declares it
(``base-checkpoint``, see :mod:`clients.base_checkpoint`) — or, a simulated node, takes the
folder the server loaded its model from, which the server offers (``base-offer``) in the node
query and the TRAIN config — and reports its hash in the node query. Where the hash equals the
server's (``state_sha256`` of the initial weights, computed once, and only when some node
declared a base), the node's TRAIN message holds only the weights of θ_round that differ bit
for bit from θ_base — none in round 1, the merged targeted weights afterwards — with
``model-delivery`` = ``delta-from-base``, ``base-sha256`` and ``model-sha256`` (the hash of
θ_round). The server keeps θ_base only as its tensors' digests: from round 2 on it hashes
θ_round once per round and sends the tensors whose digest changed.

What is sent for a changed weight is θ_round's value itself, in the model's dtype (the global
weights are kept in it: :mod:`wire.arrays`), not θ_round − θ_base: the same bytes, and exact
(θ_base + (θ_round − θ_base) is not θ_round bit for bit in floating point). FIRM's merged Δ
is a Fisher-weighted, masked sum of client updates, dense and not low rank, so a factored
form would not be smaller.

Every other node gets the full model, and the run log says why, once per node and reason:
``model.delivery='full'``, no base declared, the base could not be read, another hash, or a
strategy that starts after round 1 without θ_base's digests (the pipelines hand them over: a
resumed run and every round of a request schedule compare with the run's θ_base too). Every
node's report records ``bytes_received`` (= ``bytes_received_model`` +
``bytes_received_config``: the serialised arrays, and every config key and value) and
``model_delivery`` of the last round, and ``bytes_received_model_by_round`` (the model bytes
of every round this server process sent it, in order; the config is the same size every
round).
"""

from __future__ import annotations

from collections.abc import Mapping
from logging import INFO
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from flwr.common.logger import log

from strategies.node_roles import NodeDeclaration
from strategies.reply_fields import reply_bytes
from wire.delivery import (
    BASE_OFFER_KEY,
    BASE_SHA_KEY,
    DELIVERY_KEY,
    DELTA,
    FULL,
    MODEL_SHA_KEY,
    record_digests,
    state_sha256,
)


def content_bytes(content: RecordDict) -> tuple[int, int]:
    """(model bytes, config bytes) of a server → client message: the serialised arrays, and
    the config records' keys and values (counted as :func:`reply_bytes` counts them)."""
    model = sum(len(a.data) for record in content.array_records.values() for a in record.values())
    return model, reply_bytes(content) - model


def changed_keys(digests: Mapping[str, str], base_digests: Mapping[str, str]) -> list[str]:
    """The weights whose :func:`~wire.delivery.weight_digest` differs from θ_base's (same key
    set): what a node holding θ_base must be sent."""
    if set(digests) != set(base_digests):
        raise ValueError("the global weights' keys are not those of the base checkpoint")
    return [key for key in digests if digests[key] != base_digests[key]]


class ModelDelivery:
    """The per-node choice full / delta-from-base, the payloads, and what each node was sent.

    Call :meth:`declare` with the node query's declarations, :meth:`start_round` with each
    round's global weights (the run's round 1: they are θ_base), then :meth:`content` per node
    and :meth:`record` on every message actually sent; :meth:`report` gives a node's fields.
    ``offer`` is the folder the server loaded θ_base from (a simulated node's base: sent in
    the node query and the TRAIN config); ``by_reference=False`` (``model.delivery='full'``)
    sends every node the full model whatever it declares.
    """

    def __init__(
        self,
        *,
        offer: str | None = None,
        by_reference: bool = True,
        base_digests: Mapping[str, str] | None = None,
    ) -> None:
        self.offer = offer if by_reference else None
        self.by_reference = by_reference
        self.declarations: dict[int, NodeDeclaration] = {}
        # θ_base as its tensors' digests (set in round 1 when some node declares a base, or
        # given: a strategy that starts later in the run; the weights themselves are not
        # kept: a round's changed tensors are found by rehashing)
        self.base_digests: dict[str, str] = dict(base_digests or {})
        self.base_sha256: str | None = state_sha256(base_digests) if base_digests else None
        self.no_base_reason: str | None = None  # why the server has no θ_base to compare
        self._round: tuple[list[str], str] | None = None  # this round's changed keys, hash
        self._arrays: ArrayRecord | None = None
        self._sent: dict[int, dict[str, Any]] = {}
        self._history: dict[int, list[int]] = {}  # node id → model bytes sent per round
        self._logged: set[tuple[int | None, str]] = set()

    def declare(self, declarations: Mapping[int, NodeDeclaration]) -> None:
        """What the nodes declared in the last node query (replaces the earlier ones)."""
        self.declarations = dict(declarations)

    def start_round(self, server_round: int, arrays: ArrayRecord) -> None:
        """Round ``server_round``'s global weights; in round 1 they are θ_base, hashed now
        when some node declared a base (otherwise nothing is kept)."""
        self._arrays, self._round = arrays, None
        wants = any(d.base_sha256 for d in self.declarations.values())
        if server_round == 1 and self.base_sha256 is None and self.no_base_reason is None:
            if not wants:
                self.no_base_reason = "no node declared a base-checkpoint in round 1"
                return
            self.base_digests = record_digests(arrays)
            self.base_sha256 = state_sha256(self.base_digests)
            self._round = ([], self.base_sha256)  # round 1's weights are θ_base
        elif self.base_sha256 is None and self.no_base_reason is None:
            self.no_base_reason = (
                f"the strategy starts at round {server_round} (a resumed run, or a request "
                "schedule's next round) without the digests of the weights the run started "
                "from"
            )

    def end_rounds(self) -> None:
        """No more rounds: drop the last round's weights (what was sent stays reported)."""
        self._arrays, self._round = None, None

    def _round_delta(self) -> tuple[list[str], str]:
        """(changed keys, state_sha256 of θ_round), computed once per round."""
        if self._round is None:
            # only for a node that gets the delta: start_round set the weights, and a base
            assert self._arrays is not None and self.base_sha256 is not None
            digests = record_digests(self._arrays)
            self._round = (changed_keys(digests, self.base_digests), state_sha256(digests))
        return self._round

    def why_full(self, node_id: int) -> str | None:
        """Why node ``node_id`` gets the full model (None: it gets the delta)."""
        if not self.by_reference:
            return "model.delivery='full'"
        declaration = self.declarations.get(node_id)
        if declaration is not None and declaration.base_problem:
            return f"its base-checkpoint cannot be used: {declaration.base_problem}"
        if declaration is None or not declaration.base_sha256:
            return "it declares no base-checkpoint"
        if self.base_sha256 is None:
            return str(self.no_base_reason)
        if declaration.base_sha256 != self.base_sha256:
            return (
                f"its base-checkpoint has sha256 {declaration.base_sha256[:12]}…, the "
                f"server's initial weights {self.base_sha256[:12]}…"
            )
        return None

    def content(self, node_id: int, arrays: ArrayRecord, node_config: ConfigRecord) -> RecordDict:
        """Node ``node_id``'s TRAIN content: ``arrays`` in full, or only the weights that
        differ from its base with the hashes it checks them against."""
        reason = self.why_full(node_id)
        if reason is not None:
            self._say_once(node_id, reason)
            return RecordDict({"arrays": arrays, "config": node_config})
        keys, model_sha256 = self._round_delta()
        config = ConfigRecord(
            {
                **dict(node_config),
                DELIVERY_KEY: DELTA,
                BASE_SHA_KEY: str(self.base_sha256),
                MODEL_SHA_KEY: model_sha256,
                **({BASE_OFFER_KEY: self.offer} if self.offer else {}),
            }
        )
        sent = ArrayRecord({key: arrays[key] for key in keys})
        return RecordDict({"arrays": sent, "config": config})

    def _say_once(self, node_id: int, reason: str) -> None:
        """Log why a node gets the full model, once per node and reason (one line for all
        nodes when none declares a base)."""
        key: tuple[int | None, str]
        if not self.by_reference:
            key, line = (None, ""), "every node gets the full model: model.delivery='full'"
        elif any(d.base_sha256 or d.base_problem for d in self.declarations.values()):
            key, line = (node_id, reason), f"node {node_id} gets the full model: {reason}"
        else:
            key, line = (
                (None, ""),
                "every node gets the full model: none declares a base-checkpoint",
            )
        if key not in self._logged:
            self._logged.add(key)
            log(INFO, "%s", line)

    def record(self, node_id: int, content: RecordDict) -> None:
        """Note what node ``node_id`` is sent this round (any strategy's content)."""
        model, config = content_bytes(content)
        delivery = FULL
        if "config" in content.config_records:
            delivery = str(content.config_records["config"].get(DELIVERY_KEY, FULL))
        self._history.setdefault(node_id, []).append(model)
        self._sent[node_id] = {
            "bytes_received": model + config,
            "bytes_received_model": model,
            "bytes_received_config": config,
            "model_delivery": delivery,
            "bytes_received_model_by_round": list(self._history[node_id]),
        }

    def report(self, node_id: int) -> dict[str, Any]:
        """``bytes_received``, ``bytes_received_model``, ``bytes_received_config`` and
        ``model_delivery`` of what node ``node_id`` was last sent, and
        ``bytes_received_model_by_round`` ({} if nothing)."""
        return dict(self._sent.get(node_id, {}))
