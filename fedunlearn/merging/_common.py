"""Small helpers shared by the baseline merges AVG, SUM, TIES and FULM (docs/algorithms.md,
"TIES, AVG and SUM", "FULM and FULM-mean")."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .base import ClientUpdate


def as_real(name: str, value: float) -> float:
    """``float(value)``; ``TypeError`` naming the parameter if it is not a real number."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a real number, got a bool")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}") from None


def check_gamma(gamma: float) -> float:
    """Return ``gamma`` as a float; raise ``ValueError`` unless it is a finite number."""
    g = as_real("gamma", gamma)
    if not math.isfinite(g):
        raise ValueError(f"gamma must be finite, got {gamma}")
    return g


def check_k(k: float) -> float:
    """Return the TIES support fraction ``k`` as a float; raise unless ``0 < k <= 1``."""
    kf = as_real("k", k)
    if not 0.0 < kf <= 1.0:  # also rejects NaN
        raise ValueError(f"k (TIES support fraction) must be in (0, 1], got {k}")
    return kf


def forget_clients(updates: Sequence[ClientUpdate], method: str) -> list[ClientUpdate]:
    """The forget clients in input order; ``ValueError`` naming the retain clients if none."""
    forget = [u for u in updates if u.role == "forget"]
    if not forget:
        raise ValueError(
            f"{method} needs at least one forget client; got only retain clients "
            f"{[u.node_id for u in updates]}"
        )
    return forget


def out_dtype(updates: Sequence[ClientUpdate], key: str) -> torch.dtype:
    """Task-vector dtype of tensor ``key``, promoted across clients if they differ."""
    dtype = updates[0].task_vector[key].dtype
    for u in updates[1:]:
        dtype = torch.promote_types(dtype, u.task_vector[key].dtype)
    return dtype


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype used for arithmetic: at least float32 (float64 inputs stay float64)."""
    return torch.promote_types(dtype, torch.float32)


def l2(t: torch.Tensor) -> float:
    """Euclidean norm of ``t`` (computed in float64) as a Python float."""
    return float(torch.linalg.vector_norm(t.to(torch.float64)))


def node_ids(updates: Sequence[ClientUpdate]) -> list[str]:
    """Node ids as strings (reports key clients by ``str(node_id)``)."""
    return [str(u.node_id) for u in updates]
