"""A node's base checkpoint: the server sends it only the weights that differ from it.

A node's base θ_base is a Hugging Face checkpoint folder holding the weights the server
starts from. It is, in this order:

* ``base-checkpoint`` in the node's own node config (deployment: ``flower-supernode
  --node-config "... base-checkpoint='/models/base'"``) — the opt-in of a real machine;
* ``model.base-checkpoint`` in the run config, for every node that declares none;
* in a simulation (a node whose node config holds only Flower's simulation keys), the folder
  the server itself loaded its model from, which the server offers in the node query and in
  every TRAIN message (``base-offer``): every node of a simulation runs on the server's
  machine, so with ``model.delivery='auto'`` (the default) no node is sent the model it can
  read from disk. A node that cannot read it reports why and gets the full model.

The node reports the sha256 of θ_base in its answer to the node query; where that matches
the server's initial weights, every TRAIN message carries only the weights of θ_round that
differ from θ_base (round 1: none) and the node loads θ_base straight from the folder into
the model it trains and puts the received weights in place (:func:`received_model`), checking
the result against the hash the server sent. No second copy of the weights is kept.

The hash (:func:`state_sha256`) is over every key of the model's ``state_dict``: a sha256
per tensor over its values widened to float32 (exact for 16-bit weights), its shape and
bytes, then one sha256 over ``key<TAB>digest`` lines in sorted key order, so either side
rehashes only the tensors that changed. The node's hash equals the server's when the
server's model holds the file's values (a float32 run, or a bfloat16 file run in bfloat16); a
bfloat16 server model of a float32 file does not match, and the node gets the full model.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from safetensors import safe_open
from transformers import AutoModelForCausalLM, PreTrainedModel

from fedunlearn.models.llama import resolve_dtype
from wire.arrays import array_tensor
from wire.delivery import (
    BASE_KEY,
    BASE_OFFER_KEY,
    BASE_PROBLEM_KEY,
    BASE_SHA_KEY,
    DELIVERY_KEY,
    DELTA,
    FULL,
    RUN_BASE_KEY,
    model_file_key,
    model_sha_key,
    state_sha256,
    weight_digest,
)
from wire.messages import finish_model, rebuild_model

_STATE_KEY = "base-checkpoint-hash"  # context.state: the hash, computed once per node
#: the node config Flower's simulation engine gives every virtual node, and nothing else
SIMULATED_NODE_KEYS = frozenset({"partition-id", "num-partitions"})


@dataclass(frozen=True)
class BaseCheckpoint:
    """θ_base's folder and its tensors' digests (``weight_digest``: as float32)."""

    path: Path
    signature: str  # the folder's files (names, sizes, modification times)
    digests: dict[str, str]

    @property
    def sha256(self) -> str:
        return state_sha256(self.digests)


_hashed: dict[str, BaseCheckpoint] = {}  # the digests of the bases this process hashed


def simulated_node(context: Context) -> bool:
    """Whether the node is a virtual node of a Flower simulation (its node config holds only
    the partition keys the simulation engine sets)."""
    return set(context.node_config) <= SIMULATED_NODE_KEYS


def declared_base(context: Context, offer: str | None = None) -> Path | None:
    """The node's θ_base folder: its ``base-checkpoint`` node config, the run config's
    ``model.base-checkpoint``, or (a simulated node) the server's ``offer``; None when none."""
    value = context.node_config.get(BASE_KEY) or context.run_config.get(RUN_BASE_KEY)
    if not value and offer and simulated_node(context):
        value = offer
    return Path(str(value)).expanduser().resolve() if value else None


def folder_signature(path: Path) -> str:
    """What identifies a checkpoint folder's contents cheaply (file names, sizes, mtimes)."""
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint folder (no config.json)")
    files = sorted(p for p in path.iterdir() if p.is_file())
    return ";".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)


def load_base(path: Path) -> BaseCheckpoint:
    """θ_base's digests (``weight_digest``), hashed once per process while
    the folder is unchanged; the weights themselves are not kept."""
    signature = folder_signature(path)
    cached = _hashed.get(str(path))
    if cached is not None and cached.signature == signature:
        return cached
    # in the file's dtype: a bfloat16 checkpoint is not widened whole, only tensor by tensor
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype="auto")
    digests = {key: weight_digest(value) for key, value in model.state_dict().items()}
    del model
    _hashed[str(path)] = BaseCheckpoint(path, signature, digests)
    return _hashed[str(path)]


def base_declaration(context: Context, offer: str | None = None) -> dict[str, str]:
    """The query-reply fields about the node's base: ``base-sha256`` (cached in the node's
    ``context.state`` while the folder is unchanged), ``base-problem`` when the base cannot
    be read, nothing when the node has none (``offer``: the server's starting checkpoint)."""
    path = declared_base(context, offer)
    if path is None:
        return {}
    try:
        signature = folder_signature(path)
        cached = context.state.get(_STATE_KEY)
        if isinstance(cached, ConfigRecord) and cached.get("key") == f"{path}|{signature}":
            return {BASE_SHA_KEY: str(cached[BASE_SHA_KEY])}
        sha256 = load_base(path).sha256
    except Exception as err:  # noqa: BLE001 — a bad base must not cost the node its role
        return {BASE_PROBLEM_KEY: f"{type(err).__name__}: {err}"[:300]}
    context.state[_STATE_KEY] = ConfigRecord({"key": f"{path}|{signature}", BASE_SHA_KEY: sha256})
    return {BASE_SHA_KEY: sha256}


def received_model(
    config: ConfigRecord, arrays: ArrayRecord, context: Context, copy: int | None = None
) -> PreTrainedModel:
    """The model the server sent: ``arrays`` itself, or (``model-delivery`` =
    ``delta-from-base``) the node's base with the weights that differ in place — ``arrays``,
    or (a simulated node, ``model-file``) the safetensors file the server wrote them to —
    checked against ``base-sha256`` and ``model-sha256`` (MPU copy ``copy``:
    ``model-sha256-<copy>`` and ``model-file-<copy>``); a mismatch raises a ``ValueError``
    naming the node and its base folder or the file."""
    if str(config.get(DELIVERY_KEY, FULL)) != DELTA:
        return rebuild_model(config, arrays)
    node = context.node_id
    path = declared_base(context, _offer(config))
    if path is None:
        raise ValueError(
            f"node {node}: the server sent only the weights that differ from a base "
            f"checkpoint, but this node declares no {BASE_KEY}"
        )
    base, server_base = load_base(path), str(config[BASE_SHA_KEY])
    if base.sha256 != server_base:
        raise ValueError(
            f"node {node}: base checkpoint {path} has sha256 {base.sha256}, the server's "
            f"base is {server_base} (the folder changed since the node query?)"
        )
    dtype = resolve_dtype(str(config.get("dtype", "float32")))
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    state, digests = model.state_dict(), dict(base.digests)
    named = config.get(model_file_key(copy))
    file = Path(str(named)) if named else None
    received = _file_weights(context, file) if file else _record_weights(arrays)
    source = f"file {file}" if file else "the message"
    count = 0
    for key, values in received:
        if key not in state or tuple(values.shape) != tuple(state[key].shape):
            raise ValueError(
                f"node {node}: received weight {key!r} {tuple(values.shape)} ({source}) is "
                f"not a weight of base checkpoint {path}"
            )
        digests[key] = weight_digest(values)
        with torch.no_grad():
            state[key].copy_(values)
        count += 1
    server_model = str(config[model_sha_key(copy)])
    if state_sha256(digests) != server_model:
        raise ValueError(
            f"node {node}: the model rebuilt from base checkpoint {path} and {count} "
            f"received weights ({source}) has sha256 {state_sha256(digests)}, the server's "
            f"is {server_model}"
        )
    return finish_model(model)


def _record_weights(arrays: ArrayRecord) -> Iterator[tuple[str, torch.Tensor]]:
    for key in arrays:
        yield key, array_tensor(arrays[key])


def _file_weights(context: Context, path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights of a file the server wrote, one tensor at a time; only a simulated node
    (on the server's machine) reads a file the server names."""
    if not simulated_node(context):
        raise ValueError(
            f"node {context.node_id}: the server named a file ({path}) to read the model "
            "from, which only a simulated node on the server's machine accepts"
        )
    try:
        handle = safe_open(str(path), framework="pt")
    except Exception as err:  # noqa: BLE001 — named with the node and the file
        raise ValueError(
            f"node {context.node_id}: cannot read the model file {path}: "
            f"{type(err).__name__}: {err}"
        ) from err
    for key in handle.keys():  # noqa: SIM118 — safe_open handles are not mappings
        yield key, handle.get_tensor(key)


def _offer(config: ConfigRecord) -> str | None:
    offer = config.get(BASE_OFFER_KEY)
    return str(offer) if offer else None
