"""Compact uploads: how a client's task vector Δθ and Fisher diagonal F̂ travel as tensors.

A client's summary is one task vector and one Fisher diagonal per adapted weight.
Sent dense in float32 that is 8 bytes per weight entry; this module encodes each weight's
pair more compactly as a flat ``{part name: tensor}`` dict (what a Flower ArrayRecord or a
safetensors file holds) and decodes it back to dense tensors one weight at a time.

Task-vector forms (``upload.task-vector``):

* ``dense``: ``<key>`` holds Δθ itself;
* ``factors``: a LoRA adapter's ``<key>::lora_B`` (d_out × r), ``<key>::lora_A`` (r × d_in)
  and ``<key>::scaling`` (s, one number): Δθ = (B @ A) · s, computed exactly as PEFT computes
  the adapter's delta weight, so the dense tensor is bit-for-bit the one a dense upload holds
  (float32 on the CPU). r·(d_in + d_out) numbers instead of d_in·d_out.

Fisher forms (``upload.fisher``):

* ``dense``: ``<key>`` holds F̂ in float32;
* ``bf16``: ``<key>::bf16`` holds F̂ rounded to bfloat16, as its 16-bit patterns (Flower's
  arrays have no bfloat16); relative error ≤ 2⁻⁸ per entry;
* ``topk``: ``<key>::topk_mask`` marks the entries ≥ the k'-th largest (k' = max(1, ⌊α'·d⌋),
  ties kept, zeros never): one bit per entry packed into bytes, then deflated (zlib; at
  α' = 0.1 about half a bit per entry instead of one); ``<key>::topk_value`` holds their values
  in float32, in index order; every other entry decodes as 0. The mask is inflated to at most
  its expected size (one bit per entry), so a crafted stream cannot expand further. The
  server's spool (``strategies.upload_spool``) keeps it inflated, as ``<key>::topk_bits``
  (the packed bytes themselves), so a merge reads it without inflating it again.
  For a client whose own top-α FIRM uses (a retain client, or the only forget client of its
  domain) this is exact whenever α' ≥ α: the maximum, the k-th largest value and every kept
  entry are unchanged, and every dropped entry lies below FIRM's threshold.

:class:`DecodedTensors` is a read-only ``Mapping[str, Tensor]`` over the parts (a dict or a
memory-mapped safetensors file) that rebuilds one weight's dense tensor when it is asked for
and keeps only the last one, so a merge that walks the weights one at a time holds one dense
tensor per client. It rebuilds into the memory of the previous one once nothing else refers
to that (fresh memory costs a page fault per 4 KiB, more than the decoding itself), and tells
a weight's shape and dtype without decoding it (:meth:`DecodedTensors.describe`).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from fedunlearn.merging import native
from fedunlearn.merging.lazy import FlatSlices
from fedunlearn.options import FRACTION, OneOf, option, option_group
from fedunlearn.upload_slices import FactorSlices, TopkSlices

TASK_VECTOR_UPLOADS: tuple[str, ...] = ("dense", "factors")
FISHER_UPLOADS: tuple[str, ...] = ("dense", "bf16", "topk")


@option_group("upload")
@dataclass(frozen=True)
class UploadOptions:
    """What a client uploads and how the server receives it (``[tool.flwr.app.config.upload]``)."""

    task_vector: str = option(
        "factors",
        "factors: a LoRA client uploads B, A and s instead of s·B@A (decoded bit for bit); "
        "dense: float32 s·B@A (full fine-tuning always uploads dense)",
        OneOf(lambda: TASK_VECTOR_UPLOADS),
    )
    fisher: str = option(
        "topk",
        "topk: each Fisher tensor's top fisher-fraction entries (ties kept); bf16; or dense "
        "float32",
        OneOf(lambda: FISHER_UPLOADS),
    )
    fisher_fraction: float = option(
        0.1, "α' of the topk Fisher upload; at least firm.alpha with FIRM", FRACTION
    )
    stream: bool = option(
        True,
        "the server writes every validated upload to <output-dir>/uploads-spool/ and merges "
        "from memory maps one weight at a time; false: uploads stay in memory",
    )


SEP = "::"
_FACTOR_PARTS = ("lora_B", "lora_A", "scaling")
_PART_FORMS = {
    "lora_B": "factors",
    "lora_A": "factors",
    "scaling": "factors",
    "bf16": "bf16",
    "topk_mask": "topk",
    "topk_bits": "topk",
    "topk_value": "topk",
}
_FORM_PARTS = {"factors": _FACTOR_PARTS, "bf16": ("bf16",), "topk": ("topk_value",)}
#: Parts of which a form needs exactly one: the top-k mask deflated (as sent) or inflated.
_ONE_OF = {"topk": ("topk_mask", "topk_bits")}
#: zlib level of the top-k mask: 6 (zlib's default) packs a 10 % mask to about half a bit per
#: entry (iid 10 % masks: 0.57 bits; correlated ones less); level 9 gains 1–4 % at 3–10× the time
MASK_DEFLATE_LEVEL = 6
_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


class UploadFormatError(ValueError):
    """An upload's parts cannot be decoded; ``key`` names the weight, the message the problem."""

    def __init__(self, key: str, problem: str) -> None:
        self.key, self.problem = key, problem
        super().__init__(f"tensor {key!r}: {problem}")


@dataclass(frozen=True)
class LowRankDelta:
    """A LoRA task vector Δθ = (B @ A) · s kept as its factors.

    Attributes: ``lora_B`` (d_out × r), ``lora_A`` (r × d_in), ``scaling`` (s = lora_alpha / r).
    """

    lora_B: torch.Tensor
    lora_A: torch.Tensor
    scaling: float

    def dense(self) -> torch.Tensor:
        """Δθ in float32, computed as PEFT's ``get_delta_weight`` does."""
        return (self.lora_B.float() @ self.lora_A.float()) * self.scaling


def part_name(key: str, part: str) -> str:
    """The flat name of ``part`` of weight ``key`` (``"<key>::<part>"``)."""
    return f"{key}{SEP}{part}"


# ---- encoding (client side) ----------------------------------------------------------------


def encode_task_vector(
    task_vector: Mapping[str, torch.Tensor | LowRankDelta], form: str
) -> dict[str, torch.Tensor]:
    """Flat parts of a task vector in ``form`` (``dense`` or ``factors``).

    ``factors`` needs :class:`LowRankDelta` values (LoRA); dense tensors (full fine-tuning)
    are always sent dense. ``dense`` turns factors into their dense float32 product.
    """
    if form not in TASK_VECTOR_UPLOADS:
        raise ValueError(f"upload.task-vector must be one of {TASK_VECTOR_UPLOADS}, got {form!r}")
    parts: dict[str, torch.Tensor] = {}
    for key, value in task_vector.items():
        if isinstance(value, LowRankDelta) and form == "factors":
            parts[part_name(key, "lora_B")] = value.lora_B.float().contiguous()
            parts[part_name(key, "lora_A")] = value.lora_A.float().contiguous()
            parts[part_name(key, "scaling")] = torch.tensor([value.scaling], dtype=torch.float32)
        elif isinstance(value, LowRankDelta):
            parts[key] = value.dense().contiguous()
        else:
            parts[key] = value.contiguous()
    return parts


def kept_threshold(values: torch.Tensor, fraction: float) -> torch.Tensor:
    """The k'-th largest entry of ``values`` (k' = max(1, ⌊fraction·d⌋), at most d)."""
    d = values.numel()
    k = min(d, max(1, math.floor(fraction * d * (1.0 + 1e-9))))
    return torch.kthvalue(values.reshape(-1).float(), d - k + 1).values


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """A boolean tensor as bytes, eight entries per byte (entry i → bit i % 8 of byte i // 8)."""
    flat = mask.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return (flat.view(-1, 8) * _BITS).sum(dim=1, dtype=torch.uint8)


def unpack_mask(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The boolean entries :func:`pack_mask` packed (the first ``numel`` of them)."""
    bits = packed.reshape(-1, 1).bitwise_and(_BITS).ne(0)
    return bits.reshape(-1)[:numel]


def deflate_mask(packed: torch.Tensor) -> torch.Tensor:
    """Packed mask bytes (:func:`pack_mask`) compressed with zlib, as a uint8 tensor."""
    return _uint8(zlib.compress(packed.contiguous().numpy().tobytes(), MASK_DEFLATE_LEVEL))


def _uint8(data: bytes) -> torch.Tensor:
    """``data`` as a 1-d uint8 tensor (of its own copy; empty data gives an empty tensor)."""
    return (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.zeros(0, dtype=torch.uint8)
    )


def inflate_mask(key: str, deflated: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` packed mask bytes :func:`deflate_mask` compressed; any other outcome (not
    uint8, not a complete zlib stream, more or fewer bytes, data after the stream) is an
    :class:`UploadFormatError` naming ``key``."""
    if deflated.dtype != torch.uint8 or deflated.dim() != 1:
        raise UploadFormatError(
            key,
            f"top-k mask is a {deflated.dim()}-d {str(deflated.dtype).removeprefix('torch.')} "
            "tensor, expected 1-d uint8 (deflated bytes)",
        )
    stream = zlib.decompressobj()
    try:
        data = stream.decompress(deflated.contiguous().numpy().tobytes(), size + 1)
    except zlib.error as err:
        raise UploadFormatError(key, f"top-k mask is not a zlib stream ({err})") from None
    if len(data) > size:
        raise UploadFormatError(key, f"top-k mask inflates to more than the {size} bytes expected")
    if not stream.eof or stream.unused_data:
        raise UploadFormatError(key, "top-k mask is not one complete zlib stream")
    if len(data) != size:
        raise UploadFormatError(key, f"top-k mask inflates to {len(data)} bytes, expected {size}")
    return _uint8(data)


def encode_fisher(
    fisher: Mapping[str, torch.Tensor], form: str, fraction: float = 1.0
) -> dict[str, torch.Tensor]:
    """Flat parts of a Fisher diagonal in ``form`` (``dense``, ``bf16`` or ``topk``); ``topk``
    keeps the top ``fraction`` α' of each tensor's entries (ties at the threshold kept)."""
    if form not in FISHER_UPLOADS:
        raise ValueError(f"upload.fisher must be one of {FISHER_UPLOADS}, got {form!r}")
    if form == "topk" and not 0.0 < fraction <= 1.0:
        raise ValueError(f"upload.fisher-fraction must be in (0, 1], got {fraction}")
    parts: dict[str, torch.Tensor] = {}
    for key, value in fisher.items():
        f = value.float()
        if form == "dense":
            parts[key] = f.contiguous()
        elif form == "bf16":
            parts[part_name(key, "bf16")] = f.to(torch.bfloat16).view(torch.int16).contiguous()
        else:
            keep = (f >= kept_threshold(f, fraction)) & (f > 0)
            parts[part_name(key, "topk_mask")] = deflate_mask(pack_mask(keep))
            parts[part_name(key, "topk_value")] = f.reshape(-1)[keep.reshape(-1)].contiguous()
    return parts


def upload_bytes(parts: Mapping[str, torch.Tensor]) -> int:
    """Payload bytes of ``parts`` (what the tensors take on the wire)."""
    return sum(t.numel() * t.element_size() for t in parts.values())


# ---- decoding (server side) ----------------------------------------------------------------


def split_part(name: str) -> tuple[str, str | None]:
    """``"<key>::<part>"`` → (key, part); a plain name → (name, None)."""
    if SEP in name:
        key, part = name.rsplit(SEP, 1)
        return key, part
    return name, None


def group_parts(names: list[str]) -> dict[str, tuple[str, dict[str, str]]]:
    """``{weight key: (form, {part: flat name})}`` for the flat part ``names`` of one record;
    ``UploadFormatError`` naming the weight for an unknown part, a mix of forms or a missing
    part."""
    grouped: dict[str, tuple[str, dict[str, str]]] = {}
    for name in names:
        key, part = split_part(name)
        form = "dense" if part is None else _PART_FORMS.get(part)
        if form is None:
            raise UploadFormatError(key, f"unknown upload part {part!r}")
        seen_form, parts = grouped.setdefault(key, (form, {}))
        if seen_form != form:
            raise UploadFormatError(key, f"mixes the upload forms {seen_form!r} and {form!r}")
        parts[part or "dense"] = name
    for key, (form, parts) in grouped.items():
        missing = [p for p in _FORM_PARTS.get(form, ()) if p not in parts]
        if missing:
            raise UploadFormatError(key, f"{form} upload lacks its part(s) {missing}")
        either = _ONE_OF.get(form, ())
        if either and sum(p in parts for p in either) != 1:
            raise UploadFormatError(key, f"{form} upload needs exactly one of the parts {either}")
    return grouped


Buffer = Callable[[int], torch.Tensor]


def _fresh(numel: int) -> torch.Tensor:
    return torch.empty(numel, dtype=torch.float32)


def decode_tensor(
    key: str,
    form: str,
    parts: Mapping[str, torch.Tensor],
    shape: tuple[int, ...] | None,
    buffer: Buffer = _fresh,
) -> torch.Tensor:
    """The dense tensor of weight ``key`` from its ``parts`` (``{part: tensor}``) in ``form``;
    ``shape`` is the weight's shape (required for ``topk``, checked otherwise).
    ``buffer(n)`` gives the flat float32 memory a decoded (not a ``dense``) form is written to
    (fresh by default).  ``UploadFormatError`` names the weight and the problem (wrong dtype,
    shape or size)."""
    if form == "dense":
        out = _float(key, "dense", parts["dense"])
    elif form == "factors":
        out = _decode_factors(key, parts, buffer)
    elif form == "bf16":
        bits = parts["bf16"]
        if bits.dtype != torch.int16:
            raise UploadFormatError(key, f"bf16 part has dtype {bits.dtype}, expected int16")
        out = buffer(bits.numel()).view(bits.shape).copy_(bits.view(torch.bfloat16))
    else:
        out = _decode_topk(key, parts, shape, buffer)
    _check_shape(key, form, tuple(out.shape), shape)
    return out


def _check_shape(
    key: str, form: str, decoded: tuple[int, ...], shape: tuple[int, ...] | None
) -> None:
    """Refuse a weight that decodes to another shape than the global weight's."""
    if shape is not None and tuple(decoded) != tuple(shape):
        raise UploadFormatError(
            key,
            f"has shape {tuple(decoded)} but the global weight has shape {tuple(shape)}"
            + ("" if form == "dense" else f" (decoded from its {form} upload)"),
        )


def _check_marked(key: str, marked: int, sent: int) -> None:
    """Refuse a top-k Fisher whose mask marks another number of entries than values sent."""
    if marked != sent:
        raise UploadFormatError(
            key, f"top-k mask marks {marked} entries but {sent} values were sent"
        )


def _float(key: str, part: str, t: torch.Tensor) -> torch.Tensor:
    if not t.is_floating_point():
        dtype = str(t.dtype).removeprefix("torch.")
        where = "" if part == "dense" else f"its {part} part "
        raise UploadFormatError(key, f"{where}has non-floating dtype {dtype}")
    return t


def _factors(key: str, parts: Mapping[str, torch.Tensor]) -> LowRankDelta:
    """The checked factors of weight ``key``."""
    b = _float(key, "lora_B", parts["lora_B"])
    a = _float(key, "lora_A", parts["lora_A"])
    s = _float(key, "scaling", parts["scaling"])
    if b.dim() != 2 or a.dim() != 2 or b.shape[1] != a.shape[0]:
        raise UploadFormatError(
            key, f"factors of shapes {tuple(b.shape)} and {tuple(a.shape)} do not multiply"
        )
    if b.shape[1] > min(b.shape[0], a.shape[1]):
        raise UploadFormatError(key, f"factor rank {b.shape[1]} exceeds the weight's dimensions")
    if s.numel() != 1:
        raise UploadFormatError(key, f"scaling holds {s.numel()} numbers, expected 1")
    return LowRankDelta(b, a, float(s.reshape(-1)[0]))


def _decode_factors(key: str, parts: Mapping[str, torch.Tensor], buffer: Buffer) -> torch.Tensor:
    """(B @ A) · s as :meth:`LowRankDelta.dense` computes it, written to ``buffer``."""
    f = _factors(key, parts)
    b, a = f.lora_B.float(), f.lora_A.float()
    out = buffer(b.shape[0] * a.shape[1]).view(b.shape[0], a.shape[1])
    return torch.mm(b, a, out=out).mul_(f.scaling)


def _packed_mask(key: str, parts: Mapping[str, torch.Tensor], size: int) -> torch.Tensor:
    """The ``size`` packed mask bytes of a top-k Fisher: inflated, or as the spool keeps them."""
    if "topk_mask" in parts:
        return inflate_mask(key, parts["topk_mask"], size)
    bits = parts["topk_bits"]
    if bits.dtype != torch.uint8 or bits.dim() != 1 or bits.numel() != size:
        raise UploadFormatError(
            key,
            f"top-k bits are a {bits.dim()}-d {str(bits.dtype).removeprefix('torch.')} tensor "
            f"of {bits.numel()} entries, expected 1-d uint8 of {size}",
        )
    return bits


def _topk_parts(
    key: str, parts: Mapping[str, torch.Tensor], shape: tuple[int, ...] | None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A top-k Fisher's checked ``(values, packed mask, entries)``."""
    if shape is None:
        raise UploadFormatError(key, "a top-k Fisher needs the weight's shape to decode")
    numel = math.prod(shape)
    values = _float(key, "topk_value", parts["topk_value"])
    packed = _packed_mask(key, parts, (numel + 7) // 8).contiguous()
    if values.dim() != 1:
        raise UploadFormatError(key, f"top-k values are {values.dim()}-d, expected 1-d")
    return values, packed, numel


def _decode_topk(
    key: str, parts: Mapping[str, torch.Tensor], shape: tuple[int, ...] | None, buffer: Buffer
) -> torch.Tensor:
    values, packed, numel = _topk_parts(key, parts, shape)
    out = buffer(numel)
    count = native.unmask(packed, values.float().contiguous(), out)
    if count is None:
        bits = np.unpackbits(packed.numpy(), count=numel, bitorder="little").view(np.bool_)
        count = int(np.count_nonzero(bits))
        if count == values.numel():
            array = out.numpy()
            array.fill(0.0)
            array[bits] = values.float().numpy()
    _check_marked(key, count, values.numel())
    assert shape is not None  # _topk_parts refused a missing shape
    return out.view(shape)


def _sole_holder(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is the only tensor on its storage (no view or slice of it is alive).
    False where torch cannot tell."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return False
    # the tensor holds the storage once and the Python storage object made here once more
    return int(use_count(tensor.untyped_storage()._cdata)) == 2


class DecodedTensors(Mapping[str, torch.Tensor]):
    """Dense tensors decoded on demand from flat parts, one weight at a time.

    ``get_part(name)`` returns the flat part ``name`` (a dict's ``__getitem__`` or a
    safetensors handle's ``get_tensor``); ``names`` are all flat part names; ``shapes`` the
    weights' shapes (needed for ``topk``). The last decoded tensor is kept, so asking for the
    same weight again (its dtype, then its values) decodes it once. A weight is decoded into
    the memory of the last one when nothing but this mapping refers to it any more (no tensor,
    view or slice of it is alive elsewhere), so a merge that drops each weight's tensors before
    asking for the next decodes into the same pages every time; otherwise into fresh memory.
    """

    def __init__(
        self,
        names: list[str],
        get_part: Callable[[str], torch.Tensor],
        shapes: Mapping[str, tuple[int, ...]] | None = None,
    ) -> None:
        self._groups = group_parts(names)
        self._get_part = get_part
        self._shapes = shapes
        self._last: tuple[str, torch.Tensor] | None = None
        self._memory: torch.Tensor | None = None

    @classmethod
    def from_parts(
        cls, parts: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]] | None = None
    ) -> DecodedTensors:
        """Over an in-memory ``{flat name: tensor}`` dict."""
        return cls(list(parts), parts.__getitem__, shapes)

    def form(self, key: str) -> str:
        """How weight ``key`` was uploaded (``dense``, ``factors``, ``bf16`` or ``topk``)."""
        return self._groups[key][0]

    def factor_rank(self, key: str) -> int | None:
        """The rank r of weight ``key``'s LoRA factors (its ``lora_A`` rows), without decoding
        it; None when it was not uploaded as factors."""
        form, names = self._groups[key]
        if form != "factors":
            return None
        lora_a = self._get_part(names["lora_A"])
        return int(lora_a.shape[0]) if lora_a.dim() == 2 else None

    def describe(self, key: str) -> tuple[tuple[int, ...], torch.dtype, torch.device]:
        """Weight ``key``'s shape, dtype and device as decoding gives them, without decoding
        it (the parts' shapes; a ``topk`` weight's from ``shapes``). An upload whose parts
        disagree is reported by decoding it, not here."""
        form, names = self._groups[key]
        cpu = torch.device("cpu")
        if form == "dense":
            part = self._get_part(names["dense"])
            return tuple(part.shape), part.dtype, part.device
        if form == "factors":
            b, a = self._get_part(names["lora_B"]), self._get_part(names["lora_A"])
            return (int(b.shape[0]), int(a.shape[-1])), torch.float32, cpu
        if form == "bf16":
            return tuple(self._get_part(names["bf16"]).shape), torch.float32, cpu
        if self._shapes is None or key not in self._shapes:
            raise UploadFormatError(key, "a top-k Fisher needs the weight's shape to decode")
        return tuple(self._shapes[key]), torch.float32, cpu

    def kept_values(self, key: str) -> torch.Tensor | None:
        """The values a ``topk`` weight was sent with, in float32 and index order (every other
        entry decodes as 0); None for the other forms. Checked against the mask only when the
        weight is decoded."""
        form, names = self._groups[key]
        if form != "topk":
            return None
        return _float(key, "topk_value", self._get_part(names["topk_value"])).float().reshape(-1)

    def flat_slices(self, key: str) -> FlatSlices | None:
        """Weight ``key`` as flat slices decoded on demand (:mod:`fedunlearn.merging.lazy`)
        when it was uploaded as factors or top-k, checked as decoding checks it; None for the
        other forms (a dense or bf16 weight is read as a tensor)."""
        form, names = self._groups[key]
        if form not in ("factors", "topk"):
            return None
        parts = {part: self._get_part(name) for part, name in names.items()}
        shape = None if self._shapes is None else self._shapes.get(key)
        if form == "factors":
            f = _factors(key, parts)
            decoded_shape = (int(f.lora_B.shape[0]), int(f.lora_A.shape[1]))
            _check_shape(key, form, decoded_shape, shape)
            return FactorSlices(f.lora_B, f.lora_A, f.scaling)
        values, packed, numel = _topk_parts(key, parts, shape)
        slices = TopkSlices(packed, values, numel)
        _check_marked(key, slices.marked, values.numel())
        return slices

    def _buffer(self, numel: int) -> torch.Tensor:
        """Flat float32 memory for ``numel`` entries: the last weight's, when nothing but this
        mapping refers to it (its storage's only other holder is ``_memory`` itself)."""
        self._last = None
        memory = self._memory
        if memory is not None and memory.numel() >= numel and _sole_holder(memory):
            return memory[:numel]
        self._memory = memory = torch.empty(numel, dtype=torch.float32)
        return memory[:numel]

    def parts(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every flat part as uploaded (to store it without decoding)."""
        for _, names in self._groups.values():
            for name in names.values():
                yield name, self._get_part(name)

    def __getitem__(self, key: str) -> torch.Tensor:
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        form, names = self._groups[key]
        parts = {part: self._get_part(name) for part, name in names.items()}
        shape = None if self._shapes is None else self._shapes.get(key)
        tensor = decode_tensor(key, form, parts, shape, self._buffer)
        self._last = (key, tensor)
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._groups)

    def __len__(self) -> int:
        return len(self._groups)

    def __contains__(self, key: object) -> bool:
        return key in self._groups
