"""Tests for the exact FIRM-QP solver and its KKT certificate (docs/algorithms.md, "FIRM
retention-constrained projection")."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from fedunlearn.merging import (
    ClientUpdate,
    firm_merge,
    fisher_damage,
    kernels,
    normalize_and_sparsify,
    project_retention,
)

torch.set_num_threads(1)

CERT_KEYS = {
    "max_primal_violation",
    "max_complementary_slackness",
    "duality_gap",
    "sweeps",
    "iterations",
    "converged",
    "feasibility_pass",
    "max_violation",
    "active",
    "backend",
}


def _tau(eps: float) -> float:
    return max(1e-4 * eps, 1e-12)


def _instance(
    seed: int, d: int, m: int, alpha: float = 0.6
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(d, generator=g, dtype=torch.float64)
    fishers = [
        normalize_and_sparsify(torch.rand(d, generator=g) ** 2, alpha, 1e-8).double()
        for _ in range(m)
    ]
    return base, fishers


def _objective(x: torch.Tensor | np.ndarray, base: torch.Tensor) -> float:
    x = torch.as_tensor(x, dtype=torch.float64)
    return 0.5 * float(((x - base) ** 2).sum())


def _slsqp(base: torch.Tensor, fishers: list[torch.Tensor], eps: float) -> np.ndarray:
    """Reference: SLSQP on the primal with the m quadratic constraints."""
    b = base.numpy()
    cons = [
        {
            "type": "ineq",
            "fun": (lambda x, f=f: eps - float(np.sum(f * x * x))),
            "jac": (lambda x, f=f: -2.0 * f * x),
        }
        for f in (f.numpy() for f in fishers)
    ]
    res = minimize(
        lambda x: 0.5 * float(np.sum((x - b) ** 2)),
        x0=np.zeros_like(b),  # feasible start
        jac=lambda x: x - b,
        constraints=cons,
        method="SLSQP",
        options={"ftol": 1e-12, "maxiter": 2000},
    )
    assert res.success, res.message
    return res.x


def _check_certificate(rep: dict, base: torch.Tensor, eps: float, rel: float = 1e-6) -> None:
    scale = 0.5 * float((base**2).sum())
    assert CERT_KEYS <= set(rep)
    assert rep["converged"] is True
    assert rep["max_primal_violation"] <= _tau(eps)
    assert rep["max_complementary_slackness"] <= rel * scale
    assert abs(rep["duality_gap"]) <= rel * scale


# --------------------------------------------------------------- agreement with a generic solver
@pytest.mark.parametrize("m", [2, 3])
@pytest.mark.parametrize("seed", range(4))
def test_exact_matches_slsqp_and_is_certified(m: int, seed: int) -> None:
    d = 8 + 6 * seed  # 8 .. 26
    base, fishers = _instance(10 * m + seed, d, m)
    damages = [fisher_damage(base, f) for f in fishers]
    # Between the smallest and the largest damage for half the seeds: some constraints may be
    # satisfied at the base point, others not.
    eps = 0.3 * (min(damages) if seed % 2 == 0 else 0.5 * (min(damages) + max(damages)))
    out, rep = project_retention(base, fishers, eps)
    ref = _slsqp(base, fishers, eps)

    rel = np.linalg.norm(out.numpy() - ref) / np.linalg.norm(ref)
    assert rel <= 1e-3
    assert _objective(out, base) <= _objective(ref, base) * (1 + 1e-6)
    for f, reported in zip(fishers, rep["damage_after"], strict=True):
        b = fisher_damage(out, f)
        assert b <= eps * (1 + _tau(eps) / eps)
        assert reported == pytest.approx(b, rel=1e-12)
    assert rep["max_violation"] <= _tau(eps)
    assert torch.all(out.abs() <= base.abs())
    assert all(x >= 0 for x in rep["multipliers"]) and rep["active"]
    _check_certificate(rep, base, eps)
    # The closed form of the Lagrangian minimiser holds for the reported multipliers.
    lam = torch.tensor(rep["multipliers"], dtype=torch.float64)
    den = 1 + 2 * (lam @ torch.stack(fishers))
    assert torch.allclose(out, base / den, rtol=1e-12, atol=0)
    # Exact is never worse than the paper's routine (which is feasible, too).
    inc, inc_rep = project_retention(base, fishers, eps, solver="increase-only")
    assert inc_rep["max_violation"] <= _tau(eps)
    assert _objective(out, base) <= _objective(inc, base) * (1 + 1e-9)


# ---------------------------------------------------- where the paper's routine is not optimal
def test_increase_only_is_feasible_but_not_optimal_where_exact_is() -> None:
    """Two retain clients whose Fisher masks overlap on the middle coordinate.

    Δ_base = (1, 3, 1), F̃_1 = (1, 1, 0), F̃_2 = (0, 1, 1), epsilon = 1.  The increase-only
    routine first raises λ_1 alone until b_1 = 1, i.e. (1 + 2λ_1)² = 1 + 9 (λ_1 ≈ 1.081), which
    already shrinks the shared coordinate; then it raises λ_2 for b_2 = 1, which shrinks the
    shared coordinate further, so constraint 1 ends strictly slack (b_1 ≈ 0.72) with λ_1 > 0 and
    coordinate 1 over-shrunk.  By symmetry the optimum has λ_1 = λ_2 = λ* with
    1/(1 + 2λ*)² + 9/(1 + 4λ*)² = 1 (λ* ≈ 0.593) and both constraints tight; the increase-only
    objective is about 9 % larger.  The exact solver must LOWER λ_1 to get there.
    """
    base = torch.tensor([1.0, 3.0, 1.0], dtype=torch.float64)
    fishers = [
        torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64),
        torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64),
    ]
    eps = 1.0
    inc, inc_rep = project_retention(base, fishers, eps, solver="increase-only")
    out, rep = project_retention(base, fishers, eps, solver="exact")
    ref = _slsqp(base, fishers, eps)

    # The paper's routine: feasible, but neither optimal nor complementary.
    for f in fishers:
        assert fisher_damage(inc, f) <= eps
    assert inc_rep["max_primal_violation"] == 0.0
    assert inc_rep["multipliers"][0] == pytest.approx(0.5 * (math.sqrt(10.0) - 1), rel=1e-3)
    assert inc_rep["damage_after"][0] < 0.8 * eps  # slack constraint with λ_1 > 0
    assert inc_rep["max_complementary_slackness"] > 0.1
    assert inc_rep["duality_gap"] > 0.1
    assert _objective(inc, base) > 1.05 * _objective(ref, base)

    # The exact solver reaches the SLSQP optimum, lowering λ_1.
    assert np.linalg.norm(out.numpy() - ref) / np.linalg.norm(ref) <= 1e-3
    assert _objective(out, base) == pytest.approx(_objective(ref, base), rel=1e-6)
    assert rep["multipliers"][0] < inc_rep["multipliers"][0] - 0.4
    lam_star = rep["multipliers"][0]
    assert rep["multipliers"][1] == pytest.approx(lam_star, rel=1e-9)
    assert 1 / (1 + 2 * lam_star) ** 2 + 9 / (1 + 4 * lam_star) ** 2 == pytest.approx(1.0)
    assert rep["damage_after"] == [pytest.approx(eps, rel=1e-9)] * 2
    _check_certificate(rep, base, eps, rel=1e-9)


def test_nearly_proportional_fishers_converge_fast() -> None:
    """Strongly overlapping retain Fishers make plain coordinate ascent crawl; the Newton step
    on the dual must still certify the optimum in a few sweeps."""
    g = torch.Generator().manual_seed(3)
    d = 400
    base = torch.randn(d, generator=g, dtype=torch.float64)
    f0 = torch.rand(d, generator=g, dtype=torch.float64) ** 2
    for noise in (1e-2, 1e-5, 0.0):
        fishers = [
            f0 * (1 + noise * torch.rand(d, generator=g, dtype=torch.float64)) for _ in "abc"
        ]
        fishers = [f / f.max() for f in fishers]
        eps = 0.2 * min(fisher_damage(base, f) for f in fishers)
        out, rep = project_retention(base, fishers, eps)
        assert rep["sweeps"] <= 20
        _check_certificate(rep, base, eps)
        for f in fishers:
            assert fisher_damage(out, f) <= eps


# ------------------------------------------------------------------------------ special cases
def test_all_constraints_satisfied_gives_zero_multipliers() -> None:
    base, fishers = _instance(5, 20, 3)
    eps = 1.5 * max(fisher_damage(base, f) for f in fishers)
    out, rep = project_retention(base, fishers, eps)
    assert torch.equal(out, base)
    assert rep["multipliers"] == [0.0, 0.0, 0.0] and not rep["active"]
    assert rep["max_primal_violation"] == 0.0
    assert rep["max_complementary_slackness"] == 0.0
    assert rep["duality_gap"] == 0.0
    assert rep["converged"] and rep["sweeps"] == 0 and rep["iterations"] == 0


def test_single_constraint_both_solvers_share_the_exact_path() -> None:
    base, fishers = _instance(6, 30, 1)
    eps = 0.2 * fisher_damage(base, fishers[0])
    out_e, rep_e = project_retention(base, fishers, eps, solver="exact")
    out_i, rep_i = project_retention(base, fishers, eps, solver="increase-only")
    assert torch.equal(out_e, out_i) and rep_e == rep_i
    assert rep_e["damage_after"][0] == pytest.approx(eps, rel=1e-9)
    _check_certificate(rep_e, base, eps, rel=1e-9)
    ref = _slsqp(base, fishers, eps)
    assert np.linalg.norm(out_e.numpy() - ref) / np.linalg.norm(ref) <= 1e-3


def test_default_solver_is_exact() -> None:
    base, fishers = _instance(7, 25, 2)
    eps = 0.2 * min(fisher_damage(base, f) for f in fishers)
    out_d, rep_d = project_retention(base, fishers, eps)
    out_e, rep_e = project_retention(base, fishers, eps, solver="exact")
    assert torch.equal(out_d, out_e) and rep_d == rep_e


@pytest.mark.parametrize("m", [2, 3])
def test_bf16_output_stays_feasible_after_cast(m: int) -> None:
    base, fishers = _instance(20 + m, 300, m, alpha=0.3)
    eps = 0.1 * min(fisher_damage(base, f) for f in fishers)
    out, rep = project_retention(
        base.float(), [f.float() for f in fishers], eps, out_dtype=torch.bfloat16
    )
    assert out.dtype == torch.bfloat16
    assert rep["max_violation"] == 0.0
    for f, reported in zip(fishers, rep["damage_after"], strict=True):
        b = fisher_damage(out, f)  # damage of the bf16 tensor itself
        assert reported == pytest.approx(b, rel=1e-12)
        assert b <= eps
    assert torch.all(out.double().abs() <= base.abs())
    _check_certificate(rep, base, eps)  # certificate of the float64 point before the cast


def test_iteration_cap_still_returns_a_feasible_point() -> None:
    base, fishers = _instance(8, 30, 3)
    eps = 0.1 * min(fisher_damage(base, f) for f in fishers)
    out, rep = project_retention(base, fishers, eps, max_iter=1)
    assert rep["sweeps"] == 1 and not rep["converged"]
    for f in fishers:
        assert fisher_damage(out, f) <= eps
    assert rep["max_violation"] == 0.0 and rep["max_primal_violation"] == 0.0
    assert torch.all(out.abs() <= base.abs())


# ------------------------------------------------------------------------------- inside FIRM
def test_firm_merge_reports_certificate_per_tensor() -> None:
    g = torch.Generator().manual_seed(4)
    shapes = {"w": (10, 6), "v": (24,)}
    ups = []
    for nid, (role, dom) in enumerate([("forget", "bio"), ("retain", None), ("retain", None)]):
        tv = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
        fi = {k: torch.rand(s, generator=g) ** 3 for k, s in shapes.items()}
        ups.append(ClientUpdate(nid, role, dom, 10, tv, fi))
    base = firm_merge(ups, alpha=0.5)
    eps = 0.2 * min(min(t["damage_before"].values()) for t in base.report["tensors"].values())
    res = firm_merge(ups, alpha=0.5, epsilon=eps)
    assert res.report["params"]["solver"] == "exact"
    json.dumps(res.report, allow_nan=False)
    fts = {k: [normalize_and_sparsify(u.fisher[k], 0.5, 1e-8) for u in ups[1:]] for k in shapes}
    for key in shapes:
        proj = res.report["tensors"][key]["projection"]
        assert set(proj) == CERT_KEYS
        _check_certificate(proj, base.delta[key].double(), eps)
        assert proj["active"] and proj["max_violation"] == 0.0
        expected, rep = project_retention(base.delta[key], fts[key], eps)
        assert torch.equal(res.delta[key], expected)
        assert proj == {k: rep[k] for k in CERT_KEYS}
        for ft in fts[key]:
            assert fisher_damage(res.delta[key], ft) <= eps
    inc = firm_merge(ups, alpha=0.5, epsilon=eps, solver="increase-only")
    assert inc.report["params"]["solver"] == "increase-only"
    for key in shapes:
        exact_dist = float((res.delta[key] - base.delta[key]).double().norm())
        inc_dist = float((inc.delta[key] - base.delta[key]).double().norm())
        assert exact_dist <= inc_dist * (1 + 1e-6)


@pytest.mark.skipif(not kernels.compiler_available(), reason="no C++ compiler for inductor")
@pytest.mark.parametrize(("m", "solver"), [(1, "exact"), (3, "exact"), (3, "increase-only")])
def test_compiled_passes_match_eager(monkeypatch: pytest.MonkeyPatch, m: int, solver: str) -> None:
    """The fused passes, compiled, give the eager solution to rounding, certified either way."""
    base, fishers = _instance(11, 40_000, m, alpha=0.3)
    base, fishers = base.float(), [f.float() for f in fishers]  # float32 gathered copies
    eps = 0.3 * min(fisher_damage(base, f) for f in fishers)
    runs = {}
    for chosen in ("eager", "compiled"):
        monkeypatch.setenv(kernels.MODE_ENV, chosen)
        runs[chosen] = project_retention(
            base, fishers, eps, solver=solver, out_dtype=torch.bfloat16
        )
    (out_e, rep_e), (out_c, rep_c) = runs["eager"], runs["compiled"]
    assert (rep_e["backend"], rep_c["backend"]) == ("eager", "compiled")
    assert rep_c["multipliers"] == pytest.approx(rep_e["multipliers"], rel=1e-9)
    assert all(x > 0 for x in rep_c["multipliers"])
    for rep in (rep_e, rep_c):
        assert rep["converged"] and rep["max_violation"] == 0.0
        assert max(rep["damage_after"]) <= eps
    if solver == "exact":
        _check_certificate(rep_c, base.double(), eps)
    # A rounding-level difference of λ moves at most a few casts across a bfloat16 boundary.
    assert int((out_c != out_e).sum()) <= 10
    assert rep_c["damage_after"] == pytest.approx(rep_e["damage_after"], rel=1e-6)
