"""Robust pre-merge options (``fedunlearn.merging.robust``): they bound one malicious forget
client's effect on FIRM and FULM and leave honest rounds exactly as they were."""

from __future__ import annotations

import dataclasses
import math
import statistics

import pytest
import torch

from fedunlearn.merging import ClientUpdate, firm_merge, fulm_merge
from fedunlearn.merging.robust import (
    apply_robust,
    bound_task_vector_norms,
    cap_fisher_mass,
    update_norm,
)

SHAPES = {"a": (16, 12), "b": (12, 16)}


def _updates(domains: tuple[str, ...] = ("x",) * 5) -> list[ClientUpdate]:
    """Forget clients sharing a direction (one per entry of ``domains``) + one retain client;
    norms within ±15 % and Fisher masses within 2× of each other."""
    shared = torch.Generator().manual_seed(0)
    common = {k: torch.randn(s, generator=shared) for k, s in SHAPES.items()}
    out = []
    for i, domain in enumerate((*domains, "retain")):
        gen = torch.Generator().manual_seed(100 + i)
        role = "retain" if domain == "retain" else "forget"
        tv = {
            k: 0.01 * (1 + 0.03 * i) * (0.8 * common[k] + 0.2 * torch.randn(s, generator=gen))
            for k, s in SHAPES.items()
        }
        fisher = {k: 1e-6 * (1 + 0.1 * i) * torch.rand(s, generator=gen) for k, s in SHAPES.items()}
        out.append(ClientUpdate(f"c{i}", role, domain, 4, tv, fisher))
    return out


def _scaled(u: ClientUpdate, *, tv: float = 1.0, fisher: float = 1.0) -> ClientUpdate:
    return dataclasses.replace(
        u,
        task_vector={k: tv * v for k, v in u.task_vector.items()},
        fisher={k: fisher * v for k, v in u.fisher.items()},
    )


def _dot(a: dict, b: dict) -> float:
    return sum(float((a[k].double() * b[k].double()).sum()) for k in a)


def _ratio_and_cosine(delta: dict, honest: dict) -> tuple[float, float]:
    dd, hh, dh = _dot(delta, delta), _dot(honest, honest), _dot(delta, honest)
    return math.sqrt(dd / hh), dh / math.sqrt(dd * hh)


MERGES = {
    "firm": lambda ups: firm_merge(ups, gamma=1.0, alpha=0.1),
    "fulm": lambda ups: fulm_merge(ups, gamma=1.0),
}


def test_off_returns_the_same_objects():
    updates = _updates()
    out, report = apply_robust(updates)
    assert report == {} and all(a is b for a, b in zip(out, updates, strict=True))
    with pytest.raises(ValueError, match="server.robust-norm-bound must be 0"):
        bound_task_vector_norms(updates, 0.5)
    with pytest.raises(ValueError, match="server.fisher-cap must be 0"):
        cap_fisher_mass(updates, math.nan)


@pytest.mark.parametrize("merge", sorted(MERGES))
def test_honest_round_is_bit_identical(merge):
    updates = _updates(("x", "x", "x", "y", "y", "y"))
    out, report = apply_robust(updates, norm_bound=1.5, fisher_cap=3.0)
    assert all(a is b for a, b in zip(out, updates, strict=True))
    assert all(r["norm_scale"] == 1.0 and r["fisher_scaled_tensors"] == 0 for r in report.values())
    plain, robust = MERGES[merge](updates).delta, MERGES[merge](out).delta
    assert all(torch.equal(plain[k], robust[k]) for k in plain)


def test_norm_bound_clips_to_the_bound_times_the_role_median():
    updates = _updates()
    updates[2] = _scaled(updates[2], tv=1000.0)
    median = sorted(update_norm(u) for u in updates if u.role == "forget")[2]
    out, report = bound_task_vector_norms(updates, 2.0)
    assert update_norm(out[2]) == pytest.approx(2.0 * median, rel=1e-6)
    assert report["c2"]["norm_scale"] < 0.01 and out[2].fisher is updates[2].fisher
    assert all(out[i] is updates[i] for i in (0, 1, 3, 4, 5))  # the retain median is its own


@pytest.mark.parametrize("merge", sorted(MERGES))
def test_scaled_task_vector_attack_is_bounded(merge):
    updates = _updates()
    honest = MERGES[merge](updates).delta
    attacked = list(updates)
    attacked[1] = _scaled(updates[1], tv=1000.0)
    ratio_off, _ = _ratio_and_cosine(MERGES[merge](attacked).delta, honest)
    robust, _ = apply_robust(attacked, norm_bound=2.0)
    ratio_on, cos_on = _ratio_and_cosine(MERGES[merge](robust).delta, honest)
    assert ratio_off > 100, ratio_off
    assert ratio_on < 1.5 and cos_on > 0.95, (ratio_on, cos_on)


def test_fisher_cap_bounds_a_scaled_fisher_and_its_effect_on_firm():
    updates = _updates(("x", "x", "x", "y", "y", "y"))
    honest = MERGES["firm"](updates).delta
    attacked = list(updates)
    attacked[0] = _scaled(updates[0], fisher=1e6)
    out, report = cap_fisher_mass(attacked, 2.0)
    assert report["c0"]["fisher_scaled_tensors"] == len(SHAPES)
    for key in SHAPES:  # the attacker's mass is now 2 × the forget clients' median mass
        median = statistics.median(float(u.fisher[key].double().sum()) for u in attacked[:6])
        assert float(out[0].fisher[key].double().sum()) == pytest.approx(2 * median, rel=1e-5)
    assert all(out[i] is attacked[i] for i in range(1, 7))
    _, cos_off = _ratio_and_cosine(MERGES["firm"](attacked).delta, honest)
    _, cos_on = _ratio_and_cosine(MERGES["firm"](out).delta, honest)
    assert cos_on > cos_off, (cos_off, cos_on)
