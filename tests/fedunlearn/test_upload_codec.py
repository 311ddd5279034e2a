"""Compact uploads: LoRA factors and top-k / bf16 Fisher decode to what FIRM needs."""

import math

import pytest
import torch

from fedunlearn.merging import ClientUpdate, get_merge
from fedunlearn.merging.firm import normalize_and_sparsify
from fedunlearn.qa_format import encode_qa
from fedunlearn.training.lora import LocalTrainSettings, LoraSettings, train_lora_task_vector
from fedunlearn.upload_codec import (
    DecodedTensors,
    LowRankDelta,
    UploadFormatError,
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
