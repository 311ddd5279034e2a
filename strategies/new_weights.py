"""The new global weights θ + η_srv·Δ, built as a merge hands over Δ one weight at a time.

A merge that accepts ``delta_out`` (every built-in one) writes each weight's merged update
into it as soon as that weight is done (``delta_out[key] = Δ_key``) instead of collecting
all of Δ in a dict. :class:`NewWeights` is that mapping on the server: for each weight it

* checks Δ_key (finite), adds ‖η·Δ_key‖² and ‖θ_key‖² to the norms the update-ratio check
  needs (``server.max-update-ratio``: ``fedunlearn.merging.sanity``),
* computes θ_key + η·Δ_key in float32, stored in θ_key's dtype (what ``apply_delta`` does),
  checks it (finite) and measures what that dtype rounds away (``applied_relative_error``),
* appends it to an unnamed temporary file and lets go of Δ_key.

So neither Δ nor the new weights are ever held whole: the server holds the global weights
plus one weight's Δ. Only when every weight passed do the new weights replace the old ones,
one at a time (:meth:`NewWeights.apply`); a round that fails leaves the global weights as
they were. The temporary file (the new values of the changed weights, in the model's dtype)
lives in the run's output folder and disappears when it is closed, or when the process ends.
"""

from __future__ import annotations

import io
import math
import tempfile
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import cast

import torch
from flwr.app import ArrayRecord

from fedunlearn.merging.sanity import ratio_problem
from wire.arrays import array_tensor, weight_array


class NewWeights(MutableMapping[str, torch.Tensor]):
    """Receives Δ weight by weight (``sink[key] = Δ_key``), see the module docstring.

    Parameters
    ----------
    arrays : ArrayRecord
        The global weights θ (any dtype :mod:`wire.arrays` writes); replaced by
        :meth:`apply`.
    server_lr : float
        η_srv in θ ← θ + η_srv·Δ.
    model_dtype : torch.dtype | None
        The dtype the weights are loaded into: measures ``applied_error``; None: not measured.
    folder : Path | None
        Where the temporary file goes (None: the system's temporary folder).
    """

    def __init__(
        self,
        arrays: ArrayRecord,
        *,
        server_lr: float = 1.0,
        model_dtype: torch.dtype | None = None,
        folder: Path | None = None,
    ) -> None:
        self._arrays = arrays
        self._lr = float(server_lr)
        self._model_dtype = model_dtype
        if folder is not None:
            Path(folder).mkdir(parents=True, exist_ok=True)
        self._file = cast(io.BufferedRandom, tempfile.TemporaryFile(dir=folder))  # noqa: SIM115 — closed by apply/close
        self._where: dict[str, tuple[int, torch.dtype, tuple[int, ...]]] = {}
        self._delta_problem: str | None = None  # the first non-finite Δ
        self._new_problem: str | None = None  # the first non-finite new weight
        self._update_sq = 0.0  # ‖η·Δ‖²
        self._weights_sq = 0.0  # ‖θ‖² over the weights Δ changes
        self._lost_sq = 0.0  # ‖(θ_new in model_dtype − θ) − η·Δ‖²
        self._delta_sq = 0.0  # ‖η·Δ‖² as the applied error divides it

    def __setitem__(self, key: str, delta: torch.Tensor) -> None:
        if key in self._where:
            raise KeyError(f"the merge handed over a delta for {key!r} twice")
        if key not in self._arrays:
            raise KeyError(f"merge produced a delta for {key!r}, which the model does not have")
        delta = delta.detach()
        if self._lr != 1.0:
            delta = self._lr * delta
        if self._delta_problem is None:
            self._delta_problem = _nonfinite(delta, key, "the merged update's")
        theta = array_tensor(self._arrays[key])
        delta64 = delta.to(torch.float64)
        self._update_sq += float(torch.linalg.vector_norm(delta64)) ** 2
        self._weights_sq += float(torch.linalg.vector_norm(theta.to(torch.float64))) ** 2
        new = (theta.float() + delta.float()).to(theta.dtype)
        if self._new_problem is None:
            self._new_problem = _nonfinite(new, key, "the new weights'")
        if self._model_dtype is not None:
            kept = new.to(self._model_dtype).double() - theta.double()
            self._lost_sq += float(((kept - delta64) ** 2).sum())
            self._delta_sq += float((delta64**2).sum())
        del delta, delta64, theta
        new = new.contiguous()
        self._where[key] = (self._file.tell(), new.dtype, tuple(new.shape))
        self._file.write(new.reshape(-1).view(torch.uint8).numpy().data)

    def problem(self, max_ratio: float) -> tuple[str | None, float]:
        """Why the new weights must not be applied (None: they may) and ‖η·Δ‖ / ‖θ‖, checked
        in the order ``merged_update_problem`` and then the new weights' check use."""
        if self._delta_problem is not None:
            return self._delta_problem, math.nan
        problem, ratio = ratio_problem(
            math.sqrt(self._update_sq), math.sqrt(self._weights_sq), max_ratio
        )
        return problem or self._new_problem, ratio

    def applied_error(self) -> float | None:
        """‖(θ_new in the model's dtype − θ) − η·Δ‖ / ‖η·Δ‖ (None without ``model_dtype``)."""
        if self._model_dtype is None:
            return None
        return math.sqrt(self._lost_sq / self._delta_sq) if self._delta_sq > 0 else 0.0

    def apply(self) -> None:
        """Replace the changed global weights by the new ones, one at a time, and close the
        temporary file."""
        for key, (offset, dtype, shape) in self._where.items():
            new = torch.empty(shape, dtype=dtype)
            self._file.seek(offset)
            buffer = new.reshape(-1).view(torch.uint8).numpy().data
            if self._file.readinto(buffer) != buffer.nbytes:
                raise OSError(f"the new value of {key!r} could not be read back")
            self._arrays[key] = weight_array(new)
            del new
        self.close()

    def close(self) -> None:
        """Drop the temporary file (the new weights with it)."""
        self._file.close()

    # a write-only mapping: Δ is not kept, so it cannot be read back
    def __getitem__(self, key: str) -> torch.Tensor:
        raise KeyError(f"the merged update of {key!r} was applied as it came and is not kept")

    def __delitem__(self, key: str) -> None:
        raise KeyError(f"the merged update of {key!r} cannot be taken back")

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def _nonfinite(t: torch.Tensor, key: str, what: str) -> str | None:
    finite = torch.isfinite(t)
    if bool(finite.all()):
        return None
    bad = int(finite.numel() - finite.sum())
    return f"{what} tensor {key!r} holds {bad} non-finite value(s) (NaN or inf)"
