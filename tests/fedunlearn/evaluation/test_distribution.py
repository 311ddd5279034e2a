"""Truth-ratio distribution distances on inputs whose answers can be worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedunlearn.evaluation.distribution import truth_ratio_distances


def test_identical_samples_are_at_distance_zero() -> None:
    sample = [0.1, 0.4, 0.4, 0.7, 0.95, 0.3]
    out = truth_ratio_distances(sample, list(reversed(sample)))
    assert set(out) == {"js_divergence", "wasserstein", "entropy_difference", "ks_pvalue"}
    assert out["js_divergence"] == pytest.approx(0.0, abs=1e-12)
    assert out["wasserstein"] == pytest.approx(0.0, abs=1e-12)
    assert out["entropy_difference"] == pytest.approx(0.0, abs=1e-12)
    assert out["ks_pvalue"] == pytest.approx(1.0)


def test_two_point_masses() -> None:
    out = truth_ratio_distances([0.2] * 3, [0.7] * 3)
    assert out["js_divergence"] == pytest.approx(1.0)  # disjoint histograms: 1 bit
    assert out["wasserstein"] == pytest.approx(0.5)  # |0.2 − 0.7|
    assert out["entropy_difference"] == pytest.approx(0.0)  # both histograms one-hot
    assert out["ks_pvalue"] == pytest.approx(0.1)  # exact: 2 / C(6, 3)


def test_half_and_half_against_a_point_mass() -> None:
    """Two bins over [0, 1]: p = (1/2, 1/2), q = (1, 0), m = (3/4, 1/4);
    JS = H(m) − (H(p) + H(q))/2 = H(3/4, 1/4) − 1/2, ΔH = 1 − 0 bit, W = 1/2."""
    out = truth_ratio_distances([0.0, 1.0], [0.0, 0.0], bins=2, value_range=(0.0, 1.0))
    h_m = -(0.75 * math.log2(0.75) + 0.25 * math.log2(0.25))
    assert out["js_divergence"] == pytest.approx(h_m - 0.5, rel=1e-12)
    assert out["entropy_difference"] == pytest.approx(1.0, rel=1e-12)
    assert out["wasserstein"] == pytest.approx(0.5, rel=1e-12)
    swapped = truth_ratio_distances([0.0, 0.0], [0.0, 1.0], bins=2, value_range=(0.0, 1.0))
    assert swapped["js_divergence"] == pytest.approx(out["js_divergence"])  # symmetric
    assert swapped["entropy_difference"] == pytest.approx(-1.0)


def test_common_edges_and_value_range() -> None:
    # Without a common range the two samples would each fill "their" bins identically.
    out = truth_ratio_distances([0.0, 0.1], [0.9, 1.0], bins=4)
    assert out["js_divergence"] == pytest.approx(1.0)
    # All values in one bin of the given range: histograms equal, raw samples still differ.
    out = truth_ratio_distances([0.1, 0.2], [0.3, 0.4], bins=1, value_range=(0.0, 1.0))
    assert out["js_divergence"] == pytest.approx(0.0, abs=1e-12)
    assert out["wasserstein"] == pytest.approx(0.2)
    # numpy arrays and a single shared value work as well
    out = truth_ratio_distances(np.array([0.5]), np.array([0.5]))
    assert out["js_divergence"] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize(
    ("a", "b", "kwargs", "match"),
    [
        ([], [0.5], {}, "a is empty"),
        ([0.5], [], {}, "b is empty"),
        ([0.5, math.nan], [0.5], {}, "non-finite"),
        ([0.5], [math.inf], {}, "non-finite"),
        ([0.5], [0.6], {"bins": 0}, "bins"),
        ([0.5], [0.6], {"value_range": (1.0, 0.0)}, "value_range"),
        ([0.5], [1.6], {"value_range": (0.0, 1.0)}, "outside"),
    ],
)
def test_bad_input_is_refused(a, b, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        truth_ratio_distances(a, b, **kwargs)
