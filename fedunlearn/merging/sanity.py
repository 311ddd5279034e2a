"""Sanity bounds that keep one client from poisoning the model (issue 13). No Flower import.

Three checks, each leaving an honest round untouched (they only exclude or refuse, never
rescale, so a round that passes merges bit for bit as without them):

* :data:`MAX_ABS_VALUE` — no task-vector, Fisher or weight entry a client sends may exceed it
  in magnitude. Honest entries are many orders of magnitude below; the bound keeps every value
  castable to float32 and every sum of squares over a model (up to 1e14 entries) finite, so a
  float64 1e300 or a float32 3e38 upload cannot overflow a merge.
* :func:`norm_outliers` — a client whose task-vector norm is above ``ratio ×`` the median norm
  of its role's clients is excluded (``server.client-norm-ratio``). The median needs an honest
  majority: a role with fewer than :data:`MIN_CLIENTS_FOR_MEDIAN` valid clients, or whose
  median norm is 0, is not checked (the magnitude bound and the merged-update check still are).
* :func:`nonfinite_problem` / :func:`ratio_problem` — the merged update must be finite and its
  norm at most ``max_ratio ×`` the norm of the weights it changes (``server.max-update-ratio``;
  0 turns the ratio off, never the finiteness check); the new weights must be finite. The
  server applies them weight by weight as a merge produces Δ (``strategies.new_weights``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence

import torch

from .base import ClientUpdate

#: Largest magnitude an uploaded entry (task vector, Fisher, weights) may have.
MAX_ABS_VALUE = 1e12

#: Fewest valid clients of a role for which the median norm is trusted.
MIN_CLIENTS_FOR_MEDIAN = 3

#: ``server.client-norm-ratio`` default: a task vector 100× its role's median norm is no honest one.
DEFAULT_CLIENT_NORM_RATIO = 100.0

#: ``server.max-update-ratio`` default: an update 100× the norm of the weights it changes replaces
#: them by noise. Honest rounds measured (``merge.update_ratio`` in results.json): LoRA, 3
#: steps, FIRM under MPU: 0.1; full fine-tuning of a tiny random model, 3 steps, ``sum`` of 2
#: forget clients: 1.8 — longer full fine-tuning can go well past 10, hence the margin.
DEFAULT_MAX_UPDATE_RATIO = 100.0


def tensors_norm(tensors: Iterable[torch.Tensor]) -> float:
    """Global L2 norm over ``tensors``, accumulated in float64 (inf when it overflows)."""
    total = 0.0
    for t in tensors:
        total += float(torch.linalg.vector_norm(t.detach().to(torch.float64))) ** 2
    return math.sqrt(total)


def nonfinite_problem(tensors: Mapping[str, torch.Tensor], what: str) -> str | None:
    """``None`` when every tensor is finite, else which tensor of ``what`` holds how many
    non-finite values."""
    for name, t in tensors.items():
        finite = torch.isfinite(t)
        if not bool(finite.all()):
            bad = int(finite.numel() - finite.sum())
            return f"{what} tensor {name!r} holds {bad} non-finite value(s) (NaN or inf)"
    return None


def check_ratio(name: str, value: float) -> float:
    """A ratio option: 0 (off) or a finite number >= 1."""
    value = float(value)
    if not (value == 0.0 or (math.isfinite(value) and value >= 1.0)):
        raise ValueError(f"{name} must be 0 (off) or a finite number >= 1, got {value}")
    return value


def norm_outliers(
    updates: Sequence[ClientUpdate], ratio: float
) -> tuple[dict[int | str, str], dict[int | str, float]]:
    """Clients whose task-vector norm exceeds ``ratio ×`` the median norm of their role.

    Args:
        updates: the round's valid updates.
        ratio: ``server.client-norm-ratio`` (0 = off, else >= 1).

    Returns:
        ``({node_id: problem}, {node_id: norm})`` — the problem of every outlier (empty when
        none) and every client's norm (empty when the check is off). Roles with fewer than
        :data:`MIN_CLIENTS_FOR_MEDIAN` clients, or a median norm of 0, are not checked.
    """
    ratio = check_ratio("server.client-norm-ratio", ratio)
    if ratio == 0.0:
        return {}, {}
    norms = {u.node_id: tensors_norm(u.task_vector.values()) for u in updates}
    problems: dict[int | str, str] = {}
    for role in sorted({u.role for u in updates}):
        members = [u.node_id for u in updates if u.role == role]
        if len(members) < MIN_CLIENTS_FOR_MEDIAN:
            continue
        median = statistics.median(norms[n] for n in members)
        if median <= 0.0:
            continue
        for node in members:
            if norms[node] > ratio * median:
                problems[node] = (
                    f"task-vector norm {norms[node]:.4g} is more than server.client-norm-ratio "
                    f"({ratio:g}) × the median norm {median:.4g} of the {len(members)} {role} "
                    "clients"
                )
    return problems, norms


def ratio_problem(
    update_norm: float, weights_norm: float, max_ratio: float
) -> tuple[str | None, float]:
    """Whether a finite merged update Δ may be applied, from its norm ‖Δ‖ and the norm ‖θ‖ of
    the weights it changes: ``(problem or None, ‖Δ‖ / ‖θ‖)``. An overflowing ‖Δ‖ is a problem;
    the ratio is not checked when ``max_ratio`` is 0 or ‖θ‖ is 0 (nothing to compare with)."""
    ratio = update_norm / weights_norm if weights_norm > 0.0 else 0.0
    if not math.isfinite(update_norm):
        return f"the merged update's norm overflows ({update_norm})", ratio
    if max_ratio > 0.0 and ratio > max_ratio:
        return (
            f"the merged update's norm {update_norm:.4g} is {ratio:.4g}× the norm "
            f"{weights_norm:.4g} of the weights it changes, above server.max-update-ratio "
            f"({max_ratio:g})",
            ratio,
        )
    return None, ratio
