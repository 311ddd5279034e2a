"""kth_largest equals torch.kthvalue exactly; the fused merges equal their whole-tensor formulas."""

from __future__ import annotations

import math

import pytest
import torch

from fedunlearn.merging import (
    ClientUpdate,
    _chunks,
    firm_merge,
    fulm_merge,
    kernels,
    selection,
    ties_combine,
    ties_merge,
)
from fedunlearn.merging.firm import support_size
from fedunlearn.merging.selection import kth_largest

BIG = 3 * selection.CHUNK + 12_345  # above the direct-kthvalue size, several chunks


def _reference(x: torch.Tensor, k: int, magnitude: bool) -> torch.Tensor:
    v = (x.abs() if magnitude else x).reshape(-1)
    if bool((v[1:] < v[:-1]).all()):  # torch.kthvalue's quickselect is quadratic here
        return torch.sort(v).values[v.numel() - k]
    return torch.kthvalue(v, x.numel() - k + 1).values


def _ks(d: int) -> list[int]:
    return sorted({1, 2, 7, d // 100, d // 10, d // 5, d // 2, d - 3, d - 1, d} - {0})


def _check(x: torch.Tensor, magnitude: bool, ks: list[int] | None = None) -> None:
    for k in ks or _ks(x.numel()):
        got = kth_largest(x, k, magnitude=magnitude)
        want = _reference(x, k, magnitude)
        assert got.dtype == want.dtype and got.shape == ()
        assert torch.equal(got, want), (x.dtype, magnitude, k, got, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("magnitude", [False, True])
def test_random_tensors_match_kthvalue(dtype: torch.dtype, magnitude: bool) -> None:
    g = torch.Generator().manual_seed(0)
    normal = torch.randn(BIG, generator=g)
    _check(normal.to(dtype), magnitude)
    spread = (2.0 * torch.randn(BIG // 2, 3, generator=g)).exp_().mul_(1e-6)  # Fisher-like
    _check(spread.to(dtype), magnitude)
    _check(torch.randn(1000, generator=g).to(dtype), magnitude)  # small: direct path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: the histogram
@pytest.mark.parametrize("magnitude", [False, True])
def test_adversarial_tensors(magnitude: bool, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    d = BIG
    cases = {
        "all equal": torch.full((d,), 0.25),
        "all zero": torch.zeros(d),
        "few values": torch.randint(-3, 4, (d,), generator=g).float() / 4,
        "mostly zero": torch.where(
            torch.rand(d, generator=g) < 0.95, 0.0, torch.rand(d, generator=g)
        ),
        "signed zeros": torch.where(torch.rand(d, generator=g) < 0.5, -0.0, 0.0),
        "ascending": torch.arange(d, dtype=torch.float32),
        "descending": -torch.arange(d, dtype=torch.float32),
        "tiny": torch.rand(d, generator=g) * 1e-40,  # subnormal float32
        "huge": torch.randn(d, generator=g) * 1e38,
    }
    for name, x in cases.items():
        try:
            _check(x.to(dtype), magnitude)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None


def test_sample_that_misrepresents_the_tensor_falls_back_exactly() -> None:
    d = BIG
    step = max(1, d // selection._SAMPLE) | 1
    x = torch.arange(d, dtype=torch.float32)
    x[step // 2 :: step] = -1.0  # every sampled entry is the minimum
    bits = x.view(torch.int32).numpy()
    for k in (d // 10, d // 2):
        lo, hi = selection._bracket(bits, k, d, "signed")
        above, cand = selection._count_and_collect(bits, lo, hi, "signed")
        assert not above < k <= above + cand.size  # the bracket misses: the fallback runs
        assert torch.equal(kth_largest(x, k), _reference(x, k, False))
    assert torch.equal(kth_largest(x, 1), _reference(x, 1, False))


def test_non_contiguous_and_shaped_input() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(700, 600, generator=g).T  # a transposed view
    _check(x, magnitude=True, ks=[1, 4200, 42_000])
    _check(x, magnitude=False, ks=[1, 4200, 42_000])


def test_one_counting_pass_brackets_random_data() -> None:
    """On random data the sampled bracket holds the answer and only a few per cent of entries."""
    g = torch.Generator().manual_seed(3)
    x = (2.0 * torch.randn(BIG, generator=g)).exp_()
    bits = x.view(torch.int32).numpy()
    for k in (BIG // 10, BIG // 5, BIG // 2):
        lo, hi = selection._bracket(bits, k, BIG, "nonnegative")
        above, cand = selection._count_and_collect(bits, lo, hi, "nonnegative")
        assert above < k <= above + cand.size
        assert cand.size < 0.05 * BIG


def _decoded_topk(d: int, fraction: float, seed: int) -> torch.Tensor:
    """A Fisher as a top-k upload decodes it: its top ``fraction`` entries, zeros elsewhere."""
    f = (2.0 * torch.randn(d, generator=torch.Generator().manual_seed(seed))).exp_()
    kept = math.floor(fraction * d)
    return torch.where(f >= torch.kthvalue(f, d - kept + 1).values, f, 0.0)


@pytest.mark.parametrize("fraction", [0.1, 0.2])
def test_a_sparse_tensors_zeros_stay_out_of_the_bracket(fraction: float) -> None:
    """A decoded top-k Fisher (90 % zeros, its k-th largest the smallest kept entry or a zero):
    the bracket starts above the zeros, so one pass collects a few per cent of the entries,
    and the k-th largest is exact whether it lies in the bracket or among the zeros below."""
    x = _decoded_topk(BIG, fraction, seed=4)
    bits = x.view(torch.int32).numpy()
    kept = math.floor(fraction * BIG)
    for k in (kept // 2, kept, kept + 1, BIG // 2):
        lo, hi = selection._bracket(bits, k, BIG, "nonnegative")
        above, cand = selection._count_and_collect(bits, lo, hi, "nonnegative")
        assert lo >= 1 and cand.size < 0.05 * BIG
        assert torch.equal(kth_largest(x, k, nonnegative=True), _reference(x, k, False))
        streamed = selection.StreamedKthLargest(
            x[selection.sample_positions(BIG)], k, BIG, nonnegative=True
        )
        assert streamed.key_bounds()[0] >= 1
        native = kernels.bracket_counts([x], False, streamed.key_bounds())
        assert native[2].size < 0.05 * BIG  # the C pass keeps it (it gives up past 1/16)
        got = streamed.result_of_keys(lambda: x, native[1], native[2])
        assert torch.equal(got, _reference(x, k, False))


@pytest.mark.parametrize("magnitude", [False, True])
def test_streamed_selection_of_chunks_in_any_order_equals_kthvalue(magnitude: bool) -> None:
    """Counted slice by slice (in shuffled order, as threads may finish them) the streamed
    selection returns torch.kthvalue's value; a sample that misrepresents the tensor (here
    all zeros) falls back to selecting among every key and is still exact."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(BIG, generator=g).mul_(3.0)
    x[::97] = 0.0  # ties
    positions = selection.sample_positions(BIG)
    slices = [slice(a, min(a + 70_001, BIG)) for a in range(0, BIG, 70_001)]
    order = torch.randperm(len(slices), generator=g).tolist()
    for k in (1, BIG // 10, BIG // 2, BIG - 1):
        for sample in (x[positions], torch.zeros_like(x[positions])):
            streamed = selection.StreamedKthLargest(sample, k, BIG, magnitude=magnitude)
            counts = [streamed.count(x[slices[i]]) for i in order]
            got = streamed.result(x, counts)
            assert torch.equal(got, _reference(x, k, magnitude)), (k, magnitude)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_nonnegative_keys_match_kthvalue_with_zeros_and_negative_zeros(dtype: torch.dtype) -> None:
    """Fisher-like input (>= 0, a fifth zeros, some of them -0.0, ties): the bit patterns used
    as keys as they are give torch.kthvalue's value, in one pass and streamed (where the
    tensor is only made, through the callable, when the sample misses)."""
    g = torch.Generator().manual_seed(11)
    x = (2.0 * torch.randn(BIG, generator=g, dtype=torch.float64)).exp_().to(dtype)
    x[::5] = 0.0
    x[::15] = -0.0
    x[1::7] = x[1]  # ties away from zero
    positions = selection.sample_positions(BIG)
    for k in (1, BIG // 10, BIG // 2, BIG - BIG // 5 + 3, BIG):
        want = _reference(x, k, False)
        assert torch.equal(kth_largest(x, k, nonnegative=True), want), (dtype, k)
        for sample in (x[positions], torch.zeros_like(x[positions])):
            streamed = selection.StreamedKthLargest(sample, k, BIG, nonnegative=True)
            made: list[int] = []

            def whole(made: list[int] = made) -> torch.Tensor:
                made.append(1)
                return x

            got = streamed.result(
                whole, [streamed.count(x[a : a + 65_537]) for a in range(0, BIG, 65_537)]
            )
            assert got == want, (dtype, k)  # -0.0 == 0.0: either may come back
            if sample.abs().sum() > 0 and 1 < k < BIG:
                assert not made, "the sample held the answer; the whole tensor was not needed"


def test_errors() -> None:
    with pytest.raises(ValueError, match="k must be"):
        kth_largest(torch.zeros(0), 1)
    with pytest.raises(ValueError, match="k must be"):
        kth_largest(torch.zeros(5), 0)
    with pytest.raises(ValueError, match="k must be"):
        kth_largest(torch.zeros(5), 6)
    with pytest.raises(TypeError, match="floating"):
        kth_largest(torch.zeros(5, dtype=torch.int32), 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_below_turns_at_least_into_above(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5000, generator=g, dtype=dtype)
    x[:50] = 0.0
    x[50:60] = -0.0
    x[60:70] = torch.finfo(dtype).tiny / 4  # subnormal
    for thr in (0.0, float(x[60]), 0.5, float(x.abs()[100]), float(x[200])):
        t = torch.tensor(thr, dtype=dtype)
        lower = _chunks.below(t)
        kept = kernels.kept_above(x, torch.tensor(lower, dtype=dtype))
        assert torch.equal(kept, torch.where(x >= t, x, 0.0))
        assert torch.equal(x.abs() > lower, x.abs() >= t)
    assert _chunks.below(torch.tensor(-math.inf)) == -math.inf


# ------------------------------------------------ fused merges equal the whole-tensor formulas
def _clients(shape: tuple[int, ...], dtype: torch.dtype) -> list[ClientUpdate]:
    g = torch.Generator().manual_seed(5)
    roles = ["forget"] * 5 + ["retain"] * 2
    domains = ["bio", "bio", "cyber", "bio", "cyber", None, None]
    out = []
    for i, (role, domain) in enumerate(zip(roles, domains, strict=True)):
        tv = (torch.randn(shape, generator=g) * 1e-3).to(dtype)
        fisher = (2.0 * torch.randn(shape, generator=g)).exp_().mul_(1e-6).to(dtype)
        out.append(ClientUpdate(f"c{i}", role, domain, 10, {"w": tv}, {"w": fisher}))
    return out


def _dense_sparsify(f: torch.Tensor, alpha: float, eps0: float) -> torch.Tensor:
    normed = f / (f.max() + eps0)
    d, k = normed.numel(), support_size(normed.numel(), alpha)
    thr = torch.kthvalue(normed.reshape(-1), d - k + 1).values
    return torch.where(normed >= thr, normed, torch.zeros_like(normed))


def _dense_firm_base(ups: list[ClientUpdate], alpha: float, eps0: float) -> torch.Tensor:
    def mean(ts: list[torch.Tensor]) -> torch.Tensor:
        acc = torch.zeros_like(ts[0], dtype=torch.float32)
        for t in ts:
            acc.add_(t.float())
        return acc.div_(len(ts))

    def weighted(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        num = torch.zeros_like(pairs[0][1])
        den = torch.zeros_like(num)
        for ft, delta in pairs:
            num.add_(ft * delta)
            den.add_(ft)
        return num.div_(den.add_(eps0))

    forget_pairs = []
    for dom in ("bio", "cyber"):
        members = [u for u in ups if u.domain == dom]
        f_bar = mean([u.fisher["w"] for u in members])  # type: ignore[index]
        forget_pairs.append(
            (_dense_sparsify(f_bar, alpha, eps0), mean([u.task_vector["w"] for u in members]))
        )
    retain = [u for u in ups if u.role == "retain"]
    retain_pairs = [
        (_dense_sparsify(u.fisher["w"].float(), alpha, eps0), u.task_vector["w"].float())
        for u in retain
    ]  # type: ignore[index]
    return weighted(forget_pairs) + weighted(retain_pairs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_firm_base_equals_dense_formula(dtype: torch.dtype) -> None:
    ups = _clients((601, 700), dtype)  # 420 700 entries: several slices, sampled selection
    res = firm_merge(ups, alpha=0.1)
    expected = _dense_firm_base(ups, 0.1, 1e-8)
    assert res.delta["w"].dtype == dtype
    assert torch.equal(res.delta["w"], expected.to(dtype))
    rep = res.report["tensors"]["w"]
    assert rep["norm_base"] == pytest.approx(float(expected.double().norm()), rel=1e-12)
    assert rep["norm_final"] == pytest.approx(float(res.delta["w"].double().norm()), rel=1e-12)
    assert rep["support_fraction"] == int(torch.count_nonzero(res.delta["w"])) / expected.numel()


def _dense_ties(tensors: list[torch.Tensor], k: float) -> torch.Tensor:
    xs = [t.float().reshape(-1) for t in tensors]
    d = xs[0].numel()
    kept = support_size(d, k)
    trimmed = []
    for x in xs:
        thr = torch.kthvalue(x.abs(), d - kept + 1).values
        trimmed.append(torch.where(x.abs() >= thr, x, torch.zeros_like(x)))
    sign = torch.sign(sum(trimmed))
    num = torch.zeros(d)
    count = torch.zeros(d)
    for x in trimmed:
        agree = (torch.sign(x) != 0) & (torch.sign(x) == sign)
        num.add_(torch.where(agree, x, torch.zeros_like(x)))
        count.add_(agree.float())
    return torch.where(count > 0, num / count.clamp_min(1.0), torch.zeros_like(num))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_ties_and_fulm_equal_dense_formula(dtype: torch.dtype) -> None:
    ups = _clients((601, 700), dtype)
    forget = [u.task_vector["w"] for u in ups if u.role == "forget"]
    expected = _dense_ties(forget, 0.2).reshape(601, 700)
    merged, stats = ties_combine(forget, 0.2)
    assert torch.equal(merged, expected)
    assert stats["support_fraction"] == int(torch.count_nonzero(expected)) / expected.numel()
    assert torch.equal(ties_merge(ups, gamma=0.5).delta["w"], (expected * 0.5).to(dtype))
    everyone = fulm_merge(ups, threshold=-1.0)  # one cluster of all seven clients
    all_tvs = [u.task_vector["w"] for u in ups]
    assert torch.equal(everyone.delta["w"], _dense_ties(all_tvs, 0.3).reshape(601, 700).to(dtype))
