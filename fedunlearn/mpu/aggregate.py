"""Harmonic denoising aggregation of MPU (SPEC §3 step 4).

Copy k returns an update which the server maps back, Δ̂_k = T_k⁻¹(Δ_k). To first order
Δ̂_k ≈ Δ*(θ) + J·α_k ε⁰_k, and since Σ_k ε⁰_k = 0, the weights w_k ∝ α_k⁻¹ cancel the noise term
exactly (and are the only linear weights that do)::

    Δ̄ = Σ_k α_k⁻¹ Δ̂_k / Σ_k α_k⁻¹ = S₁ / S₀.

:class:`HarmonicAggregator` streams this sum: it keeps only S₀ = Σ α_k⁻¹ and
S₁ = Σ α_k⁻¹ Δ̂_k, never the m updates themselves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

__all__ = ["HarmonicAggregator", "plain_mean"]


class HarmonicAggregator:
    """Streaming harmonic aggregate Δ̄ = S₁/S₀ with S₀ = Σ α_k⁻¹, S₁ = Σ α_k⁻¹ Δ̂_k.

    Args:
        accumulate_dtype: dtype of S₁ (float64 by default; float32 halves the memory).
        out_dtype: dtype of :meth:`result`; None keeps each tensor's dtype from the first
            :meth:`add`.
    """

    def __init__(
        self,
        accumulate_dtype: torch.dtype = torch.float64,
        out_dtype: torch.dtype | None = None,
    ) -> None:
        if accumulate_dtype not in (torch.float32, torch.float64):
            raise ValueError(f"accumulate_dtype must be float32 or float64, got {accumulate_dtype}")
        self._acc_dtype = accumulate_dtype
        self._out_dtype = out_dtype
        self._s0 = 0.0
        self._s1: dict[str, Tensor] = {}
        self._dtypes: dict[str, torch.dtype] = {}
        self._count = 0

    @property
    def count(self) -> int:
        """Number of copies added so far."""
        return self._count

    @property
    def s0(self) -> float:
        """S₀ = Σ_k α_k⁻¹ over the copies added so far."""
        return self._s0

    def add(self, delta_hat: Mapping[str, Tensor], alpha: float) -> None:
        """Accumulate one de-reparameterised update Δ̂_k with its noise scale α_k > 0."""
        alpha = float(alpha)
        if not math.isfinite(alpha) or alpha <= 0:
            raise ValueError(f"alpha must be finite and > 0, got {alpha}")
        if not delta_hat:
            raise ValueError("delta_hat is empty")
        if self._count:
            missing = sorted(set(self._s1) - set(delta_hat))
            extra = sorted(set(delta_hat) - set(self._s1))
            if missing:
                raise KeyError(f"update {self._count} lacks tensor {missing[0]!r}")
            if extra:
                raise KeyError(f"update {self._count} has unexpected tensor {extra[0]!r}")
            for name, t in delta_hat.items():
                if t.shape != self._s1[name].shape:
                    raise ValueError(
                        f"{name}: shape {tuple(t.shape)} != {tuple(self._s1[name].shape)} "
                        "of the first update"
                    )
        weight = 1.0 / alpha
        with torch.no_grad():
            for name, t in delta_hat.items():
                contrib = t.detach().to(self._acc_dtype) * weight
                if self._count == 0:
                    self._s1[name] = contrib
                    self._dtypes[name] = t.dtype
                else:
                    acc = self._s1[name]
                    acc.add_(contrib.to(acc.device))
        self._s0 += weight
        self._count += 1

    def result(self) -> dict[str, Tensor]:
        """Δ̄ = S₁ / S₀ (new tensors; the aggregator may keep accumulating afterwards)."""
        if self._count == 0:
            raise RuntimeError("no update was added")
        return {
            name: (acc / self._s0).to(
                self._dtypes[name] if self._out_dtype is None else self._out_dtype
            )
            for name, acc in self._s1.items()
        }


def plain_mean(deltas: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Unweighted mean of the updates (what MPU's harmonic weights improve on; for tests)."""
    if not deltas:
        raise ValueError("no updates to average")
    agg = HarmonicAggregator()
    for delta in deltas:
        agg.add(delta, 1.0)
    return agg.result()
