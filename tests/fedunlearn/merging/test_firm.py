"""Tests for the FIRM merge (docs/algorithms.md, "FIRM base merge", "FIRM retention-constrained
projection"), the client-update types and the merge registry."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fedunlearn.merging import (
    MERGES,
    ClientUpdate,
    MergeResult,
    firm_merge,
    fisher_damage,
    get_merge,
    normalize_and_sparsify,
    project_retention,
    register_merge,
)

EPS0 = 1e-8


def _cu(
    node_id: int | str,
    role: str,
    domain: str | None,
    tv: dict[str, torch.Tensor],
    fisher: dict[str, torch.Tensor] | None,
) -> ClientUpdate:
    return ClientUpdate(node_id, role, domain, 10, tv, fisher)


def _random_clients(
    seed: int, n_forget: dict[str, int], n_retain: int, shapes: dict[str, tuple[int, ...]]
) -> list[ClientUpdate]:
    g = torch.Generator().manual_seed(seed)
    out: list[ClientUpdate] = []
    nid = 0
    roles = [("forget", dom) for dom, n in n_forget.items() for _ in range(n)]
    roles += [("retain", None)] * n_retain
    for role, dom in roles:
        tv = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
        fi = {k: torch.rand(s, generator=g) ** 3 for k, s in shapes.items()}
        out.append(_cu(nid, role, dom, tv, fi))
        nid += 1
    return out


# ----------------------------------------------------------------------------- registry
def test_registry_lookup_and_errors() -> None:
    assert get_merge("firm") is firm_merge
    assert MERGES["firm"] is firm_merge
    with pytest.raises(KeyError, match="unknown merge 'nope'.*'firm'"):
        get_merge("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_merge("firm")(lambda updates: MergeResult({}, {}))


def test_register_new_merge() -> None:
    name = "_test_dummy_merge"

    @register_merge(name)
    def dummy(updates: list[ClientUpdate]) -> MergeResult:
        return MergeResult({}, {"method": name})

    try:
        assert get_merge(name) is dummy
        with pytest.raises(ValueError, match=name):
            register_merge(name)(dummy)
    finally:
        del MERGES[name]


# ------------------------------------------------------------- normalise and sparsify
def test_sparsify_keeps_ties_at_threshold() -> None:
    f = torch.tensor([3.0, 1.0, 3.0, 0.5, 3.0, 0.0, 2.0, 0.1, 0.2, 0.3])
    ft = normalize_and_sparsify(f, alpha=0.1, eps0=EPS0)  # k = 1, but three entries tie
    expected = torch.zeros(10)
    expected[[0, 2, 4]] = 3.0 / (3.0 + EPS0)
    assert torch.equal(ft, expected)
    # k = 2 -> threshold is the 2nd largest (3.0): still exactly the three tied entries.
    assert torch.equal(normalize_and_sparsify(f, alpha=0.2, eps0=EPS0), expected)
    # k = 4 -> threshold 2.0 keeps the ties and the 2.0.
    ft4 = normalize_and_sparsify(f, alpha=0.4, eps0=EPS0)
    assert (ft4 > 0).nonzero().flatten().tolist() == [0, 2, 4, 6]


def test_sparsify_normalises_and_handles_edge_cases() -> None:
    f = torch.arange(20, dtype=torch.float32).reshape(4, 5)
    ft = normalize_and_sparsify(f, alpha=0.25, eps0=EPS0)  # k = 5 of 20
    assert ft.shape == (4, 5)
    assert int((ft > 0).sum()) == 5
    assert float(ft.max()) == pytest.approx(19.0 / (19.0 + EPS0))
    assert torch.equal(ft[ft > 0], (torch.arange(15, 20) / (19.0 + EPS0)).float())
    # alpha * d < 1 still keeps one entry; alpha = 1 keeps everything.
    assert int((normalize_and_sparsify(f, 0.01, EPS0) > 0).sum()) == 1
    assert int((normalize_and_sparsify(f, 1.0, EPS0) > 0).sum()) == 19
    # An all-zero Fisher stays all zero (no NaN).
    assert torch.equal(normalize_and_sparsify(torch.zeros(3, 3), 0.5, EPS0), torch.zeros(3, 3))


# ------------------------------------------------------------------ base merge
def test_hand_computed_two_by_two() -> None:
    forget = _cu(
        "f",
        "forget",
        "bio",
        {"w": torch.tensor([[1.0, -2.0], [3.0, 4.0]])},
        {"w": torch.tensor([[4.0, 1.0], [2.0, 0.0]])},
    )
    retain = _cu(
        "r",
        "retain",
        None,
        {"w": torch.tensor([[10.0, 20.0], [30.0, 40.0]])},
        {"w": torch.tensor([[0.0, 3.0], [6.0, 0.0]])},
    )
    # alpha = 0.5 -> k = 2.  Forget F̃ = [[1, .25], [.5, 0]] -> keeps (0,0), (1,0).
    # Retain F̃ = [[0, .5], [1, 0]] -> keeps (0,1), (1,0).
    # Δ_F = [[1, 0], [3, 0]], Δ_R = [[0, 20], [30, 0]] (up to eps0).
    res = firm_merge([forget, retain], alpha=0.5)
    assert torch.allclose(res.delta["w"], torch.tensor([[1.0, 20.0], [33.0, 0.0]]), rtol=1e-6)
    assert res.delta["w"][1, 1] == 0.0
    rep = res.report["tensors"]["w"]
    assert rep["norm_forget_term"] == pytest.approx(math.sqrt(10.0), rel=1e-6)
    assert rep["norm_retain_term"] == pytest.approx(math.sqrt(1300.0), rel=1e-6)
    assert rep["support_fraction"] == 0.75
    assert rep["damage_before"]["r"] == pytest.approx(0.5 * 400 + 1.0 * 33**2, rel=1e-6)
    assert res.report["domains"] == {"bio": ["f"]} and res.report["retain_clients"] == ["r"]

    split = firm_merge([forget, retain], alpha=0.5, gamma_forget=2.0, gamma_retain=0.5)
    assert torch.allclose(split.delta["w"], torch.tensor([[2.0, 10.0], [21.0, 0.0]]), rtol=1e-6)
    scaled = firm_merge([forget, retain], alpha=0.5, gamma=3.0)
    assert torch.allclose(scaled.delta["w"], 3.0 * res.delta["w"], rtol=1e-6)


@pytest.mark.parametrize("seed", range(5))
def test_forget_term_bounded_by_largest_domain_mean(seed: int) -> None:
    shapes = {"a": (8, 6), "b": (50,)}
    ups = _random_clients(seed, {"bio": 3, "cyber": 2, "chem": 1}, 0, shapes)
    res = firm_merge(ups, alpha=0.3)
    for key in shapes:
        means = torch.stack(
            [
                torch.stack([u.task_vector[key] for u in ups if u.domain == dom]).mean(0)
                for dom in ("bio", "cyber", "chem")
            ]
        )
        bound = means.abs().max(0).values
        assert torch.all(res.delta[key].abs() <= bound * (1 + 1e-6) + 1e-12)


def test_pooling_happens_before_normalisation() -> None:
    # Two clients of one domain.  Pooled raw Fisher = [0.5, 50, 0, 0] -> with k = 1 only
    # index 1 survives.  Normalising per client first would keep index 0 as well.
    a = _cu(
        1,
        "forget",
        "bio",
        {"w": torch.tensor([2.0, 4.0, 6.0, 8.0])},
        {"w": torch.tensor([1.0, 0.0, 0.0, 0.0])},
    )
    b = _cu(
        2,
        "forget",
        "bio",
        {"w": torch.tensor([4.0, 8.0, -6.0, 0.0])},
        {"w": torch.tensor([0.0, 100.0, 0.0, 0.0])},
    )
    res = firm_merge([a, b], alpha=0.25)
    f_pool = torch.tensor([0.5, 50.0, 0.0, 0.0])
    d_pool = torch.tensor([3.0, 6.0, 0.0, 4.0])
    ft = f_pool / (50.0 + EPS0)
    ft[0] = 0.0  # sparsified away
    expected = ft * d_pool / (ft + EPS0)
    assert torch.allclose(res.delta["w"], expected)
    assert res.delta["w"][0] == 0.0 and res.delta["w"][1] == pytest.approx(6.0, rel=1e-6)
    # The pool-after variant differs at index 0.
    per_client = [normalize_and_sparsify(u.fisher["w"], 0.25, EPS0) for u in (a, b)]
    assert float((per_client[0] + per_client[1])[0]) > 0


def test_coordinates_without_fisher_get_exactly_zero() -> None:
    shapes = {"w": (10, 10)}
    ups = _random_clients(3, {"bio": 2, "cyber": 1}, 2, shapes)
    dead = torch.zeros(10, 10, dtype=torch.bool)
    dead[:, :3] = True
    for u in ups:
        u.fisher["w"][dead] = 0.0  # type: ignore[index]
    res = firm_merge(ups, alpha=0.5)
    assert torch.all(res.delta["w"][dead] == 0.0)
    assert torch.any(res.delta["w"][~dead] != 0.0)


@pytest.mark.parametrize("same_domain", [True, False])
def test_identical_clients_do_not_explode_norm(same_domain: bool) -> None:
    g = torch.Generator().manual_seed(0)
    tv, fi = torch.randn(64, generator=g), torch.rand(64, generator=g)

    def merged(n: int) -> tuple[float, float]:
        ups = [
            _cu(
                i, "forget", "bio" if same_domain else f"d{i}", {"w": tv.clone()}, {"w": fi.clone()}
            )
            for i in range(n)
        ]
        res = firm_merge(ups, alpha=0.5)
        sum_merge = torch.stack([u.task_vector["w"] for u in ups]).sum(0)
        return res.report["norm_final"], float(sum_merge.norm())

    n1, s1 = merged(1)
    for n in (2, 5, 10):
        nn, sn = merged(n)
        assert nn <= n1 * (1 + 1e-6)
        assert sn == pytest.approx(n * s1, rel=1e-5)


def test_retain_free_merge_and_report_is_json() -> None:
    ups = _random_clients(1, {"bio": 2}, 0, {"x": (4, 4), "y": (7,)})
    res = firm_merge(ups, epsilon=1e-3)
    assert res.report["retain_clients"] == []
    assert res.report["params"]["projection"] is False
    rep_x = res.report["tensors"]["x"]
    assert rep_x["damage_before"] == {} and rep_x["multipliers"] == {}
    assert rep_x["norm_retain_term"] == 0.0
    json.dumps(res.report, allow_nan=False)
    total = math.sqrt(sum(t["norm_final"] ** 2 for t in res.report["tensors"].values()))
    assert res.report["norm_final"] == pytest.approx(total)


# ------------------------------------------------------------------ projection inside FIRM
def test_infinite_epsilon_skips_projection() -> None:
    ups = _random_clients(2, {"bio": 2}, 2, {"w": (6, 5)})
    res = firm_merge(ups, alpha=0.4)
    rep = res.report["tensors"]["w"]
    assert res.report["params"]["epsilon"] is None
    assert rep["projection"] == {
        "iterations": 0,
        "sweeps": 0,
        "converged": True,
        "feasibility_pass": False,
        "max_violation": 0.0,
        "active": False,
        "max_primal_violation": 0.0,
        "max_complementary_slackness": 0.0,
        "duality_gap": 0.0,
        "backend": None,
    }
    assert res.report["projection_backend"] is None
    assert rep["norm_base"] == rep["norm_final"]
    assert set(rep["damage_before"]) == {"2", "3"}


@pytest.mark.parametrize("n_retain", [1, 2, 3])
def test_projection_is_feasible_and_matches_project_retention(n_retain: int) -> None:
    shapes = {"w": (12, 9), "v": (30,)}
    ups = _random_clients(5 + n_retain, {"bio": 2, "cyber": 1}, n_retain, shapes)
    base = firm_merge(ups, alpha=0.3)
    eps = 0.2 * min(min(t["damage_before"].values()) for t in base.report["tensors"].values())
    res = firm_merge(ups, alpha=0.3, epsilon=eps)
    json.dumps(res.report, allow_nan=False)
    retain = [u for u in ups if u.role == "retain"]
    for key in shapes:
        rep = res.report["tensors"][key]
        assert rep["projection"]["active"]
        assert rep["projection"]["max_violation"] <= 1e-4 * eps
        fts = [normalize_and_sparsify(u.fisher[key], 0.3, EPS0) for u in retain]  # type: ignore
        for u, ft in zip(retain, fts, strict=True):
            b = fisher_damage(res.delta[key], ft)
            assert b <= eps * (1 + 1e-4)
            assert rep["damage_after"][str(u.node_id)] == pytest.approx(b, rel=1e-9)
            assert rep["multipliers"][str(u.node_id)] >= 0
        assert torch.all(res.delta[key].abs() <= base.delta[key].abs())
        expected, _ = project_retention(base.delta[key], fts, eps)
        assert torch.equal(res.delta[key], expected)


def test_bf16_task_vectors_give_bf16_result_with_damage_after_cast() -> None:
    ups = _random_clients(11, {"bio": 2}, 2, {"w": (16, 16)})
    ups = [
        _cu(u.node_id, u.role, u.domain, {"w": u.task_vector["w"].to(torch.bfloat16)}, u.fisher)
        for u in ups
    ]
    base = firm_merge(ups, alpha=0.2)
    assert base.delta["w"].dtype == torch.bfloat16
    eps = 0.3 * min(base.report["tensors"]["w"]["damage_before"].values())
    res = firm_merge(ups, alpha=0.2, epsilon=eps)
    out = res.delta["w"]
    assert out.dtype == torch.bfloat16
    rep = res.report["tensors"]["w"]
    for u in ups[2:]:
        ft = normalize_and_sparsify(u.fisher["w"], 0.2, EPS0)  # type: ignore[index]
        b = fisher_damage(out, ft)  # damage of the bf16 tensor itself
        assert rep["damage_after"][str(u.node_id)] == pytest.approx(b, rel=1e-12)
        assert b <= eps * (1 + 1e-4)
    assert rep["norm_final"] == pytest.approx(float(out.double().norm()), rel=1e-12)


# ----------------------------------------------------------------------------- errors
def test_client_update_validation_errors() -> None:
    tv = {"layer.q": torch.ones(2, 2)}
    with pytest.raises(ValueError, match="client 7.*role"):
        ClientUpdate(7, "attacker", None, 1, tv, None)
    with pytest.raises(ValueError, match="client 7.*Fisher tensor 'layer.q'.*shape"):
        ClientUpdate(7, "forget", "bio", 1, tv, {"layer.q": torch.ones(3)})
    with pytest.raises(ValueError, match="client 7.*Fisher tensor 'layer.q'.*negative"):
        ClientUpdate(7, "forget", "bio", 1, tv, {"layer.q": -torch.ones(2, 2)})
    with pytest.raises(ValueError, match="client 7.*Fisher tensor 'layer.q'.*non-finite"):
        ClientUpdate(7, "forget", "bio", 1, tv, {"layer.q": torch.full((2, 2), math.nan)})
    with pytest.raises(ValueError, match="client 7.*task-vector tensor 'layer.q'.*non-finite"):
        ClientUpdate(7, "forget", "bio", 1, {"layer.q": torch.tensor([[1.0, math.inf]] * 2)})
    with pytest.raises(ValueError, match="client 7.*fisher is missing.*layer.k"):
        ClientUpdate(7, "forget", "bio", 1, {**tv, "layer.k": torch.ones(1)}, dict(tv))


def test_firm_merge_errors() -> None:
    f = _cu("f1", "forget", "bio", {"w": torch.ones(2, 2)}, {"w": torch.ones(2, 2)})
    r = _cu("r1", "retain", None, {"w": torch.ones(2, 2)}, {"w": torch.ones(2, 2)})
    no_fisher = _cu("r2", "retain", None, {"w": torch.ones(2, 2)}, None)
    with pytest.raises(ValueError, match="Fisher.*'r2'"):
        firm_merge([f, r, no_fisher])
    with pytest.raises(ValueError, match="at least one forget client"):
        firm_merge([r])
    bad_shape = _cu("r3", "retain", None, {"w": torch.ones(2, 3)}, {"w": torch.ones(2, 3)})
    with pytest.raises(ValueError, match="client 'r3'.*tensor 'w'.*shape"):
        firm_merge([f, bad_shape])
    extra = _cu(
        "r4",
        "retain",
        None,
        {"w": torch.ones(2, 2), "u": torch.ones(1)},
        {"w": torch.ones(2, 2), "u": torch.ones(1)},
    )
    with pytest.raises(ValueError, match="client 'r4'.*'u'"):
        firm_merge([f, extra])
    no_domain = _cu("f2", "forget", None, {"w": torch.ones(2, 2)}, {"w": torch.ones(2, 2)})
    with pytest.raises(ValueError, match="'f2' has no domain"):
        firm_merge([f, no_domain])
    with pytest.raises(ValueError, match="duplicate node_id"):
        firm_merge([f, f])
    with pytest.raises(ValueError, match="alpha"):
        firm_merge([f], alpha=0.0)
    with pytest.raises(ValueError, match="unknown projection solver"):
        firm_merge([f], solver="nope")
    with pytest.raises(ValueError, match="no client updates"):
        firm_merge([])
