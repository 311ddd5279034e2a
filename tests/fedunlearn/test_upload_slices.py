"""Compact uploads decoded slice by slice: every span, bit for bit the whole decode."""

from __future__ import annotations

import pytest
import torch

from fedunlearn import upload_slices
from fedunlearn.merging import native
from fedunlearn.merging._chunks import CHUNK
from fedunlearn.merging.lazy import FlatSlices, flat_source
from fedunlearn.upload_codec import (
    DecodedTensors,
    LowRankDelta,
    UploadFormatError,
    encode_fisher,
    encode_task_vector,
)
from fedunlearn.upload_slices import FactorSlices, scales_exactly

# 3 chunks and a short one; the chunk bounds fall inside rows (1000 does not divide CHUNK)
SHAPE = (800, 1000)


def _uploads(fraction: float) -> tuple[DecodedTensors, DecodedTensors]:
    g = torch.Generator().manual_seed(3)
    rows, cols = SHAPE
    tv = {
        "w": LowRankDelta(torch.randn(rows, 8, generator=g), torch.randn(8, cols, generator=g), 0.5)
    }
    fisher = {"w": torch.randn(SHAPE, generator=g).mul_(2).exp_()}
    shapes = {"w": SHAPE}
    return (
        DecodedTensors.from_parts(encode_task_vector(tv, "factors"), shapes),
        DecodedTensors.from_parts(encode_fisher(fisher, "topk", fraction), shapes),
    )


SPANS = [
    slice(0, CHUNK),
    slice(CHUNK, 2 * CHUNK),
    slice(3 * CHUNK, 800_000),  # the last, short chunk
    slice(8, 24),  # inside one row
    slice(CHUNK - 992, CHUNK + 2008),  # across a chunk bound, inside rows
    slice(0, 800_000),
    slice(0, 800_000, 4097),  # a selection's strided sample
    slice(2048, None, 777),
    slice(5, 800_000, 3),  # several positions in one mask byte
]


@pytest.mark.parametrize("path", ["native", "numpy"])
@pytest.mark.parametrize("fraction", [0.1, 0.003])
def test_every_span_decodes_bit_for_bit_like_the_whole_tensor(monkeypatch, path, fraction):
    if path == "numpy":
        monkeypatch.setattr(native, "library", lambda: None)  # where no C compiler is found
    elif native.library() is None:
        pytest.skip("no C compiler for the native decode")
    task_vector, fisher = _uploads(fraction)
    for mapping in (task_vector, fisher):
        whole = mapping["w"].reshape(-1).clone()
        sliced = flat_source(mapping, "w")
        assert isinstance(sliced, FlatSlices)
        assert sliced.numel() == whole.numel() and sliced.reshape(-1) is sliced
        for span in SPANS:
            assert torch.equal(sliced[span], whole[span]), span
    assert int(torch.count_nonzero(fisher["w"])) == fisher.kept_values("w").numel()


def test_a_dense_weight_is_read_as_the_tensor():
    tensors = {"w": torch.ones(4, 4)}
    mapping = DecodedTensors.from_parts(tensors)
    assert mapping.flat_slices("w") is None
    assert flat_source(mapping, "w") is tensors["w"]
    assert flat_source(tensors, "w") is tensors["w"]


def test_a_bad_compact_upload_is_refused_when_its_slices_are_made():
    task_vector, fisher = _uploads(0.1)
    parts = {name: t for name, t in fisher.parts()}
    values = next(n for n in parts if n.endswith("topk_value"))
    parts[values] = parts[values][:-1]  # one value fewer than the mask marks
    with pytest.raises(UploadFormatError, match="mask marks .* values were sent"):
        DecodedTensors.from_parts(parts, {"w": SHAPE}).flat_slices("w")
    wrong = DecodedTensors.from_parts(dict(task_vector.parts()), {"w": (1000, 800)})
    with pytest.raises(UploadFormatError, match=r"shape \(800, 1000\) but the global weight"):
        wrong.flat_slices("w")


def _factors(seed: int, spread: float, rows: int = 300, cols: int = 700, rank: int = 16):
    """LoRA factors whose magnitudes span ``spread`` decades either side of 1 (signs mixed)."""
    g = torch.Generator().manual_seed(seed)

    def factor(*shape: int) -> torch.Tensor:
        magnitude = torch.randn(*shape, generator=g).mul_(spread * 2.3).exp_()
        return magnitude * torch.randn(*shape, generator=g).sign()

    return factor(rows, rank), factor(rank, cols)


@pytest.mark.parametrize(
    ("scaling", "spread", "shift", "prescaled"),
    [
        (0.5, 1.0, 0, True),
        (2.0, 2.0, 0, True),  # magnitudes from about 1e-8 to 1e8
        (0.25, 0.5, -20, True),
        (0.3, 1.0, 0, False),  # not a power of two
        (2.0, 1.0, -60, False),  # products near float32's subnormal range
        (1.0, 1.0, 0, False),  # nothing to apply
    ],
)
def test_a_power_of_two_scaling_applied_to_a_gives_the_same_bits(
    monkeypatch, scaling, spread, shift, prescaled
):
    """B @ (A·s) where that is exactly (B @ A)·s (:func:`scales_exactly`), else the product
    scaled entry by entry: the decoded slices equal ``LowRankDelta.dense()`` bit for bit."""
    monkeypatch.setattr(upload_slices, "PRESCALE_MIN_ENTRIES", 0)  # these weights are small
    for seed in range(3):
        b, a = _factors(seed, spread)
        b = b * 2.0**shift
        assert scales_exactly(b, a, scaling) is prescaled or scaling == 1.0
        want = LowRankDelta(b, a, scaling).dense().reshape(-1)
        sliced = FactorSlices(b, a, scaling)
        for span in (slice(0, want.numel()), slice(8, 5000), slice(700 * 37, 700 * 290 + 13)):
            assert torch.equal(sliced[span], want[span]), (seed, span)


def test_zero_factors_scale_exactly():
    assert scales_exactly(torch.zeros(4, 2), torch.randn(2, 3), 0.5)
    assert not scales_exactly(torch.ones(4, 2), torch.full((2, 3), 2.0**-80), 0.5)
    assert not scales_exactly(torch.full((4, 2), 2.0**60), torch.full((2, 3), 2.0**60), 2.0)
