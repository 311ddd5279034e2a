"""Tests for the FIRM retention projection of one tensor (docs/algorithms.md, "FIRM
retention-constrained projection")."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from fedunlearn.merging import fisher_damage, normalize_and_sparsify, project_retention
from fedunlearn.merging.projection import cast_toward_zero


def _instance(
    seed: int, d: int, m: int, alpha: float = 0.5
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(d, generator=g, dtype=torch.float64)
    fishers = [
        normalize_and_sparsify(torch.rand(d, generator=g) ** 2, alpha, 1e-8).double()
        for _ in range(m)
    ]
    return base, fishers


def _eps_for(base: torch.Tensor, fishers: list[torch.Tensor], frac: float) -> float:
    """A budget that the base point violates (a fraction of its smallest damage)."""
    return frac * min(fisher_damage(base, f) for f in fishers)


def test_fisher_damage_matches_definition() -> None:
    delta = torch.tensor([1.0, -2.0, 3.0])
    f = torch.tensor([0.5, 0.0, 2.0])
    assert fisher_damage(delta, f) == pytest.approx(0.5 * 1 + 0 + 2.0 * 9)


@pytest.mark.parametrize("seed", range(5))
def test_single_constraint_feasible_shrinks_and_is_tight(seed: int) -> None:
    base, fishers = _instance(seed, 200, 1)
    eps = _eps_for(base, fishers, 0.3)
    out, rep = project_retention(base, fishers, eps)
    tau = max(1e-4 * eps, 1e-12)
    b = fisher_damage(out, fishers[0])
    assert b <= eps * (1 + 1e-9)
    assert b >= eps - tau  # active constraint is met up to the tolerance
    assert rep["damage_after"] == [pytest.approx(b)]
    assert rep["active"] and rep["multipliers"][0] > 0 and rep["max_violation"] == 0.0
    assert torch.all(out.abs() <= base.abs())
    lam = rep["multipliers"][0]
    assert torch.allclose(out, base / (1 + 2 * lam * fishers[0]))


@pytest.mark.parametrize("m", [2, 3])
@pytest.mark.parametrize("seed", range(4))
def test_increase_only_feasible_for_several_constraints(m: int, seed: int) -> None:
    base, fishers = _instance(seed, 300, m)
    eps = _eps_for(base, fishers, 0.2)
    out, rep = project_retention(base, fishers, eps, solver="increase-only")
    for f in fishers:
        assert fisher_damage(out, f) <= eps * (1 + 1e-4)
    assert rep["max_violation"] <= 1e-4 * eps
    assert len(rep["multipliers"]) == m and all(x >= 0 for x in rep["multipliers"])
    assert torch.all(out.abs() <= base.abs())
    assert rep["damage_before"] == [pytest.approx(fisher_damage(base, f)) for f in fishers]


def _slsqp(base: np.ndarray, fisher: np.ndarray, eps: float) -> np.ndarray:
    cons = {
        "type": "ineq",
        "fun": lambda x: eps - float(np.sum(fisher * x * x)),
        "jac": lambda x: -2.0 * fisher * x,
    }
    res = minimize(
        lambda x: 0.5 * float(np.sum((x - base) ** 2)),
        x0=np.zeros_like(base),
        jac=lambda x: x - base,
        constraints=[cons],
        method="SLSQP",
        options={"ftol": 1e-14, "maxiter": 1000},
    )
    assert res.success, res.message
    return res.x


@pytest.mark.parametrize("seed", range(4))
def test_single_constraint_matches_slsqp(seed: int) -> None:
    d = 10 + 6 * seed
    base, fishers = _instance(100 + seed, d, 1, alpha=0.6)
    eps = _eps_for(base, fishers, 0.25)
    out, _ = project_retention(base, fishers, eps)
    ref = _slsqp(base.numpy(), fishers[0].numpy(), eps)
    rel = np.linalg.norm(out.numpy() - ref) / np.linalg.norm(ref)
    assert rel <= 1e-3


def test_inactive_projection_returns_base_unchanged() -> None:
    base, fishers = _instance(7, 50, 2)
    eps = 10.0 * max(fisher_damage(base, f) for f in fishers)
    out, rep = project_retention(base, fishers, eps)
    assert torch.equal(out, base)
    assert rep["multipliers"] == [0.0, 0.0]
    assert not rep["active"] and rep["iterations"] == 0


def test_infinite_epsilon_and_no_retain_clients_skip_projection() -> None:
    base, fishers = _instance(8, 40, 1)
    out, rep = project_retention(base, fishers, math.inf)
    assert torch.equal(out, base) and rep["multipliers"] == [0.0]
    out, rep = project_retention(base, [], 1e-6)
    assert torch.equal(out, base) and rep["multipliers"] == [] and not rep["active"]


def test_coordinates_outside_retain_support_are_untouched() -> None:
    base = torch.tensor([3.0, -4.0, 5.0, 6.0])
    f = torch.tensor([0.0, 1.0, 0.0, 0.5])
    out, _ = project_retention(base, [f], 1.0)
    assert out[0] == 3.0 and out[2] == 5.0
    assert fisher_damage(out, f) <= 1.0


def test_bf16_output_is_feasible_after_cast() -> None:
    base, fishers = _instance(9, 500, 2)
    eps = _eps_for(base, fishers, 0.1)
    out, rep = project_retention(
        base.float(), [f.float() for f in fishers], eps, out_dtype=torch.bfloat16
    )
    assert out.dtype == torch.bfloat16
    for f, reported in zip(fishers, rep["damage_after"], strict=True):
        b = fisher_damage(out, f)
        assert reported == pytest.approx(b, rel=1e-12)
        assert b <= eps


def test_cast_toward_zero_never_grows_magnitude() -> None:
    x = torch.randn(1000, dtype=torch.float64) * 10
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        y = cast_toward_zero(x, dtype)
        assert y.dtype == dtype
        assert torch.all(y.double().abs() <= x.abs())


def test_bad_arguments() -> None:
    base, fishers = _instance(10, 20, 1)
    with pytest.raises(ValueError, match="unknown projection solver 'nope'.*exact.*increase-only"):
        project_retention(base, fishers, 1.0, solver="nope")
    with pytest.raises(ValueError, match="epsilon"):
        project_retention(base, fishers, 0.0)
    with pytest.raises(ValueError, match="shape"):
        project_retention(base, [torch.ones(3, dtype=torch.float64)], 1.0)
    with pytest.raises(ValueError, match="non-negative"):
        project_retention(base, [-fishers[0] - 1], 1.0)


def test_cast_toward_zero_bf16_matches_nextafter_rule() -> None:
    """The float32 -> bfloat16 bit-truncation path equals round-to-nearest + nextafter."""

    g = torch.Generator().manual_seed(3)
    bits = torch.randint(-(2**31), 2**31 - 1, (200_000,), generator=g, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    x = torch.cat([x[~torch.isnan(x)], torch.tensor([0.0, -0.0, math.inf, -math.inf, 1e-45])])
    y = x.to(torch.bfloat16)
    over = y.to(torch.float32).abs() > x.abs()
    ref = torch.where(over, torch.nextafter(y, torch.zeros_like(y)), y)
    got = cast_toward_zero(x, torch.bfloat16)
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))
    assert bool(torch.isnan(cast_toward_zero(torch.tensor([math.nan]), torch.bfloat16)).all())


@pytest.mark.parametrize("out_dtype", [None, torch.float64, torch.bfloat16])
def test_projection_never_writes_into_its_input(out_dtype) -> None:
    g = torch.Generator().manual_seed(5)
    base = torch.randn(30, 40, generator=g).t()  # non-contiguous
    fisher = torch.rand(40, 30, generator=g) * (torch.rand(40, 30, generator=g) < 0.2)
    keep = base.clone()
    out, rep = project_retention(base, [fisher], 1e-3, out_dtype=out_dtype)
    assert rep["active"]
    assert torch.equal(base, keep)
    assert not torch.equal(out.to(torch.float64), keep.to(torch.float64))
