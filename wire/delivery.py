"""What travels between server and node when a node holds the base checkpoint θ_base.

The record keys of that exchange and the hash both sides compute over a state: a sha256 per
tensor over its dtype, shape and bytes (:func:`tensor_digest`), then one sha256 over
``key<TAB>digest`` lines in sorted key order (:func:`state_sha256`), so either side rehashes
only the tensors that changed. How a node declares and loads its base is
:mod:`clients.base_checkpoint`; what the server sends is :mod:`strategies.model_delivery`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import ArrayRecord

from wire.arrays import array_tensor

BASE_KEY = "base-checkpoint"  # node config: the node's θ_base folder
#: the same for every simulated node of a run (a node's own node config wins)
RUN_BASE_KEY = "model.base-checkpoint"
BASE_SHA_KEY = "base-sha256"  # query reply and TRAIN config: state_sha256(θ_base)
BASE_PROBLEM_KEY = "base-problem"  # query reply: why the declared base cannot be used
#: query and TRAIN config: the folder the server loaded its model from, a simulated node's
#: base when it declares none (``clients.base_checkpoint``)
BASE_OFFER_KEY = "base-offer"
MODEL_SHA_KEY = "model-sha256"  # TRAIN config: state_sha256(θ_round)
DELIVERY_KEY = "model-delivery"  # TRAIN config: FULL (absent) or DELTA
FULL, DELTA = "full", "delta-from-base"
#: query reply: the node is a virtual node of a simulation, on the server's machine, so it
#: can read files the server writes (MPU's copies travel that way, ``strategies.copy_files``)
SHARED_MACHINE_KEY = "shared-machine"
MODEL_FILE_KEY = "model-file"  # TRAIN config: the file holding the weights sent by reference


def model_sha_key(copy: int | None = None) -> str:
    """The TRAIN config key of the hash of the model a node rebuilds: ``model-sha256``, or for
    MPU's copy ``copy`` ``model-sha256-<copy>``."""
    return MODEL_SHA_KEY if copy is None else f"{MODEL_SHA_KEY}-{copy}"


def model_file_key(copy: int | None = None) -> str:
    """The TRAIN config key naming the safetensors file that holds, instead of the message,
    the weights differing from θ_base: ``model-file``, or for MPU's copy ``copy``
    ``model-file-<copy>``."""
    return MODEL_FILE_KEY if copy is None else f"{MODEL_FILE_KEY}-{copy}"


def tensor_digest(values: np.ndarray) -> str:
    """sha256 of one tensor: its dtype, its shape and its bytes (C order)."""
    values = np.ascontiguousarray(values)
    digest = hashlib.sha256(f"{values.dtype.str}{values.shape}|".encode())
    digest.update(values.reshape(-1).view(np.uint8).data)
    return digest.hexdigest()


def weight_digest(tensor: torch.Tensor) -> str:
    """:func:`tensor_digest` of a model weight as float32 (exact for float16 and bfloat16), so
    that a weight has one digest whatever dtype it travels or is stored in."""
    return tensor_digest(tensor.detach().to("cpu", torch.float32).numpy())


def model_digests(model: torch.nn.Module) -> dict[str, str]:
    """:func:`weight_digest` of every key of ``model``'s state: what :func:`record_digests`
    gives for the arrays the rounds start from, taken from the model itself."""
    return {key: weight_digest(value) for key, value in model.state_dict().items()}


def state_sha256(digests: Mapping[str, str]) -> str:
    """sha256 of a whole state from its :func:`tensor_digest` per key (sorted key order)."""
    lines = "".join(f"{key}\t{digests[key]}\n" for key in sorted(digests))
    return hashlib.sha256(lines.encode()).hexdigest()


def record_digests(record: ArrayRecord, keys: list[str] | None = None) -> dict[str, str]:
    """:func:`weight_digest` of ``keys`` (default: all) of an ArrayRecord of weights, decoded
    one at a time."""
    return {key: weight_digest(array_tensor(record[key])) for key in (keys or list(record))}
