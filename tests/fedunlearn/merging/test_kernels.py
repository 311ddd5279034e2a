"""The fused merge kernels: compiled (inductor) and eager give the same merge."""

from __future__ import annotations

import pytest
import torch

from fedunlearn.merging import firm_merge, fulm_merge, kernels, native, ties_merge
from fedunlearn.merging.base import ClientUpdate


def _clients(shape: tuple[int, int], dtype: torch.dtype) -> list[ClientUpdate]:
    gen = torch.Generator().manual_seed(7)
    ups = []
    for i, (role, domain) in enumerate(
        [("forget", "a"), ("forget", "a"), ("forget", "b"), ("retain", None)]
    ):
        tv = torch.randn(shape, generator=gen).to(dtype)
        fisher = torch.randn(shape, generator=gen).mul_(2).exp_().mul_(1e-6).to(dtype)
        ups.append(
            ClientUpdate(
                node_id=f"c{i}",
                role=role,
                domain=domain,
                num_examples=10,
                task_vector={"w": tv},
                fisher={"w": fisher},
            )
        )
    return ups


def test_unknown_mode_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.MODE_ENV, "fast")
    with pytest.raises(ValueError, match="FEDUNLEARN_MERGE_KERNELS"):
        kernels.mode()


@pytest.mark.skipif(not kernels.compiler_available(), reason="no C++ compiler for inductor")
@pytest.mark.parametrize("c_pass", [True, False])  # the C counting pass, or inductor's
@pytest.mark.parametrize("epsilon", [float("inf"), 1e-3])
def test_compiled_firm_equals_eager(
    monkeypatch: pytest.MonkeyPatch, epsilon: float, c_pass: bool
) -> None:
    ups = _clients((613, 700), torch.bfloat16)  # > SMALL entries: the fused bracket count runs
    monkeypatch.setenv(kernels.MODE_ENV, "eager")
    eager = firm_merge(ups, alpha=0.1, epsilon=epsilon)
    monkeypatch.setenv(kernels.MODE_ENV, "compiled")
    monkeypatch.setattr(kernels, "COUNT_SLICE", 1 << 16)  # the counts over several slices
    monkeypatch.setattr(native, "SLICE", 1 << 16)
    if not c_pass:
        monkeypatch.setattr(kernels, "pooled_bracket_counts", lambda *args: None)
    compiled = firm_merge(ups, alpha=0.1, epsilon=epsilon)
    assert torch.equal(compiled.delta["w"], eager.delta["w"])
    assert int(torch.count_nonzero(eager.delta["w"])) > 0
    a, b = compiled.report["tensors"]["w"], eager.report["tensors"]["w"]
    assert a["support_fraction"] == b["support_fraction"]
    for field in ("norm_base", "norm_final", "norm_forget_term", "norm_retain_term"):
        assert a[field] == pytest.approx(b[field], rel=1e-12)
    assert a["damage_after"]["c3"] == pytest.approx(b["damage_after"]["c3"], rel=1e-12)
    # results.json records how the projection ran (compiled and eager differ by rounding)
    projected = epsilon != float("inf")
    assert compiled.report["projection_backend"] == ("compiled" if projected else None)
    assert eager.report["projection_backend"] == ("eager" if projected else None)
    assert a["projection"]["backend"] == ("compiled" if projected else None)


@pytest.mark.skipif(not kernels.compiler_available(), reason="no C++ compiler for inductor")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # float32: fused trim counts
@pytest.mark.parametrize("method", ["ties", "fulm"])
def test_compiled_ties_and_fulm_equal_eager(
    monkeypatch: pytest.MonkeyPatch, method: str, dtype: torch.dtype
) -> None:
    ups = _clients((613, 700), dtype)  # > SMALL entries
    merge = {"ties": ties_merge, "fulm": fulm_merge}[method]
    kwargs = {"gamma": 0.7} if method == "ties" else {"gamma": 0.7, "threshold": -1.0}
    monkeypatch.setenv(kernels.MODE_ENV, "eager")
    eager = merge(ups, **kwargs)
    monkeypatch.setenv(kernels.MODE_ENV, "compiled")
    monkeypatch.setattr(kernels, "COUNT_SLICE", 1 << 16)  # the counts over several slices
    compiled = merge(ups, **kwargs)
    assert torch.equal(compiled.delta["w"], eager.delta["w"])
    assert 0 < int(torch.count_nonzero(eager.delta["w"])) < eager.delta["w"].numel()
    a, b = compiled.report["tensors"]["w"], eager.report["tensors"]["w"]
    assert a["norm"] == pytest.approx(b["norm"], rel=1e-12)
    assert a["sign_agreement"] == pytest.approx(b["sign_agreement"], rel=1e-12)
