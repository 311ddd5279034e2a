"""Robust pre-merge options against manipulated uploads (issue 7; FIRM's open problems).

A single malicious client can dominate a merge by scaling what it uploads: ×1000 on its task
vector moves every merge that averages or sums task vectors (FIRM's intra-domain mean, TIES'
sign election and disjoint mean inside FULM), and ×1e6 on its Fisher diagonal takes over
FIRM's pooled Fisher and with it the support and the weights of the Fisher-normalised merge.
Both options here rescale the offending client relative to its peers and leave every client
inside the bound untouched (the very same ``ClientUpdate`` object, so an honest run merges
bit for bit as without them):

* :func:`bound_task_vector_norms`: clip each client's task vector (global L2 norm over all its
  tensors) to ``bound × median`` norm of the clients of its role;
* :func:`cap_fisher_mass`: per tensor, rescale a client's Fisher diagonal whose mass (sum of
  entries) exceeds ``cap × median`` mass of its role's clients for that tensor down to that
  mass (its shape, hence its top-α support, is kept; only its weight against its peers is
  bounded).

The median needs an honest majority among a role's clients: with two clients of a role the
median is the mean of an honest and a malicious norm. No Flower import.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .base import ClientUpdate
from .sanity import check_ratio


def update_norm(update: ClientUpdate) -> float:
    """Global L2 norm of ``update.task_vector`` over all its tensors (float64)."""
    total = 0.0
    for t in update.task_vector.values():
        total += float(torch.linalg.vector_norm(t.to(torch.float64))) ** 2
    return math.sqrt(total)


def _scaled(tensors: Mapping[str, torch.Tensor], factor: float) -> dict[str, torch.Tensor]:
    return {k: (v.to(torch.float64) * factor).to(v.dtype) for k, v in tensors.items()}


def bound_task_vector_norms(
    updates: Sequence[ClientUpdate], bound: float
) -> tuple[list[ClientUpdate], dict[str, dict[str, float]]]:
    """Clip every client's task vector to ``bound ×`` the median norm of its role's clients.

    Args:
        updates: the round's valid client updates.
        bound: multiple of the median norm (``server.robust-norm-bound``); 0 turns the option off,
            otherwise at least 1 (a bound below 1 would shrink the median client itself).

    Returns:
        The updates in the same order (clients within the bound, or whose role's median norm
        is 0, are the same objects; clipped ones are copies with the task vector scaled by
        ``limit / norm``, Fisher unchanged) and a report ``{str(node_id): {"norm", "median",
        "norm_scale"}}`` for every client (``norm_scale`` = 1.0 when untouched).
    """
    bound = check_ratio("server.robust-norm-bound", bound)
    if bound == 0.0:
        return list(updates), {}
    norms = [update_norm(u) for u in updates]
    medians = {
        role: statistics.median(n for n, u in zip(norms, updates, strict=True) if u.role == role)
        for role in {u.role for u in updates}
    }
    out: list[ClientUpdate] = []
    report: dict[str, dict[str, float]] = {}
    for u, norm in zip(updates, norms, strict=True):
        median = medians[u.role]
        limit = bound * median
        scale = 1.0
        if median > 0.0 and norm > limit:
            scale = limit / norm
            u = dataclasses.replace(u, task_vector=_scaled(u.task_vector, scale))
        out.append(u)
        report[str(u.node_id)] = {"norm": norm, "median": median, "norm_scale": scale}
    return out, report


def _fisher_mass(fisher: torch.Tensor) -> float:
    return float(fisher.to(torch.float64).sum())


def cap_fisher_mass(
    updates: Sequence[ClientUpdate], cap: float
) -> tuple[list[ClientUpdate], dict[str, dict[str, Any]]]:
    """Per tensor, bound each client's Fisher mass to ``cap ×`` the median of its role's clients.

    For every tensor key and role, ``M`` = median over the role's clients (those that sent a
    Fisher) of ``sum(F_i[key])``; a client with ``sum(F_i[key]) > cap·M`` gets
    ``F_i[key] · cap·M / sum(F_i[key])`` (shape kept, mass bounded).

    Args:
        updates: the round's valid client updates (clients without Fisher pass unchanged).
        cap: multiple of the median mass (``server.fisher-cap``); 0 turns the option off, otherwise
            at least 1.

    Returns:
        The updates in the same order (clients with no rescaled tensor are the same objects)
        and a report ``{str(node_id): {"fisher_scaled_tensors": int, "fisher_min_scale":
        float}}`` for every client with a Fisher.
    """
    cap = check_ratio("server.fisher-cap", cap)
    if cap == 0.0:
        return list(updates), {}
    with_fisher = [u for u in updates if u.fisher is not None]
    masses = {
        id(u): {k: _fisher_mass(f) for k, f in u.fisher.items()}  # type: ignore[union-attr]
        for u in with_fisher
    }
    medians: dict[tuple[str, str], float] = {}
    for role in {u.role for u in with_fisher}:
        members = [u for u in with_fisher if u.role == role]
        for key in members[0].fisher:  # type: ignore[union-attr]
            medians[(role, key)] = statistics.median(
                masses[id(u)][key] for u in members if key in masses[id(u)]
            )
    out: list[ClientUpdate] = []
    report: dict[str, dict[str, Any]] = {}
    for u in updates:
        if u.fisher is None:
            out.append(u)
            continue
        scales: dict[str, float] = {}
        for key, mass in masses[id(u)].items():
            median = medians.get((u.role, key), 0.0)
            if median > 0.0 and mass > cap * median:
                scales[key] = cap * median / mass
        if scales:
            fisher = {
                k: (v.to(torch.float64) * scales[k]).to(v.dtype) if k in scales else v
                for k, v in u.fisher.items()
            }
            u = dataclasses.replace(u, fisher=fisher)
        out.append(u)
        report[str(u.node_id)] = {
            "fisher_scaled_tensors": len(scales),
            "fisher_min_scale": min(scales.values(), default=1.0),
        }
    return out, report


def apply_robust(
    updates: Sequence[ClientUpdate], *, norm_bound: float = 0.0, fisher_cap: float = 0.0
) -> tuple[list[ClientUpdate], dict[str, dict[str, Any]]]:
    """:func:`bound_task_vector_norms` then :func:`cap_fisher_mass` (each 0 = off).

    Returns the updates to merge and one report entry per client (``str(node_id)``) merging
    both options' entries; with both options off, the input list's objects and ``{}``.
    """
    out, norm_report = bound_task_vector_norms(updates, norm_bound)
    out, fisher_report = cap_fisher_mass(out, fisher_cap)
    report: dict[str, dict[str, Any]] = {}
    for nid in {*norm_report, *fisher_report}:
        report[nid] = {**norm_report.get(nid, {}), **fisher_report.get(nid, {})}
    return out, report
