"""bench_uploads at a small scale: the named scales' shapes, exact payload bytes, the uploads a
dense server holds against a streaming one, and the compact merge's error (exact with one forget
client per domain, not when a domain pools several)."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from simulations import bench_uploads as bu

SMALL = bu.Scale("small", "test", bu.ModelDims(256, 512, 2, 4, 2, 64), bu.ALL, forget=2, retain=1)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    cfg = bu.BenchConfig(threads=1, work_dir=tmp_path_factory.mktemp("work"))
    return cfg, bu.run_benchmark(cfg, [SMALL])


@pytest.mark.parametrize(
    ("name", "weights", "entries"),
    [
        # 4 layers x (q 192² + k, v 96·192 + o 192² + gate, up, down 512·192)
        ("builtin", 28, 4 * (2 * 192 * 192 + 2 * 96 * 192 + 3 * 512 * 192)),
        ("smollm2-qv", 60, 30 * (576 * 576 + 192 * 576)),
        ("smollm2-all", 210, 30 * (2 * 576 * 576 + 2 * 192 * 576 + 3 * 1536 * 576)),
        ("7b-layer", 7, 4 * 4096 * 4096 + 3 * 11008 * 4096),
    ],
)
def test_named_scales_have_the_models_shapes(name, weights, entries):
    scale = bu.named_scale(name)
    assert len(scale.shapes()) == weights
    assert scale.entries() == entries


def test_smollm2_projections_and_the_dense_upload_sizes_of_the_issue():
    shapes = bu.named_scale("smollm2-all").shapes()
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (192, 576)
    assert shapes["model.layers.29.mlp.down_proj.weight"] == (576, 1536)
    assert round(8 * bu.named_scale("builtin").entries() / 1e6) == 13  # "13 MB per client"
    assert round(8 * bu.named_scale("smollm2-all").entries() / 1e6, -1) == 850  # "~850 MB"


def test_read_upload_reads_what_safetensors_wrote(tmp_path):
    tensors = {
        "fisher/w": torch.rand(3, 5),
        "fisher/w::bf16": torch.randint(-(2**15), 2**15, (7,), dtype=torch.int16),
        "fisher/w::topk_mask": torch.randint(0, 256, (2,), dtype=torch.uint8),
    }
    save_file(tensors, str(tmp_path / "u.safetensors"))
    read = bu.read_upload(tmp_path / "u.safetensors")
    expected = load_file(str(tmp_path / "u.safetensors"))
    assert read.keys() == expected.keys()
    for key, t in expected.items():
        assert torch.equal(read[key], t)


def test_a_dense_server_over_the_memory_limit_is_refused(tmp_path):
    cfg = bu.BenchConfig(threads=1, work_dir=tmp_path, memory_limit_gb=0.01)
    with pytest.raises(ValueError, match="fewer clients"):
        bu.run_scale(SMALL, cfg)
    assert not any(tmp_path.iterdir())


def test_payload_bytes_are_the_codecs(measured):
    cfg, results = measured
    b = results["scales"][0]["bytes_per_client"]
    shapes = SMALL.shapes().values()
    d = SMALL.entries()
    factors = sum(4 * (cfg.rank * (d_out + d_in) + 1) for d_out, d_in in shapes)
    values = sum(4 * math.floor(cfg.fraction * o * i) for o, i in shapes)  # kept, float32
    packed = sum((o * i + 7) // 8 for o, i in shapes)  # the mask before it is deflated
    for row in b["per_client"]:
        assert values < row["topk_fisher"] < values + packed  # deflated: under 1 bit per entry
        assert {k: v for k, v in row.items() if k != "topk_fisher"} == {
            "dense_task_vector": 4 * d,
            "dense_fisher": 4 * d,
            "factors_task_vector": factors,
            "bf16_fisher": 2 * d,
        }
    assert b["dense_over_compact"] > 8 * d / (factors + values + packed)
    assert b["dense_over_compact_bf16"] == pytest.approx(8 * d / (factors + 2 * d))


def test_the_dense_server_holds_every_upload_the_streaming_one_does_not(measured):
    _, results = measured
    scale = results["scales"][0]
    uploads = (SMALL.forget + SMALL.retain) * scale["bytes_per_client"]["dense"]
    for config in bu.CONFIGS:
        dense, compact = (scale["configs"][config]["cases"][c] for c in bu.CASES)
        assert dense["held_bytes"] >= uploads
        assert compact["held_bytes"] < dense["held_bytes"] / 2
        assert compact["spool_bytes"] > 0 and dense["spool_bytes"] == 0
        for m in (dense, compact):
            assert m["peak_extra_bytes"] >= max(m["held_bytes"], 0)
            assert m["merge_seconds"] > 0 and m["receive_seconds"] > 0
            assert len(m["all_merge_seconds"]) == 3  # the default repeats
            assert m["first_merge_seconds"] == m["all_merge_seconds"][0]
            assert m["merge_seconds"] == min(m["all_merge_seconds"])
        ratio = scale["configs"][config]["compact_over_dense"]
        assert ratio["best"] == compact["merge_seconds"] / dense["merge_seconds"]
        assert ratio["first"] == compact["first_merge_seconds"] / dense["first_merge_seconds"]


def test_compact_merge_is_exact_per_domain_and_not_when_pooled(measured):
    _, results = measured
    configs = results["scales"][0]["configs"]
    assert configs["per-domain"]["relative_error"] == {"error": 0.0, "worst_error": 0.0}
    assert configs["pooled"]["relative_error"]["error"] > 0.01


def test_the_report_and_json(measured, tmp_path):
    cfg, results = measured
    text = bu.format_report(results)
    assert "small" in text and "compact-streaming" in text and "per-domain" in text
    ratio = results["scales"][0]["configs"]["pooled"]["compact_over_dense"]
    assert f"pooled {ratio['best']:.2f} / {ratio['first']:.2f}" in text
    json.loads(json.dumps(results))
    assert not any(cfg.work_dir.iterdir())  # the uploads and spools are removed


def test_a_step_waits_for_the_machines_free_memory():
    bu.await_memory(0, "nothing", 0.0)
    with pytest.raises(RuntimeError, match="too much needs about 1000000000.0 GB"):
        bu.await_memory(10**18, "too much", 0.0)
