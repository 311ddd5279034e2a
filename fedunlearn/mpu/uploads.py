"""Mapping a task-vector upload back from copy k's coordinates as it travels
(docs/algorithms.md, "Client side, mapping back, harmonic aggregation").

A client's task vector arrives as the flat parts of :mod:`fedunlearn.upload_codec`: a dense
``<key>``, or a LoRA adapter's ``<key>::lora_B`` (d_out × r), ``<key>::lora_A`` (r × d_in) and
``<key>::scaling`` (s), Δ_k = s·B@A. T_k acts on a weight as W ↦ L·W·Rᵀ with L on the rows and
R on the columns, each a permutation, a rotation of RoPE planes or an orthogonal map per head
(:mod:`.reparam`), so

    T_k⁻¹(s·B@A) = s·(L⁻¹B)@(A R⁻ᵀ):

the row inverse moves onto B and the column inverse onto A (:func:`.reparam.invert_lora`),
r·(d_in + d_out) numbers to map instead of d_in·d_out, and the parts stay factors.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from fedunlearn.upload_codec import group_parts, part_name

from .reparam import LayerTransform, invert_delta, invert_lora

__all__ = ["map_back"]


def map_back(
    parts: Mapping[str, Tensor], transforms: Mapping[int, LayerTransform]
) -> dict[str, Tensor]:
    """Δ̂_k = T_k⁻¹(Δ_k) of a task vector given as upload ``parts``, as parts of the same forms.

    Dense ``<key>`` parts are mapped as :func:`.reparam.invert_delta` maps them, factor parts
    on the factors (the module docstring); ``::scaling`` is unchanged. Decoding the result
    (:class:`fedunlearn.upload_codec.DecodedTensors`) gives T_k⁻¹ of the decoded input up to
    float rounding. A Fisher diagonal cannot be mapped in its compact forms (T⁻¹ of a diagonal
    mixes entries: :func:`.reparam.invert_fisher` on the dense tensor); ``ValueError`` for a
    part of another form, ``UploadFormatError`` for a malformed upload.
    """
    out: dict[str, Tensor] = {}
    for key, (form, names) in group_parts(list(parts)).items():
        if form == "dense":
            out[key] = invert_delta({key: parts[names["dense"]]}, transforms)[key]
        elif form == "factors":
            a, b = invert_lora(parts[names["lora_A"]], parts[names["lora_B"]], key, transforms)
            out[part_name(key, "lora_B")] = b
            out[part_name(key, "lora_A")] = a
            out[part_name(key, "scaling")] = parts[names["scaling"]]
        else:
            raise ValueError(
                f"{key}: a {form} upload is a Fisher diagonal's form; decode it and map it back "
                "with invert_fisher"
            )
    return out
