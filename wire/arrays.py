"""Model weights as Flower arrays, in the model's own dtype.

Flower's ``Array`` stores a NumPy ``.npy`` payload and a ``dtype`` string. NumPy has float32
and float16 but no bfloat16, so a bfloat16 weight travels as the ``.npy`` of its 16-bit
patterns (``uint16``) with ``dtype = "bfloat16"``: no widening to float32, half the bytes,
and the exact values. :func:`weight_array` builds such an array from a tensor and
:func:`array_tensor` reads any weight array back (float32 and float16 arrays are ordinary
NumPy arrays, as ``Array(ndarray)`` makes them).

Whoever reads a model weight from an ``ArrayRecord`` goes through :func:`array_tensor`
(``Array.numpy()`` would give a bfloat16 weight's bit patterns as integers).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

BF16 = "bfloat16"


def weight_array(tensor: torch.Tensor) -> Array:
    """``tensor`` (moved to the CPU) as a Flower array of its own dtype (see the module
    docstring for bfloat16)."""
    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.dtype != torch.bfloat16:
        return Array(tensor.numpy())
    bits = Array(tensor.view(torch.uint16).numpy())
    return Array(dtype=BF16, shape=bits.shape, stype=bits.stype, data=bits.data)


def array_tensor(array: Array) -> torch.Tensor:
    """The tensor of a weight array made by :func:`weight_array` or ``Array(ndarray)``."""
    values = array.numpy()
    if array.dtype != BF16:
        return torch.from_numpy(values)
    if values.dtype != np.uint16:
        raise ValueError(f"a bfloat16 array must hold uint16 bit patterns, not {values.dtype}")
    return torch.from_numpy(values).view(torch.bfloat16)


def weights_record(state: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """A state dict as an ArrayRecord of :func:`weight_array` (each weight in its dtype)."""
    return ArrayRecord({key: weight_array(value) for key, value in state.items()})
