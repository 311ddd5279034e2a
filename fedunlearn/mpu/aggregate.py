"""Harmonic denoising aggregation of MPU (docs/algorithms.md, "Client side, mapping back,
harmonic aggregation").

Copy k returns an update which the server maps back, Δ̂_k = T_k⁻¹(Δ_k). To first order
Δ̂_k ≈ Δ*(θ) + J·α_k ε⁰_k, and since Σ_k ε⁰_k = 0, the weights w_k ∝ α_k⁻¹ cancel the noise term
exactly (and are the only linear weights that do)::

    Δ̄ = Σ_k α_k⁻¹ Δ̂_k / Σ_k α_k⁻¹ = S₁ / S₀.

:class:`HarmonicAggregator` streams this sum: it keeps only S₀ = Σ α_k⁻¹ and
S₁ = Σ α_k⁻¹ Δ̂_k, never the m updates themselves.

:class:`HarmonicUpload` is one client's Δ̄ (or its Fisher, the plain mean of the mapped-back
copies' diagonals) as a read-only mapping computed one weight at a time from the m copies'
upload parts (:class:`UploadParts`: a reply's arrays or a memory-mapped file): asking for a
weight decodes it from every copy, maps it back with T_k⁻¹ and sums it, so a merge that walks
the weights holds about one dense tensor per client, never a client's whole update.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from torch import Tensor

from fedunlearn.upload_codec import decode_tensor, group_parts

from .reparam import LayerTransform, invert_delta, invert_fisher
from .uploads import map_back

__all__ = ["HarmonicAggregator", "HarmonicUpload", "UploadParts", "plain_mean"]


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


class UploadParts:
    """One uploaded record's flat parts (:mod:`fedunlearn.upload_codec` names) and how to read
    one part (``get_part``: a reply's arrays, or a memory-mapped file); :meth:`decode` gives a
    weight's dense tensor without keeping it."""

    def __init__(
        self,
        names: list[str],
        get_part: Callable[[str], Tensor],
        shapes: Mapping[str, tuple[int, ...]] | None = None,
    ) -> None:
        self.groups = group_parts(names)
        self._get_part = get_part
        self._shapes = shapes

    def keys(self) -> list[str]:
        """The weights, in upload order."""
        return list(self.groups)

    def decode(self, key: str, transform: Mapping[int, LayerTransform] | None = None) -> Tensor:
        """Weight ``key``'s dense tensor (``UploadFormatError`` if its parts do not decode);
        with ``transform`` T, a task vector's T⁻¹ — LoRA factors are mapped before they are
        multiplied out (:func:`.uploads.map_back`: r·(d_in + d_out) numbers instead of
        d_in·d_out), dense parts as :func:`.reparam.invert_delta` maps them."""
        form, names = self.groups[key]
        parts = {part: self._get_part(name) for part, name in names.items()}
        shape = None if self._shapes is None else self._shapes.get(key)
        if transform is None:
            return decode_tensor(key, form, parts, shape)
        if form == "factors":
            mapped = map_back({names[p]: t for p, t in parts.items()}, transform)
            return decode_tensor(key, form, {p: mapped[n] for p, n in names.items()}, shape)
        return invert_delta({key: decode_tensor(key, form, parts, shape)}, transform)[key]


class HarmonicUpload(Mapping[str, Tensor]):
    """One client's update from its m copies, one weight at a time (the module docstring).

    ``copies``: each copy's upload (all with the keys of the first); ``alphas``: α_1..α_m;
    ``transforms``: T_1..T_m, or None where the copies are not reparameterised (the clean and
    noised baselines); ``fisher``: False for the task vector, Δ̄ = S₁/S₀ in float32 exactly as
    :class:`HarmonicAggregator` forms it from the mapped-back copies, True for the Fisher,
    (Σ_k T_k⁻¹F_k) / m summed in float64 and returned in float32 (T⁻¹ of a diagonal:
    :func:`.reparam.invert_fisher`). ``on_seconds`` is told the seconds each weight took. The
    last weight computed is kept, so asking for it again (its dtype, then its values) computes
    it once.
    """

    def __init__(
        self,
        copies: Sequence[UploadParts],
        alphas: Sequence[float],
        transforms: Sequence[Mapping[int, LayerTransform]] | None,
        *,
        fisher: bool,
        on_seconds: Callable[[float], None] | None = None,
    ) -> None:
        if not copies or len(copies) != len(alphas):
            raise ValueError(f"{len(copies)} uploads for {len(alphas)} copies")
        if transforms is not None and len(transforms) != len(copies):
            raise ValueError(f"{len(transforms)} transforms for {len(copies)} copies")
        self.copies = list(copies)
        self.alphas = [float(a) for a in alphas]
        self.transforms = None if transforms is None else list(transforms)
        self.fisher = fisher
        self._keys = dict.fromkeys(copies[0].keys())
        self._on_seconds = on_seconds
        self._last: tuple[str, Tensor] | None = None

    def _mapped(self, key: str, k: int) -> Tensor:
        """Copy k's weight ``key`` in the server's coordinates."""
        if self.transforms is None:
            return self.copies[k].decode(key)
        if not self.fisher:
            return self.copies[k].decode(key, self.transforms[k])
        return invert_fisher({key: self.copies[k].decode(key)}, self.transforms[k])[key]

    def _compute(self, key: str) -> Tensor:
        if self.fisher:
            total: Tensor | None = None
            for k in range(len(self.copies)):
                mapped = self._mapped(key, k)
                total = mapped.double() if total is None else total.add_(mapped)
                del mapped
            assert total is not None
            return (total / len(self.copies)).float()
        aggregator = HarmonicAggregator(out_dtype=torch.float32)
        for k, alpha in enumerate(self.alphas):
            aggregator.add({key: self._mapped(key, k)}, alpha)
        return aggregator.result()[key]

    def __getitem__(self, key: str) -> Tensor:
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        if key not in self._keys:
            raise KeyError(key)
        self._last = None  # the previous weight is dropped before the next is computed
        started = time.perf_counter()
        tensor = self._compute(key)
        if self._on_seconds is not None:
            self._on_seconds(time.perf_counter() - started)
        self._last = (key, tensor)
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys
