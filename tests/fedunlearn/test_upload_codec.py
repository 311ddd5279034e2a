"""Compact uploads: LoRA factors and top-k / bf16 Fisher decode to what FIRM needs."""

import math

import pytest
import torch

from fedunlearn.merging import ClientUpdate, get_merge, native
from fedunlearn.merging.base import described
from fedunlearn.merging.firm import normalize_and_sparsify
from fedunlearn.qa_format import encode_qa
from fedunlearn.training.lora import LocalTrainSettings, LoraSettings, train_lora_task_vector
from fedunlearn.upload_codec import (
    DecodedTensors,
    LowRankDelta,
    UploadFormatError,
    _decode_topk,
    deflate_mask,
    encode_fisher,
    encode_task_vector,
    inflate_mask,
    pack_mask,
    unpack_mask,
    upload_bytes,
)


def _fisher(shape, seed, zeros=0.3, ties=True):
    g = torch.Generator().manual_seed(seed)
    f = 1e-6 * torch.exp(2 * torch.randn(shape, generator=g))
    f[torch.rand(shape, generator=g) < zeros] = 0.0
    if ties:  # a block of equal values straddling typical thresholds
        flat = f.view(-1)
        flat[: flat.numel() // 7] = float(flat.median())
    return f


def _decoded(parts, shapes):
    return DecodedTensors.from_parts(parts, shapes)


def test_lora_factors_decode_bit_for_bit_to_the_dense_task_vector(
    tiny_model, tiny_tokenizer, tiny_data
):
    pad = tiny_tokenizer.pad_token_id
    examples = [
        encode_qa(tiny_tokenizer, r["question"], r["answer"]) for r in tiny_data.author_qa[:6]
    ]
    lora = LoraSettings(rank=4, alpha=8.0)
    train = LocalTrainSettings(objective="ga", steps=3, lr=5e-3, batch_size=6, seed=1)
    dense, _ = train_lora_task_vector(
        tiny_model, examples, pad_token_id=pad, lora=lora, train=train
    )
    factors, _ = train_lora_task_vector(
        tiny_model, examples, pad_token_id=pad, lora=lora, train=train, as_factors=True
    )
    assert all(isinstance(v, LowRankDelta) for v in factors.values())
    shapes = {k: tuple(v.shape) for k, v in dense.items()}
    parts = encode_task_vector(factors, "factors")
    decoded = _decoded(parts, shapes)
    assert sorted(decoded) == sorted(dense)
    for key, value in dense.items():
        assert decoded.form(key) == "factors"
        assert torch.equal(decoded[key], value), key
    # r·(d_in + d_out) + 1 numbers per weight instead of d_in·d_out
    assert upload_bytes(parts) * 4 < upload_bytes(encode_task_vector(dense, "dense"))
    # factors sent dense are their product
    again = _decoded(encode_task_vector(factors, "dense"), shapes)
    assert all(torch.equal(again[k], dense[k]) for k in dense)


def test_pack_mask_round_trips_every_length():
    for n in (1, 7, 8, 9, 63, 1000):
        mask = torch.rand(n, generator=torch.Generator().manual_seed(n)) < 0.3
        packed = pack_mask(mask)
        assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n / 8)
        assert torch.equal(unpack_mask(packed, n), mask)


def test_the_topk_mask_travels_deflated_at_about_half_a_bit_per_entry():
    f = {"w": _fisher((256, 192), 5, ties=False)}
    parts = encode_fisher(f, "topk", 0.1)
    kept = parts["w::topk_value"].numel()
    assert kept == math.floor(0.1 * 256 * 192)
    mask_bits = 8 * parts["w::topk_mask"].numel() / (256 * 192)
    assert 0.3 < mask_bits < 0.7  # entropy of a 10 % mask: 0.47 bits; packed: 1 bit
    assert inflate_mask("w", parts["w::topk_mask"], 256 * 192 // 8).numel() == 256 * 192 // 8
    assert torch.equal(
        _decoded(parts, {"w": (256, 192)})["w"] > 0,
        f["w"] >= torch.sort(f["w"].flatten())[0][-kept],
    )


def test_a_crafted_mask_stream_is_refused_before_it_expands():
    packed = pack_mask(torch.ones(80, dtype=torch.bool))  # 10 bytes
    good = deflate_mask(packed)
    assert torch.equal(inflate_mask("w", good, 10), packed)
    bomb = deflate_mask(torch.zeros(10**6, dtype=torch.uint8))  # 1 MB of zeros in ~1 kB
    assert bomb.numel() < 2000
    cases = {
        "inflates to more than the 10 bytes": bomb,
        "inflates to 9 bytes, expected 10": deflate_mask(packed[:9]),
        "not one complete zlib stream": torch.cat([good, good]),
        "not a zlib stream": torch.tensor([1, 2, 3, 4], dtype=torch.uint8),
        "expected 1-d uint8": good.to(torch.int16),
    }
    for problem, stream in cases.items():
        with pytest.raises(UploadFormatError, match=rf"'w': top-k mask .*{problem}"):
            inflate_mask("w", stream, 10)
    with pytest.raises(UploadFormatError, match="not one complete zlib stream"):
        inflate_mask("w", good[:-3], 10)


def test_bf16_fisher_is_within_bf16_rounding():
    f = {"w": _fisher((40, 30), 0)}
    parts = encode_fisher(f, "bf16")
    assert upload_bytes(parts) == 2 * 40 * 30
    got = _decoded(parts, {"w": (40, 30)})["w"]
    assert got.dtype == torch.float32
    rel = ((got - f["w"]).abs() / f["w"].clamp_min(1e-30))[f["w"] > 0]
    assert 0 < float(rel.max()) <= 2**-8


@pytest.mark.parametrize("alpha", [0.05, 0.1, 0.3])
def test_topk_fisher_with_fraction_at_least_alpha_gives_firms_exact_support(alpha):
    """For one client's own top-α (what FIRM keeps of a retain client's Fisher) a top-α'
    upload with α' ≥ α is exact: same normalised, sparsified F̃ bit for bit."""
    for seed in range(6):
        f = _fisher((64, 48), seed, zeros=0.2 * (seed % 3))
        for fraction in (alpha, alpha * 1.5, 1.0):
            decoded = _decoded(encode_fisher({"w": f}, "topk", fraction), {"w": (64, 48)})["w"]
            assert torch.equal(
                normalize_and_sparsify(decoded, alpha, 1e-8), normalize_and_sparsify(f, alpha, 1e-8)
            ), (seed, fraction)
    # below α it is not: the threshold moves
    f = _fisher((64, 48), 99, zeros=0.0, ties=False)
    cut = _decoded(encode_fisher({"w": f}, "topk", alpha / 2), {"w": (64, 48)})["w"]
    assert not torch.equal(
        normalize_and_sparsify(cut, alpha, 1e-8), normalize_and_sparsify(f, alpha, 1e-8)
    )


def _updates(fisher_form, fraction, forget_per_domain=1):
    shapes = {"a": (32, 24), "b": (16, 40)}
    updates = []
    clients = [("forget", "x")] * forget_per_domain + [("retain", None)] * 3
    for i, (role, domain) in enumerate(clients):
        g = torch.Generator().manual_seed(100 + i)
        tv = {k: torch.randn(s, generator=g) * 0.01 for k, s in shapes.items()}
        fi = {k: _fisher(s, 10 * i + j) for j, (k, s) in enumerate(shapes.items())}
        fisher = _decoded(encode_fisher(fi, fisher_form, fraction), shapes)
        updates.append(ClientUpdate(i, role, domain, 10, tv, fisher))
    return updates


def test_firm_merge_from_topk_uploads_equals_the_dense_merge_when_each_domain_has_one_client():
    firm = get_merge("firm")
    for epsilon in (math.inf, 1e-7):
        dense = firm(_updates("dense", 1.0), alpha=0.1, epsilon=epsilon)
        compact = firm(_updates("topk", 0.1), alpha=0.1, epsilon=epsilon)
        for key, value in dense.delta.items():
            assert torch.equal(compact.delta[key], value), (epsilon, key)
    # two forget clients in one domain: the pooled mean's top-α is approximated
    dense = firm(_updates("dense", 1.0, forget_per_domain=2), alpha=0.1)
    compact = firm(_updates("topk", 0.1, forget_per_domain=2), alpha=0.1)
    assert any(not torch.equal(compact.delta[k], v) for k, v in dense.delta.items())


def test_decoding_errors_name_the_weight_and_the_problem():
    f = {"w": _fisher((10, 10), 1)}
    parts = encode_fisher(f, "topk", 0.2)
    bad = dict(parts, **{"w::topk_value": parts["w::topk_value"][:-1]})
    with pytest.raises(UploadFormatError, match=r"'w'.*marks \d+ entries but \d+ values"):
        _decoded(bad, {"w": (10, 10)})["w"]
    with pytest.raises(UploadFormatError, match=r"'w'.*inflates to 13 bytes, expected 14"):
        _decoded(parts, {"w": (10, 11)})["w"]  # 13 mask bytes for 100 entries, 110 expected
    with pytest.raises(UploadFormatError, match="unknown upload part 'zip'"):
        _decoded({"w::zip": torch.zeros(3)}, None)
    with pytest.raises(UploadFormatError, match=r"lacks its part\(s\) \['scaling'\]"):
        _decoded({"w::lora_B": torch.zeros(4, 2), "w::lora_A": torch.zeros(2, 4)}, None)
    lr = {
        "w::lora_B": torch.zeros(4, 2),
        "w::lora_A": torch.zeros(3, 4),
        "w::scaling": torch.ones(1),
    }
    with pytest.raises(UploadFormatError, match="do not multiply"):
        _decoded(lr, None)["w"]
    with pytest.raises(UploadFormatError, match="mixes the upload forms"):
        _decoded({"w": torch.zeros(2), "w::bf16": torch.zeros(2, dtype=torch.int16)}, None)
    with pytest.raises(
        UploadFormatError,
        match=r"shape \(4, 4\) but the global weight has shape \(4, 5\) \(decoded from its factors",
    ):
        _decoded(
            {
                "w::lora_B": torch.zeros(4, 2),
                "w::lora_A": torch.zeros(2, 4),
                "w::scaling": torch.ones(1),
            },
            {"w": (4, 5)},
        )["w"]


@pytest.mark.parametrize("decoder", ["c", "numpy"])
@pytest.mark.parametrize("numel", [1, 7, 8, 15, 16, 17, 1000, 3 * (1 << 20) + 5])
def test_both_decoders_spread_the_values_as_boolean_indexing_does(numel, decoder, monkeypatch):
    """The C loop (over slices and threads) and numpy's (where no compiler is found) both give
    ``zeros; out[mask] = values`` for masks of every length, tails included."""
    if decoder == "c" and native.library() is None:
        pytest.skip("no C compiler")
    if decoder == "numpy":
        monkeypatch.setattr(native, "unmask", lambda *_: None)
    g = torch.Generator().manual_seed(numel)
    mask = torch.rand(numel, generator=g) < 0.3
    values = torch.rand(int(mask.sum()), generator=g)
    expected = torch.zeros(numel)
    expected[mask] = values
    out = torch.full((numel,), float("nan"))
    parts = {"topk_bits": pack_mask(mask), "topk_value": values}
    assert torch.equal(_decode_topk("w", parts, (numel,), lambda n: out[:n]), expected)
    with pytest.raises(UploadFormatError, match="values were sent"):
        extra = torch.cat([values, torch.ones(1)])
        _decode_topk("w", {**parts, "topk_value": extra}, (numel,), lambda n: out[:n])


def test_the_mask_decodes_the_same_deflated_or_inflated_as_the_spool_keeps_it():
    f = _fisher((96, 80), seed=3)
    parts = encode_fisher({"w": f}, "topk", 0.2)
    bits = inflate_mask("w", parts["w::topk_mask"], (96 * 80 + 7) // 8)
    inflated = {"w::topk_bits": bits, "w::topk_value": parts["w::topk_value"]}
    shapes = {"w": (96, 80)}
    assert torch.equal(_decoded(parts, shapes)["w"], _decoded(inflated, shapes)["w"])
    with pytest.raises(UploadFormatError, match="exactly one of"):
        _decoded({**parts, "w::topk_bits": bits}, shapes)
    with pytest.raises(UploadFormatError, match="expected 1-d uint8 of 960"):
        _decoded({**inflated, "w::topk_bits": bits[:-1]}, shapes)["w"]
    short = {**inflated, "w::topk_value": parts["w::topk_value"][:-1]}
    with pytest.raises(UploadFormatError, match="values were sent"):
        _decoded(short, shapes)["w"]


def test_a_weight_is_decoded_into_the_last_ones_memory_only_when_nothing_holds_it():
    shapes = {"a": (64, 48), "b": (32, 48), "c": (64, 48)}
    g = torch.Generator().manual_seed(0)
    fisher = {k: torch.rand(s, generator=g) for k, s in shapes.items()}
    tv = {
        k: LowRankDelta(torch.randn(s[0], 4), torch.randn(4, s[1]), 0.5) for k, s in shapes.items()
    }
    for parts in (encode_fisher(fisher, "topk", 0.3), encode_task_vector(tv, "factors")):
        decoded = _decoded(parts, shapes)
        expected = {k: _decoded(parts, shapes)[k].clone() for k in shapes}
        a = decoded["a"]
        held = a.clone()
        b = decoded["b"]  # "a" is still held: fresh memory
        assert b.data_ptr() != a.data_ptr() and torch.equal(a, held)
        del a
        view = b[1:]  # a view keeps "b"'s memory from being reused
        assert decoded["c"].data_ptr() != b.data_ptr() and torch.equal(view, expected["b"][1:])
        del b, view
        pointer = decoded["c"].data_ptr()
        assert decoded["a"].data_ptr() == pointer  # nothing holds "c": its memory again
        for key in ("b", "c", "a"):
            assert torch.equal(decoded[key], expected[key])


def test_describe_tells_the_decoded_shape_and_dtype_without_decoding():
    shapes = {"f": (12, 10), "t": (12, 10)}
    parts = encode_fisher({"f": torch.rand(12, 10)}, "topk", 0.5)
    parts |= encode_task_vector(
        {"t": LowRankDelta(torch.randn(12, 2), torch.randn(2, 10), 1.0)}, "factors"
    )
    parts |= encode_fisher({"b": torch.rand(3, 4)}, "bf16") | {
        "d": torch.rand(5, dtype=torch.float64)
    }
    decoded = _decoded(parts, {**shapes, "b": (3, 4), "d": (5,)})
    for key in ("f", "t", "b", "d"):
        t = decoded[key]
        assert decoded.describe(key) == (tuple(t.shape), t.dtype, t.device)
    assert described(decoded, "t") == ((12, 10), torch.float32, torch.device("cpu"))
    assert described({"x": torch.zeros(2, 3)}, "x") == ((2, 3), torch.float32, torch.device("cpu"))
