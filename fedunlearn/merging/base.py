"""Data types shared by every server-side merge, and the merge registry.

A merge takes the summaries sent back by the clients (:class:`ClientUpdate`;
docs/algorithms.md, "What a client uploads") and returns one dense update per adapted weight
(:class:`MergeResult`; docs/algorithms.md, "What the server does").  Merges register
themselves by name with :func:`register_merge`; a new merge lives in its own module and only
needs an import line in ``fedunlearn/merging/__init__.py`` to become available through
:func:`get_merge`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fedunlearn.registry import Registry

ROLES: tuple[str, ...] = ("forget", "retain")


TensorMeta = tuple[tuple[int, ...], torch.dtype, torch.device]


def described(values: Mapping[str, torch.Tensor], key: str) -> TensorMeta:
    """Shape, dtype and device of ``values[key]``; a mapping that tells them without producing
    the tensor (a ``describe(key)`` method, as ``fedunlearn.upload_codec.DecodedTensors`` has)
    is asked instead of decoding it."""
    describe = getattr(values, "describe", None)
    if callable(describe):
        return describe(key)
    t = values[key]
    return tuple(t.shape), t.dtype, t.device


def _describe(meta: TensorMeta) -> str:
    return f"shape {meta[0]}, dtype {meta[1]}"


def _check_tensor(node_id: int | str, kind: str, key: str, t: Any, *, nonneg: bool) -> None:
    """Raise ``ValueError`` naming the client and tensor if ``t`` is not a finite float tensor."""
    where = f"client {node_id!r}: {kind} tensor {key!r}"
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where} is a {type(t).__name__}, expected a torch.Tensor")
    if not t.is_floating_point():
        raise TypeError(f"{where} has non-floating dtype {t.dtype}")
    if not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(f"{where} contains {bad} non-finite value(s) (NaN or inf)")
    if nonneg and bool((t < 0).any()):
        bad = int((t < 0).sum())
        raise ValueError(
            f"{where} contains {bad} negative value(s); a Fisher diagonal must be >= 0"
        )


@dataclass
class ClientUpdate:
    """The one summary a client sends back after local training (docs/algorithms.md, "What a
    client uploads").

    Attributes:
        node_id: identifier of the client (unique within one merge).
        role: ``"forget"`` or ``"retain"``.
        domain: forget domain ``g`` (e.g. ``"bio"``); FIRM pools forget clients by it.
            Retain clients may leave it ``None``.
        num_examples: number of local training examples.
        task_vector: ``{param_name: Δθ}``, the dense adapter update ``s·B@A`` per weight: a
            dict, or any read-only mapping that yields the dense tensors (e.g.
            ``fedunlearn.upload_codec.DecodedTensors``, decoding compact or on-disk uploads
            one weight at a time).
        fisher: ``{param_name: F̂}``, the raw empirical Fisher diagonal (same keys and shapes as
            ``task_vector``), or ``None`` if the client did not compute it.

    Construction validates the role, the tensors (floating point, finite, Fisher >= 0) and that
    ``fisher`` matches ``task_vector`` key by key and shape by shape; every error message names
    the client, the tensor and the problem.
    """

    node_id: int | str
    role: str
    domain: str | None
    num_examples: int
    task_vector: Mapping[str, torch.Tensor]
    fisher: Mapping[str, torch.Tensor] | None = field(default=None)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check this update on its own (see the class docstring); raise on the first problem."""
        nid = self.node_id
        if self.role not in ROLES:
            raise ValueError(f"client {nid!r}: role must be one of {ROLES}, got {self.role!r}")
        if self.domain is not None and not isinstance(self.domain, str):
            raise TypeError(
                f"client {nid!r}: domain must be a str or None, got {type(self.domain).__name__}"
            )
        if isinstance(self.num_examples, bool) or not isinstance(self.num_examples, int):
            raise TypeError(f"client {nid!r}: num_examples must be an int")
        if self.num_examples < 0:
            raise ValueError(f"client {nid!r}: num_examples must be >= 0, got {self.num_examples}")
        if not isinstance(self.task_vector, Mapping) or not self.task_vector:
            raise ValueError(f"client {nid!r}: task_vector must be a non-empty mapping of tensors")
        for key, tv in self.task_vector.items():
            _check_tensor(nid, "task-vector", key, tv, nonneg=False)
        if self.fisher is None:
            return
        if not isinstance(self.fisher, Mapping):
            raise TypeError(f"client {nid!r}: fisher must be a mapping of tensors or None")
        missing = [k for k in self.task_vector if k not in self.fisher]
        extra = [k for k in self.fisher if k not in self.task_vector]
        if missing:
            raise ValueError(f"client {nid!r}: fisher is missing tensor(s) {missing}")
        if extra:
            raise ValueError(f"client {nid!r}: fisher has tensor(s) {extra} with no task vector")
        for key, fi in self.fisher.items():
            _check_tensor(nid, "Fisher", key, fi, nonneg=True)
            tv_shape = described(self.task_vector, key)[0]
            if tuple(fi.shape) != tv_shape:
                raise ValueError(
                    f"client {nid!r}: Fisher tensor {key!r} has shape {tuple(fi.shape)} "
                    f"but its task vector has shape {tv_shape}"
                )


@dataclass
class MergeResult:
    """Output of a merge: the dense update per weight (θ ← θ₀ + Δ) and a JSON-able report.

    ``delta`` is the mapping the merge wrote Δ into: a dict, or the caller's ``delta_out``
    (see :func:`delta_mapping`), which may keep nothing it was given.
    """

    delta: Mapping[str, torch.Tensor]
    report: dict


def delta_mapping(
    delta_out: MutableMapping[str, torch.Tensor] | None,
) -> MutableMapping[str, torch.Tensor]:
    """Where a merge writes Δ: its caller's ``delta_out``, else a new dict.

    Every built-in merge takes ``delta_out`` and writes each weight's Δ into it as soon as
    that weight is done (``delta_out[key] = Δ_key``) and never reads it back, so a caller
    can apply each Δ and let go of it before the next weight is merged (the server does:
    only one weight's Δ is alive at a time). Without it the merge returns Δ whole in a dict.
    """
    return {} if delta_out is None else delta_out


def validate_updates(updates: Sequence[ClientUpdate]) -> list[str]:
    """Check that all updates carry the same tensor keys with the same shapes.

    Also checks that node ids are unique (as strings, since reports key by ``str(node_id)``).
    Returns the keys in the order of the first update.  Errors name the client and the tensor.
    """
    if len(updates) == 0:
        raise ValueError("no client updates to merge")
    for u in updates:
        if not isinstance(u, ClientUpdate):
            raise TypeError(f"expected ClientUpdate objects, got {type(u).__name__}")
    seen: dict[str, int | str] = {}
    for u in updates:
        sid = str(u.node_id)
        if sid in seen:
            raise ValueError(
                f"duplicate node_id: clients {seen[sid]!r} and {u.node_id!r} share the id {sid!r}"
            )
        seen[sid] = u.node_id
    ref = updates[0]
    keys = list(ref.task_vector)
    for u in updates[1:]:
        missing = [k for k in keys if k not in u.task_vector]
        extra = [k for k in u.task_vector if k not in ref.task_vector]
        if missing:
            raise ValueError(
                f"client {u.node_id!r} is missing tensor(s) {missing} "
                f"that client {ref.node_id!r} sent"
            )
        if extra:
            raise ValueError(
                f"client {u.node_id!r} sent tensor(s) {extra} "
                f"that client {ref.node_id!r} did not send"
            )
        for k in keys:
            a, b = described(ref.task_vector, k), described(u.task_vector, k)
            if a[0] != b[0]:
                raise ValueError(
                    f"client {u.node_id!r}: tensor {k!r} has {_describe(b)} "
                    f"but client {ref.node_id!r} has {_describe(a)}"
                )
    return keys


MergeFn = Callable[..., MergeResult]

#: Registry of merge functions by name (filled by :func:`register_merge`).
MERGES: Registry[MergeFn] = Registry("merge")


def register_merge(name: str) -> Callable[[MergeFn], MergeFn]:
    """Decorator registering a merge function under ``name``; a duplicate name is an error."""
    return MERGES.register(name)


def get_merge(name: str) -> MergeFn:
    """Return the merge function registered as ``name`` (``KeyError`` lists available names)."""
    return MERGES[name]


def apply_delta(
    state: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """New weights θ = θ₀ + Δ (summed in float32, stored in each weight's dtype).

    ``state`` is a model state dict; every key of ``delta`` must be one of its keys.
    """
    out = dict(state)
    for key, value in delta.items():
        if key not in out:
            raise KeyError(f"merge produced a delta for {key!r}, which the model does not have")
        out[key] = (out[key].float() + value.float()).to(out[key].dtype)
    return out
