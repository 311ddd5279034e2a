"""Tests for the baseline merges AVG, SUM, TIES and FULM / FULM-MEAN (docs/algorithms.md, "TIES,
AVG and SUM", "FULM and FULM-mean")."""

from __future__ import annotations

import json
import math

import pytest
import torch

import fedunlearn.merging.fulm as fulm_module
from fedunlearn.merging import (
    ClientUpdate,
    avg_merge,
    client_similarity,
    cluster_clients,
    firm_merge,
    fulm_mean_merge,
    fulm_merge,
    get_merge,
    sum_merge,
    ties_combine,
    ties_merge,
)


def _cu(
    node_id: int | str,
    role: str,
    domain: str | None,
    tv: dict[str, torch.Tensor],
    fisher: dict[str, torch.Tensor] | None = None,
) -> ClientUpdate:
    return ClientUpdate(node_id, role, domain, 10, tv, fisher)


def _w(*values: float) -> dict[str, torch.Tensor]:
    return {"w": torch.tensor([[float(v) for v in values]])}


def _close(a: torch.Tensor, b: torch.Tensor | list, atol: float = 1e-6) -> None:
    b = torch.as_tensor(b, dtype=a.dtype).reshape(a.shape)
    torch.testing.assert_close(a, b, atol=atol, rtol=0.0)


# ----------------------------------------------------------------------------- registry
@pytest.mark.parametrize(
    ("name", "fn"),
    [
        ("avg", avg_merge),
        ("sum", sum_merge),
        ("ties", ties_merge),
        ("fulm", fulm_merge),
        ("fulm-mean", fulm_mean_merge),
    ],
)
def test_get_merge_by_name(name, fn) -> None:
    assert get_merge(name) is fn


# ----------------------------------------------------------------------------- AVG / SUM
def _avg_sum_clients() -> list[ClientUpdate]:
    return [
        _cu("f1", "forget", "bio", _w(1, 2, 3, 4)),
        _cu("f2", "forget", "cyber", _w(3, 2, 1, 0)),
        _cu("r", "retain", None, _w(5, -4, 2, 6)),
    ]


def test_avg_includes_retain() -> None:
    res = avg_merge(_avg_sum_clients(), gamma=1.5)
    # mean = [9, 0, 6, 10] / 3 = [3, 0, 2, 10/3]; times 1.5
    _close(res.delta["w"], [4.5, 0.0, 3.0, 5.0])
    assert res.report["method"] == "avg"
    assert res.report["params"] == {"gamma": 1.5}
    assert res.report["clients"] == ["f1", "f2", "r"]
    assert res.report["retain_clients"] == ["r"]
    assert res.report["norm_final"] == pytest.approx(math.sqrt(4.5**2 + 9 + 25))
    assert res.report["tensors"]["w"]["norm"] == pytest.approx(res.report["norm_final"])


def test_sum_excludes_retain() -> None:
    res = sum_merge(_avg_sum_clients(), gamma=2.0)
    _close(res.delta["w"], [8.0, 8.0, 8.0, 8.0])
    assert res.report["method"] == "sum"
    assert res.report["clients"] == ["f1", "f2"]
    assert res.report["ignored_clients"] == ["r"]
    assert res.report["norm_final"] == pytest.approx(16.0)


# ----------------------------------------------------------------------------- TIES
def test_ties_hand_computed() -> None:
    # k = 0.5 on 4 entries: keep the top 2 by |value| (ties at the threshold all kept).
    vs = [
        torch.tensor([[3.0, -1.0, 2.0, 0.5]]),  # trimmed [3, 0, 2, 0]
        torch.tensor([[-1.0, -4.0, 1.0, 1.0]]),  # threshold 1 is tied 3x: all kept
        torch.tensor([[-1.0, 0.0, -3.0, 0.1]]),  # trimmed [-1, 0, -3, 0]
        torch.tensor([[2.0, 0.0, 0.0, 0.0]]),  # threshold 0: all kept, zeros stay zero
    ]
    # Sum of trimmed = [3, -4, 0, 1] -> elected signs [+, -, 0, +].
    # Disjoint means: entry 0 -> (3 + 2)/2; entry 1 -> -4; entry 2 -> signs cancel -> 0;
    # entry 3 -> 1 (0.5 of v1 and 0.1 of v3 were trimmed).
    merged, stats = ties_combine(vs, 0.5)
    _close(merged, [2.5, -4.0, 0.0, 1.0])
    assert merged.shape == (1, 4)
    assert stats["kept_per_vector"] == 2
    assert stats["support_fraction"] == pytest.approx(0.75)
    # Entries with a non-zero trimmed value: all 4; unanimous with the elected sign: 1 and 3.
    assert stats["sign_agreement"] == pytest.approx(0.5)

    clients = [_cu(f"f{i}", "forget", "bio", {"w": v}) for i, v in enumerate(vs)]
    clients.append(_cu("r", "retain", None, _w(100, 100, 100, 100)))
    res = ties_merge(clients, gamma=2.0, k=0.5)
    _close(res.delta["w"], [5.0, -8.0, 0.0, 2.0])
    rep = res.report
    assert rep["method"] == "ties"
    assert rep["params"] == {"gamma": 2.0, "k": 0.5}
    assert rep["ignored_clients"] == ["r"]
    assert rep["tensors"]["w"]["sign_agreement"] == pytest.approx(0.5)
    assert rep["tensors"]["w"]["support_fraction"] == pytest.approx(0.75)
    assert rep["norm_final"] == pytest.approx(math.sqrt(25 + 64 + 4))


def test_ties_trim_keeps_ties_and_rounds_support() -> None:
    v = torch.tensor([1.0, -1.0, 1.0, 0.5])
    merged, stats = ties_combine([v], 0.25)  # k·d = 1 entry, but 3 tie at |1|
    _close(merged, [1.0, -1.0, 1.0, 0.0])
    assert stats["kept_per_vector"] == 1
    assert stats["sign_agreement"] == 1.0
    # k·d = 0.1 rounds up to the minimum of one entry.
    merged, stats = ties_combine([torch.tensor([0.2, -0.3, 0.1, 0.0])], 0.01)
    _close(merged, [0.0, -0.3, 0.0, 0.0])
    assert stats["kept_per_vector"] == 1
    # 0.3 · 10 rounds to 3 (binary rounding slack as in FIRM's support_size).
    _, stats = ties_combine([torch.arange(10.0)], 0.3)
    assert stats["kept_per_vector"] == 3


def test_ties_no_agreeing_value_gives_zero() -> None:
    a = torch.tensor([2.0, 0.0, 1.0])
    b = torch.tensor([-2.0, 0.0, 1.0])
    merged, stats = ties_combine([a, b], 1.0)
    # entry 0: +2 and -2 cancel (elected sign 0) -> 0; entry 1: no non-zero value -> 0.
    _close(merged, [0.0, 0.0, 1.0])
    assert stats["sign_agreement"] == pytest.approx(0.5)  # of entries 0 and 2, only 2 agrees


def test_ties_k1_same_sign_equals_mean() -> None:
    g = torch.Generator().manual_seed(0)
    vs = [torch.rand(3, 5, generator=g, dtype=torch.float64) + 0.1 for _ in range(4)]
    signs = torch.where(torch.rand(3, 5, generator=g) > 0.5, 1.0, -1.0).double()
    vs = [v * signs for v in vs]  # same sign per entry across vectors
    merged, stats = ties_combine(vs, 1.0)
    assert merged.dtype == torch.float64
    torch.testing.assert_close(merged, torch.stack(vs).mean(0), rtol=0, atol=1e-12)
    assert stats["sign_agreement"] == 1.0
    assert stats["support_fraction"] == 1.0


# ----------------------------------------------------------------------------- FULM
def test_fulm_hand_computed() -> None:
    clients = [
        _cu("a1", "forget", "bio", _w(2, 1, 0, 0)),
        _cu("r", "retain", None, _w(0, 0, 1, -3)),
        _cu("a2", "forget", "bio", _w(4, 1, 0, 0)),
    ]
    # cos(a1, a2) = 9 / sqrt(5·17) ≈ 0.976 >= 0.6; r is orthogonal to both.
    # k = 0.5: cluster {a1, a2} -> TIES = [3, 1, 0, 0]; cluster {r} -> [0, 0, 1, -3].
    res = fulm_merge(clients, gamma=1.0, threshold=0.6, k=0.5)
    _close(res.delta["w"], [3.0, 1.0, 1.0, -3.0])
    rep = res.report
    assert rep["method"] == "fulm"
    assert rep["params"] == {"gamma": 1.0, "threshold": 0.6, "k": 0.5, "combine": "sum"}
    assert rep["clusters"] == [["a1", "a2"], ["r"]]
    assert rep["cluster_roles"] == [["forget"], ["retain"]]
    assert rep["cluster_domains"] == [["bio"], []]
    c = round(9 / math.sqrt(85), 6)
    assert rep["similarity"] == [[1.0, 0.0, c], [0.0, 1.0, 0.0], [c, 0.0, 1.0]]
    assert rep["norm_final"] == pytest.approx(math.sqrt(20.0))
    json.dumps(rep)

    res = fulm_mean_merge(clients, gamma=1.0, threshold=0.6, k=0.5)
    _close(res.delta["w"], [1.5, 0.5, 0.5, -1.5])
    assert res.report["method"] == "fulm-mean"


def _domain_clients() -> list[ClientUpdate]:
    """Forget domain A, forget domain B and a retain client with disjoint supports + noise.

    Each client sends ``w`` (4×4) and ``b`` (4,): 20 entries when flattened.
    """
    g = torch.Generator().manual_seed(1)
    support = {"A": range(0, 6), "B": range(6, 12), "R": range(12, 20)}
    base = {}
    for name, idx in support.items():
        v = torch.zeros(20)
        v[list(idx)] = torch.randn(len(idx), generator=g).abs() + 1.0
        base[name] = v

    def make(nid: str, role: str, dom: str | None, which: str) -> ClientUpdate:
        flat = base[which] + 0.05 * torch.randn(20, generator=g)
        return _cu(nid, role, dom, {"w": flat[:16].reshape(4, 4), "b": flat[16:].clone()})

    return [
        make("a1", "forget", "A", "A"),
        make("b1", "forget", "B", "B"),
        make("r", "retain", None, "R"),
        make("a2", "forget", "A", "A"),
        make("b2", "forget", "B", "B"),
    ]


def test_fulm_separated_groups_and_sum_vs_mean() -> None:
    clients = _domain_clients()
    res = fulm_merge(clients, gamma=0.7)
    rep = res.report
    assert rep["clusters"] == [["a1", "a2"], ["b1", "b2"], ["r"]]
    assert rep["cluster_domains"] == [["A"], ["B"], []]
    assert rep["cluster_roles"] == [["forget"], ["forget"], ["retain"]]
    assert rep["num_clusters"] == 3
    json.dumps(rep)

    groups = [[0, 3], [1, 4], [2]]
    total_sq = 0.0
    for key in ("w", "b"):
        cents = [ties_combine([clients[i].task_vector[key] for i in m], 0.3)[0] for m in groups]
        expected = 0.7 * sum(cents)
        torch.testing.assert_close(res.delta[key], expected, rtol=1e-6, atol=1e-6)
        assert rep["tensors"][key]["norm"] == pytest.approx(float(expected.norm()), rel=1e-5)
        assert len(rep["tensors"][key]["centroid_norms"]) == 3
        total_sq += float(expected.norm()) ** 2
    assert rep["norm_final"] == pytest.approx(math.sqrt(total_sq), rel=1e-5)

    mean_res = fulm_mean_merge(clients, gamma=0.7)
    assert mean_res.report["clusters"] == rep["clusters"]
    for key in ("w", "b"):
        torch.testing.assert_close(mean_res.delta[key], res.delta[key] / 3, rtol=1e-6, atol=1e-6)

    # threshold -1 links everybody: one cluster.
    assert fulm_merge(clients, threshold=-1.0).report["clusters"] == [["a1", "b1", "r", "a2", "b2"]]


def test_similarity_tensor_by_tensor_equals_flattened(monkeypatch) -> None:
    g = torch.Generator().manual_seed(2)
    shapes = {"q": (3, 5), "k": (7,), "o": (2, 2, 3)}
    clients = [
        _cu(i, "forget" if i < 3 else "retain", "x" if i < 3 else None,
            {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in shapes.items()})
        for i in range(5)
    ]  # fmt: skip
    flat = torch.stack([torch.cat([u.task_vector[k].reshape(-1) for k in shapes]) for u in clients])
    unit = flat / flat.norm(dim=1, keepdim=True)
    expected = (unit @ unit.T).clamp(-1, 1)
    expected.fill_diagonal_(1.0)
    sim = client_similarity(clients)
    torch.testing.assert_close(sim, expected, rtol=0, atol=1e-12)
    monkeypatch.setattr(fulm_module, "_SIM_CHUNK", 4)  # exercise chunking inside a tensor
    torch.testing.assert_close(client_similarity(clients), expected, rtol=0, atol=1e-12)


def test_similarity_zero_vector_and_clustering() -> None:
    clients = [_cu("z", "forget", "x", _w(0, 0, 0, 0)), _cu("a", "forget", "x", _w(1, 0, 0, 0))]
    sim = client_similarity(clients)
    assert sim.tolist() == [[1.0, 0.0], [0.0, 1.0]]
    s = torch.tensor([[1.0, 0.7, 0.1, 0.0], [0.7, 1, 0.65, 0], [0.1, 0.65, 1, 0], [0, 0, 0, 1]])
    assert cluster_clients(s, 0.6) == [[0, 1, 2], [3]]  # transitive: 0-1-2
    assert cluster_clients(s, 0.66) == [[0, 1], [2], [3]]


# ----------------------------------------------------------------------------- magnitude
def test_magnitude_explosion_sum_vs_avg_firm() -> None:
    v = torch.tensor([[0.5, -1.0, 2.0, 0.25], [1.5, 0.0, -0.75, 1.0]])
    ones = torch.ones_like(v)

    def norms(n: int) -> dict[str, float]:
        clients = [_cu(i, "forget", f"d{i}", {"w": v.clone()}, {"w": ones}) for i in range(n)]
        return {
            "sum": sum_merge(clients).report["norm_final"],
            "avg": avg_merge(clients).report["norm_final"],
            "firm": firm_merge(clients).report["norm_final"],
        }

    one, four = norms(1), norms(4)
    base = float(v.norm())
    assert one["sum"] == pytest.approx(base)
    assert four["sum"] == pytest.approx(4 * base)
    assert four["avg"] == pytest.approx(base)
    assert four["firm"] == pytest.approx(base, rel=1e-6)
    assert four["firm"] <= one["firm"] * (1 + 1e-6)


# ----------------------------------------------------------------------------- common
@pytest.mark.parametrize("name", ["avg", "sum", "ties", "fulm", "fulm-mean"])
def test_report_and_dtype(name) -> None:
    clients = [
        _cu(0, "forget", "A", {"w": torch.tensor([[1.0, -2.0], [3.0, 0.5]], dtype=torch.bfloat16)}),
        _cu(
            1, "retain", None, {"w": torch.tensor([[0.5, 1.0], [-1.0, 2.0]], dtype=torch.bfloat16)}
        ),
    ]
    res = get_merge(name)(clients, gamma=1.25)
    assert res.delta["w"].dtype == torch.bfloat16
    rep = json.loads(json.dumps(res.report))
    assert rep["method"] == name
    assert rep["params"]["gamma"] == 1.25
    assert rep["norm_final"] == pytest.approx(float(res.delta["w"].double().norm()))
    assert rep["tensors"]["w"]["norm"] == pytest.approx(rep["norm_final"])


def test_errors_name_the_problem() -> None:
    retain_only = [_cu("r1", "retain", None, _w(1, 2, 3, 4))]
    with pytest.raises(ValueError, match="SUM needs at least one forget client.*'r1'"):
        sum_merge(retain_only)
    with pytest.raises(ValueError, match="TIES needs at least one forget client"):
        ties_merge(retain_only)
    forget = [_cu("f", "forget", "A", _w(1, 2, 3, 4))]
    for bad in (0.0, -0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match=r"k \(TIES support fraction\) must be in \(0, 1\]"):
            ties_merge(forget, k=bad)
        with pytest.raises(ValueError, match=r"k \(TIES support fraction\) must be in \(0, 1\]"):
            fulm_merge(forget, k=bad)
    for bad in (1.5, -1.01, math.nan):
        with pytest.raises(ValueError, match=r"threshold .* must be in \[-1, 1\]"):
            fulm_mean_merge(forget, threshold=bad)
    with pytest.raises(ValueError, match="gamma must be finite"):
        avg_merge(forget, gamma=math.inf)
    with pytest.raises(TypeError, match="gamma must be a real number"):
        sum_merge(forget, gamma="big")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="input 1 has shape"):
        ties_combine([torch.zeros(3), torch.zeros(4)], 0.5)
    with pytest.raises(ValueError, match="no client updates"):
        avg_merge([])
    mismatched = [forget[0], _cu("g", "forget", "A", {"w": torch.zeros(1, 3)})]
    with pytest.raises(ValueError, match="client 'g': tensor 'w' has shape"):
        fulm_merge(mismatched)
