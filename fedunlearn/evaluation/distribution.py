"""Distances between two samples of per-question truth ratios (docs/algorithms.md, "Evaluation
metrics").

DP2Unlearning reports, next to the KS-test forget quality, how far the forget-set truth-ratio
distribution of an unlearned model lies from that of the retain-only reference model:
Jensen–Shannon divergence and Shannon-entropy difference of the two histograms (over common
bin edges) and the Wasserstein distance of the raw samples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy.spatial.distance import jensenshannon
from scipy.stats import entropy, ks_2samp, wasserstein_distance


def _as_sample(name: str, values: Sequence[float]) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64).reshape(-1)
    if array.size == 0:
        raise ValueError(f"{name} is empty: need at least one truth ratio")
    if not np.all(np.isfinite(array)):
        bad = array[~np.isfinite(array)][0]
        raise ValueError(f"{name} holds a non-finite value ({bad}); truth ratios must be finite")
    return array


def truth_ratio_distances(
    a: Sequence[float],
    b: Sequence[float],
    *,
    bins: int = 20,
    value_range: tuple[float, float] | None = None,
) -> dict[str, float]:
    """Distances between two truth-ratio samples ``a`` (e.g. the unlearned model) and ``b``
    (e.g. the retain-only reference).

    Both samples are binned into ``bins`` equal-width bins over the same edges: over
    ``value_range`` when given (every value must lie inside it), else over the range of both
    samples together. Returns

    * ``js_divergence``: Jensen–Shannon divergence of the two histograms in bits,
      ``jensenshannon(p, q, base=2) ** 2`` (scipy returns the distance, its square root);
      0 for equal histograms, 1 for disjoint ones;
    * ``wasserstein``: ``scipy.stats.wasserstein_distance`` of the raw samples (not binned);
    * ``entropy_difference``: Shannon entropy of a's histogram minus b's, in bits;
    * ``ks_pvalue``: p-value of the two-sample KS test (``scipy.stats.ks_2samp``), the forget
      quality when a and b are the forget-set truth ratios of unlearned and reference model.
    """
    sample_a = _as_sample("a", a)
    sample_b = _as_sample("b", b)
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ValueError(f"bins must be an int >= 1, got {bins!r}")
    both = np.concatenate([sample_a, sample_b])
    if value_range is None:
        low, high = float(both.min()), float(both.max())
    else:
        if len(value_range) != 2:
            raise ValueError(f"value_range must be (low, high), got {value_range!r}")
        low, high = float(value_range[0]), float(value_range[1])
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise ValueError(f"value_range must be finite with low < high, got {value_range!r}")
        outside = both[(both < low) | (both > high)]
        if outside.size:
            raise ValueError(
                f"{outside.size} value(s) lie outside value_range {value_range!r} "
                f"(e.g. {outside[0]}): widen the range or leave it to the data"
            )
    if low == high:  # all values equal: one bin of width 1 around them, as numpy does
        low, high = low - 0.5, high + 0.5
    edges = np.histogram_bin_edges(both, bins=bins, range=(low, high))
    p = np.histogram(sample_a, bins=edges)[0].astype(np.float64)
    q = np.histogram(sample_b, bins=edges)[0].astype(np.float64)
    p /= p.sum()
    q /= q.sum()
    js = float(jensenshannon(p, q, base=2) ** 2)
    if not math.isfinite(js):  # sqrt of a rounding-negative value for equal histograms
        js = 0.0
    return {
        "js_divergence": min(max(js, 0.0), 1.0),
        "wasserstein": float(wasserstein_distance(sample_a, sample_b)),
        "entropy_difference": float(entropy(p, base=2) - entropy(q, base=2)),
        "ks_pvalue": float(ks_2samp(sample_a, sample_b).pvalue),
    }
