"""The C counting pass of the top-k selections: the same counts and keys as inductor's pass;
the kernel cache's ownership and permission checks."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedunlearn.merging import kernels, native, project_retention
from fedunlearn.merging._chunks import CHUNK
from fedunlearn.merging.firm import _kth_of_kept
from fedunlearn.merging.kernels import bracket_counts, mean_of
from fedunlearn.merging.pooled_topk import pooled_topk
from fedunlearn.upload_codec import pack_mask
from fedunlearn.upload_slices import TopkSlices

pytestmark = pytest.mark.skipif(
    native.library() is None, reason="no C compiler for the counting pass"
)


def _fishers(n: int, d: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    parts = [torch.randn(d, generator=gen).mul_(2).exp_().mul_(1e-6).to(dtype) for _ in range(n)]
    parts[0][:500] = 0.0
    parts[0][500:1000] = -0.0  # read as 0.0
    parts[-1][1000:3000] = parts[-1][3000]  # ties
    return parts


def _bounds(values: torch.Tensor, magnitude: bool, low: float, high: float) -> tuple[int, int]:
    keys = values.view(torch.int32).numpy()
    keys = keys & 0x7FFFFFFF if magnitude else np.maximum(keys, 0)
    ordered = np.sort(keys)
    return int(ordered[int(low * keys.size)]), int(ordered[int(high * keys.size)])


@pytest.mark.parametrize(
    "dtypes",
    [
        (torch.bfloat16,) * 3,
        (torch.float32,),
        (torch.bfloat16,),
        (torch.float32, torch.bfloat16),  # pooled across dtypes: widened first, as mean_of
    ],
)
@pytest.mark.parametrize("d", [300_001, 1 << 18])
def test_pooled_counts_equal_the_inductor_pass(
    monkeypatch: pytest.MonkeyPatch, dtypes: tuple[torch.dtype, ...], d: int
) -> None:
    monkeypatch.setattr(native, "SLICE", 1 << 16)  # several slices over the threads
    fishers = _fishers(len(dtypes), d, torch.float32, 3)
    parts = [p.to(dt) for p, dt in zip(fishers, dtypes, strict=True)]
    bounds = _bounds(mean_of(parts), False, 0.88, 0.90)
    counted = native.pooled_bracket_counts(parts, False, bounds)
    assert counted is not None
    top, above, keys = counted
    ref_top, ref_above, ref_keys = bracket_counts(parts, False, bounds, native=False)
    assert top.dtype == torch.float32 and torch.equal(top, ref_top)
    assert float(top) == float(mean_of(parts).max())
    assert above == ref_above == int((mean_of(parts).view(torch.int32) > bounds[1]).sum())
    assert keys.size > 0.01 * d
    np.testing.assert_array_equal(np.sort(keys), np.sort(ref_keys))


def test_magnitude_counts_equal_the_inductor_pass() -> None:
    x = torch.randn(500_003, generator=torch.Generator().manual_seed(5))
    x[:100] = -x[100:200]  # equal magnitudes of both signs
    bounds = _bounds(x, True, 0.7, 0.75)
    top, above, keys = bracket_counts([x], True, bounds)
    _, ref_above, ref_keys = bracket_counts([x], True, bounds, native=False)
    assert float(top) == 0.0 and above == ref_above
    np.testing.assert_array_equal(np.sort(keys), np.sort(ref_keys))


def test_a_bracket_over_most_entries_falls_back_to_the_inductor_pass() -> None:
    parts = _fishers(2, 400_000, torch.bfloat16, 9)
    bounds = _bounds(mean_of(parts), False, 0.0, 0.99)  # 99 % candidates: over the buffer
    assert native.pooled_bracket_counts(parts, False, bounds) is None
    top, above, keys = bracket_counts(parts, False, bounds)
    ref = mean_of(parts).view(torch.int32).clamp(min=0).numpy()
    assert above == int((ref > bounds[1]).sum())
    assert keys.size == int(((ref >= bounds[0]) & (ref <= bounds[1])).sum())
    assert float(top) == float(mean_of(parts).max())


def test_pooled_counts_of_decoded_slices_equal_those_of_the_decoded_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Compact forget uploads: their top-k Fishers decoded slice by slice inside the count."""
    monkeypatch.setattr(native, "SLICE", 1 << 18)  # several slices over the threads
    d = 700_001
    fishers = _fishers(2, d, torch.float32, 4)
    parts = [TopkSlices(pack_mask(f > 2e-6), f[f > 2e-6], d) for f in fishers]
    dense = [torch.where(f > 2e-6, f, 0.0) for f in fishers]
    bounds = _bounds(mean_of(dense), False, 0.93, 0.95)
    counted = native.pooled_bracket_counts(parts, False, bounds)
    assert counted is not None
    top, above, keys = counted
    ref_top, ref_above, ref_keys = bracket_counts(dense, False, bounds, native=False)
    assert torch.equal(top, ref_top) and above == ref_above and keys.size > 0.01 * d
    np.testing.assert_array_equal(np.sort(keys), np.sort(ref_keys))


@pytest.mark.parametrize("density", [0.0, 0.003, 0.1, 0.5, 1.0])
def test_unmasking_equals_boolean_indexing(density: float) -> None:
    """The C spreads (the vector loops where the CPU has AVX-512 or AVX2, a scalar tail) against
    torch's boolean indexing, with a length that leaves a tail of odd bits."""
    d = 300_013
    gen = torch.Generator().manual_seed(int(density * 1000))
    mask = torch.rand(d, generator=gen) < density
    values = torch.rand(int(mask.sum()), generator=gen) + 0.5
    want = torch.zeros(d)
    want[mask] = values
    packed = pack_mask(mask)
    out = torch.full((d,), float("nan"))
    assert native.unmask(packed, values, out) == values.numel()
    assert torch.equal(out, want)
    start = 8 * 4099  # a span from inside the mask, starting at the values its bits use
    first = int(mask[:start].sum())
    span = torch.full((d - start - 5,), float("nan"))
    assert native.unmask_span(packed, values, first, start, span) == int(mask[start:-5].sum())
    assert torch.equal(span, want[start:-5])
    picked = native.unmask_at(packed, values, first, start, slice(3, d - start, 1001))
    assert picked is not None and torch.equal(picked, want[start + 3 :: 1001])


@pytest.mark.parametrize("members", [1, 2, 3])
@pytest.mark.parametrize("density", [0.003, 0.1, 0.9])
def test_pooled_kept_values_are_the_decoded_mean_at_the_union_of_the_masks(
    monkeypatch: pytest.MonkeyPatch, members: int, density: float
) -> None:
    """A pooled domain of top-k uploads: the mean of the decoded Fishers (the merges' float32
    operations) at every entry some member kept, in entry order, from the masks and values
    alone; bits a mask sets past the tensor's end are not entries."""
    monkeypatch.setattr(native, "SLICE", 1 << 18)  # several spans written side by side
    d = 1_000_003
    gen = torch.Generator().manual_seed(members)
    fishers = [torch.rand(d, generator=gen) + 0.1 for _ in range(members)]
    masks = [torch.rand(d, generator=gen) < density for _ in range(members)]
    slices = [TopkSlices(pack_mask(m), f[m], d) for f, m in zip(fishers, masks, strict=True)]
    slices[0].kept().packed[-1] |= 0xF8  # past entry d - 1 (d % 8 = 3)
    pooled = native.pool_kept([s.kept() for s in slices], d)
    union = torch.stack(masks).any(dim=0)
    decoded = [torch.where(m, f, 0.0) for f, m in zip(fishers, masks, strict=True)]
    assert pooled is not None and torch.equal(pooled, mean_of(decoded)[union])


@pytest.mark.parametrize("members", [1, 2, 3])
@pytest.mark.parametrize("density", [0.0, 0.003, 0.1, 0.9])
def test_pooled_topk_slices_decode_the_mean_of_the_decoded_fishers(
    members: int, density: float
) -> None:
    """A pooled domain's Fisher decoded in one pass over the members' masks: bit for bit the
    mean of the members decoded one by one, for spans from a chunk's start, from inside a
    chunk, across chunks, to the odd end, and a strided sample; its kept values and the k-th
    largest of them as the merge's selection finds them."""
    d = 3 * CHUNK + 1_003
    gen = torch.Generator().manual_seed(10 + members)
    fishers = [torch.rand(d, generator=gen) + 0.1 for _ in range(members)]
    masks = [torch.rand(d, generator=gen) < density for _ in range(members)]
    slices = [TopkSlices(pack_mask(m), f[m], d) for f, m in zip(fishers, masks, strict=True)]
    want = mean_of([torch.where(m, f, 0.0) for f, m in zip(fishers, masks, strict=True)])
    pooled = pooled_topk(slices)
    assert pooled is not None
    for start, stop in [(0, CHUNK), (8 * 4099, 8 * 4099 + 77), (CHUNK - 8, 2 * CHUNK + 5),
                        (3 * CHUNK, d), (d - 3, d)]:  # fmt: skip
        assert torch.equal(pooled.slices[start:stop], want[start:stop]), (start, stop)
    assert torch.equal(pooled.slices[5::997], want[5::997])
    union = torch.stack(masks).any(dim=0)
    assert torch.equal(pooled.kept, want[union])
    n = pooled.kept.numel()
    for k in sorted({1, n // 3, n - 1} & set(range(1, n))):  # the merge asks for k < n here
        expected = torch.kthvalue(pooled.kept, n - k + 1).values
        assert torch.equal(_kth_of_kept(pooled.kept, k), expected), k


def test_a_domain_with_a_dense_member_is_not_pooled_from_masks() -> None:
    d = 4_000
    mask = torch.rand(d, generator=torch.Generator().manual_seed(0)) < 0.1
    topk = TopkSlices(pack_mask(mask), torch.ones(int(mask.sum())), d)
    assert pooled_topk([topk, torch.rand(d)]) is None


def test_unsupported_inputs_are_left_to_the_caller() -> None:
    half = [torch.rand(1000, dtype=torch.float16)]
    assert not native.supported(half, False)
    assert not native.supported([torch.rand(10), torch.rand(11)], False)
    assert not native.supported([torch.rand(10).bfloat16()], True)  # histogrammed
    assert native.pooled_bracket_counts(half, False, (0, 1)) is None


_LOAD = (
    "from fedunlearn.merging import native as n; import sys; "
    "sys.exit(0 if n.library() is not None else 3)"
)


def test_two_processes_build_the_library_at_once(tmp_path: Path) -> None:
    env = {**os.environ, "FEDUNLEARN_CACHE_DIR": str(tmp_path)}
    racers = [subprocess.Popen([sys.executable, "-c", _LOAD], env=env) for _ in range(2)]
    assert [r.wait(timeout=120) for r in racers] == [0, 0]
    built = sorted(p.name for p in (tmp_path / "kernels").iterdir())
    assert len(built) == 1 and built[0].startswith("merge-loops-") and built[0].endswith(".so")
    mtime = (tmp_path / "kernels" / built[0]).stat().st_mtime_ns
    assert subprocess.run([sys.executable, "-c", _LOAD], env=env).returncode == 0
    assert (tmp_path / "kernels" / built[0]).stat().st_mtime_ns == mtime  # reused, not rebuilt


def _problem(d: int, m: int, dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    base = torch.randn(d, generator=gen).to(dtype)
    base[::7] = 0.0
    fishers = []
    for _ in range(m):
        f = torch.randn(d, generator=gen).mul_(2).exp_()
        f = torch.where(f > f.quantile(0.9), f / f.max(), torch.zeros(()))  # top-10 % kept
        fishers.append(f.to(dtype))
    return base, fishers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3])
def test_support_gather_equals_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, m: int
) -> None:
    monkeypatch.setattr(native, "SLICE", 1 << 16)
    d = 300_007  # slices of 2^16 and a tail that is not a multiple of 16
    base, fishers = _problem(d, m, dtype)
    gathered = native.gather_support(base, fishers)
    assert gathered is not None
    idx, values, cols, bad = gathered
    keep = (torch.stack(fishers).sum(0) != 0) & (base != 0)
    expected = torch.nonzero(keep).squeeze(1)
    assert bad == [] and 0 < idx.numel() < d
    assert torch.equal(idx, expected)
    assert values.dtype == torch.float32 and torch.equal(values, base[expected].float())
    for col, f in zip(cols, fishers, strict=True):
        assert torch.equal(col, f[expected].float())


@pytest.mark.parametrize("poison", [-1e-3, float("inf"), float("nan")])
@pytest.mark.parametrize("at", [100_001, 99_999])
def test_support_gather_names_the_bad_fisher(poison: float, at: int) -> None:
    base, fishers = _problem(100_003, 3, torch.float32)
    # one slice of 100_003 entries: with AVX-512 the vector loop reads 16 at a time up to
    # entry 100_000 and the scalar tail the last three; without it the scalar loop reads all
    assert native.SLICE > 100_003 and 100_003 // 16 * 16 == 100_000
    fishers[1][at] = poison  # 100_001: the scalar tail; 99_999: the vector loop's last block
    fishers[2][12_345] = poison  # the vector loop
    gathered = native.gather_support(base, fishers)
    assert gathered is not None and gathered[3] == [1, 2]


@pytest.mark.parametrize("mode", ["eager", "compiled"])  # compiled: the C pass checks them
def test_projection_refuses_a_bad_fisher_in_either_pass(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    monkeypatch.setenv(kernels.MODE_ENV, mode)
    base, fishers = _problem(50_000, 3, torch.float32)
    fishers[2][40_000] = float("nan")
    with pytest.raises(ValueError, match=r"retain Fisher #2 must be finite and non-negative"):
        project_retention(base, fishers, 1e-3)


# ---- the kernel cache: only a private library is loaded -----------------------------------


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A kernel cache built once, under a umask that would leave the library group-writable."""
    root = tmp_path_factory.mktemp("kernel-cache")
    compiler = native._compiler()
    assert compiler is not None
    old_env, old_umask = os.environ.get("FEDUNLEARN_CACHE_DIR"), os.umask(0o002)
    os.environ["FEDUNLEARN_CACHE_DIR"] = str(root)
    try:
        native._build(compiler)
    finally:
        os.umask(old_umask)
        if old_env is None:
            del os.environ["FEDUNLEARN_CACHE_DIR"]
        else:
            os.environ["FEDUNLEARN_CACHE_DIR"] = old_env
    return root


@pytest.fixture
def cache(built_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private copy of the built cache for one test; ``$FEDUNLEARN_CACHE_DIR`` points at it."""
    root = tmp_path / "cache"
    shutil.copytree(built_cache, root)
    monkeypatch.setenv("FEDUNLEARN_CACHE_DIR", str(root))
    return root


def _library(root: Path) -> Path:
    (library,) = (root / "kernels").glob("merge-loops-*.so")
    return library


def test_the_cache_is_created_private(built_cache: Path) -> None:
    folder, library = built_cache / "kernels", _library(built_cache)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(library.stat().st_mode) == 0o700  # not 0775 under umask 002
    assert folder.stat().st_uid == library.stat().st_uid == os.getuid()


def test_a_private_library_is_reused(cache: Path) -> None:
    library = _library(cache)
    mtime = library.stat().st_mtime_ns
    compiler = native._compiler()
    assert compiler is not None
    assert native._build(compiler) == library and library.stat().st_mtime_ns == mtime


@pytest.mark.parametrize(
    ("target", "mode", "problem"),
    [
        ("library", 0o770, "is writable by its group (mode 0770)"),
        ("library", 0o702, "is writable by others (mode 0702)"),
        ("folder", 0o777, "is writable by its group and others (mode 0777)"),
        ("folder", 0o730, "is writable by its group (mode 0730)"),
    ],
)
def test_a_cache_others_can_write_is_refused(
    cache: Path, target: str, mode: int, problem: str
) -> None:
    path = _library(cache) if target == "library" else cache / "kernels"
    path.chmod(mode)
    compiler = native._compiler()
    assert compiler is not None
    with pytest.raises(native.KernelCacheError) as refused:
        native._build(compiler)
    message = str(refused.value)
    assert f"{target} {path}" in message and problem in message


def test_a_cache_of_another_user_is_refused(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real files keep their owner; the process claims to be someone else."""
    owner = os.getuid()
    monkeypatch.setattr(native.os, "getuid", lambda: owner + 1)
    compiler = native._compiler()
    assert compiler is not None
    folder, library = cache / "kernels", _library(cache)
    with pytest.raises(native.KernelCacheError) as refused:
        native._build(compiler)
    assert f"folder {folder}: it belongs to user id {owner}, not to this user" in str(refused.value)
    with pytest.raises(native.KernelCacheError, match=f"belongs to user id {owner}, not"):
        native.check_private(library, "library")


def test_a_linked_library_is_refused(cache: Path, tmp_path: Path) -> None:
    library = _library(cache)
    elsewhere = tmp_path / "elsewhere.so"
    shutil.copy2(library, elsewhere)
    library.unlink()
    library.symlink_to(elsewhere)
    compiler = native._compiler()
    assert compiler is not None
    with pytest.raises(native.KernelCacheError, match="is not a regular file"):
        native._build(compiler)


def test_library_refuses_rather_than_loads(cache: Path) -> None:
    _library(cache).chmod(0o777)
    native.library.cache_clear()  # the process's own library is loaded again after the test
    try:
        with pytest.raises(native.KernelCacheError, match="writable by its group and others"):
            native.library()
    finally:
        native.library.cache_clear()
