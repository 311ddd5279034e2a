"""A node's base checkpoint: the server sends it only the weights that differ from it.

A node declares a local copy of the checkpoint the server starts from, θ_base (a Hugging Face
checkpoint folder), as ``base-checkpoint`` — in its node config (deployment:
``flower-supernode --node-config "... base-checkpoint='/models/base'"``) or, for every node
that declares none there, as ``model.base-checkpoint`` in the run config (simulation, where
all nodes share one machine).
It reports the sha256 of θ_base in its answer to the server's node query; where that matches
the server's initial weights, every TRAIN message carries only the weights of θ_round that
differ from θ_base (round 1: none) and the node rebuilds θ_round from its copy
(:func:`received_model`), checking the result against the hash the server sent.

The hash (:func:`state_sha256`) is over the weights as they travel in full (float32, every
key of the model's ``state_dict``): a sha256 per tensor over its dtype, shape and bytes, then
one sha256 over ``key<TAB>digest`` lines in sorted key order, so either side rehashes only
the tensors that changed. The node loads its base in float32 with ``from_pretrained``, so
its hash equals the server's when the server's model holds the file's values (a float32 run,
or a bfloat16 file); a bfloat16 server model of a float32 file does not match, and the node
gets the full model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from transformers import AutoModelForCausalLM, PreTrainedModel

from wire.delivery import (
    BASE_KEY,
    BASE_PROBLEM_KEY,
    BASE_SHA_KEY,
    DELIVERY_KEY,
    DELTA,
    FULL,
    MODEL_SHA_KEY,
    RUN_BASE_KEY,
    state_sha256,
    tensor_digest,
)
from wire.messages import model_from_state, rebuild_model

_STATE_KEY = "base-checkpoint-hash"  # context.state: the hash, computed once per node


@dataclass(frozen=True)
class BaseCheckpoint:
    """θ_base as the server would send it: float32 CPU tensors and their digests."""

    path: Path
    signature: str  # the folder's files (names, sizes, modification times)
    state: dict[str, torch.Tensor]
    digests: dict[str, str]

    @property
    def sha256(self) -> str:
        return state_sha256(self.digests)


_loaded: dict[str, BaseCheckpoint] = {}  # one base per process (the last one loaded)


def declared_base(context: Context) -> Path | None:
    """The node's ``base-checkpoint``: node config first, then run config; None when unset."""
    value = context.node_config.get(BASE_KEY) or context.run_config.get(RUN_BASE_KEY)
    return Path(str(value)).expanduser().resolve() if value else None


def folder_signature(path: Path) -> str:
    """What identifies a checkpoint folder's contents cheaply (file names, sizes, mtimes)."""
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint folder (no config.json)")
    files = sorted(p for p in path.iterdir() if p.is_file())
    return ";".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)


def load_base(path: Path) -> BaseCheckpoint:
    """θ_base from ``path`` in float32 (as ``wire_state`` sends it), kept for the process."""
    signature = folder_signature(path)
    cached = _loaded.get(str(path))
    if cached is not None and cached.signature == signature:
        return cached
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    state = {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}
    digests = {k: tensor_digest(v.numpy()) for k, v in state.items()}
    _loaded.clear()
    _loaded[str(path)] = BaseCheckpoint(path, signature, state, digests)
    return _loaded[str(path)]


def base_declaration(context: Context) -> dict[str, str]:
    """The query-reply fields about the node's base: ``base-sha256`` (cached in the node's
    ``context.state`` while the folder is unchanged), ``base-problem`` when the declared base
    cannot be read, nothing when the node declares none."""
    path = declared_base(context)
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


def received_model(config: ConfigRecord, arrays: ArrayRecord, context: Context) -> PreTrainedModel:
    """The model the server sent: ``arrays`` itself, or (``model-delivery`` =
    ``delta-from-base``) the node's base with ``arrays`` — the weights that differ — in
    place, checked against ``base-sha256`` and ``model-sha256``; a mismatch raises a
    ``ValueError`` naming the node and its base folder."""
    if str(config.get(DELIVERY_KEY, FULL)) != DELTA:
        return rebuild_model(config, arrays)
    return model_from_state(config, rebuilt_state(config, arrays, context))


def rebuilt_state(
    config: ConfigRecord, arrays: ArrayRecord, context: Context
) -> dict[str, torch.Tensor]:
    """θ_round = θ_base with the received weights in place, its hash checked."""
    node, path = context.node_id, declared_base(context)
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
    state, digests = dict(base.state), dict(base.digests)
    for key in arrays:
        values = arrays[key].numpy()
        if key not in state or tuple(values.shape) != tuple(state[key].shape):
            raise ValueError(
                f"node {node}: received weight {key!r} {tuple(values.shape)} is not a weight "
                f"of base checkpoint {path}"
            )
        digests[key] = tensor_digest(values)
        state[key] = torch.from_numpy(values)
    server_model = str(config[MODEL_SHA_KEY])
    if state_sha256(digests) != server_model:
        raise ValueError(
            f"node {node}: the model rebuilt from base checkpoint {path} and {len(arrays)} "
            f"received weights has sha256 {state_sha256(digests)}, the server's is "
            f"{server_model}"
        )
    return state
