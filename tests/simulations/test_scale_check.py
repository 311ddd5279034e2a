"""simulations.scale_check on real Flower simulations of shrunk real architectures: the figures
come from the runs' results.json, and the slope and extrapolation are the written formula
applied to the written numbers. (Every shape's one-layer model and its client pipeline:
tests/fedunlearn/models/test_shapes.py.)"""

import json

import pytest

from fedunlearn.models.shapes import SHAPES, parameter_count, shrunk
from simulations import scale_check

pytestmark = pytest.mark.slow

TINY = ["--shrink", "32", "--steps", "2", "--batch-size", "2", "--run-config", "lora.rank=4"]


def _check(tmp_path, capsys, *options: str) -> tuple[dict, list[str]]:
    out = tmp_path / "out"
    argv = [*options, *TINY, "--output-dir", str(out), "--cache-dir", str(tmp_path / "cache")]
    assert scale_check.main(argv) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    report = json.loads((out / "scale_check.json").read_text())
    assert (out / "scale_check.md").read_text() == scale_check.report_markdown(report)
    return report, printed


@pytest.fixture(scope="module")
def two_depths(tmp_path_factory):
    """qwen2.5-7b shrunk 32× (GQA 28:4, q/k/v biases) at 1 and 2 layers."""
    tmp_path = tmp_path_factory.mktemp("scale")
    out = tmp_path / "out"
    argv = ["--shape", "qwen2.5-7b", "--layers", "1,2", *TINY, "--output-dir", str(out)]
    assert scale_check.main([*argv, "--cache-dir", str(tmp_path / "cache")]) == 0
    return json.loads((out / "scale_check.json").read_text()), out


def test_every_run_measured_six_clients_from_its_results(two_depths):
    report, out = two_depths
    assert report["runs"].keys() == {"1", "2"}
    shape = shrunk(SHAPES["qwen2.5-7b"], 32)
    for layer, run in report["runs"].items():
        results = json.loads((out / f"L{layer}" / "results.json").read_text())
        assert results["config"]["lora.targets"] == scale_check.LORA_TARGETS
        assert results["config"]["evaluate"] is False
        roles = sorted(c["role"] for c in run["clients"])
        assert roles == ["forget"] * 5 + ["retain"]
        for row, client in zip(run["clients"], results["clients"], strict=True):
            assert row["up_bytes"] == client["bytes_sent"] > 0
            assert row["up_task_vector_bytes"] > 0 and row["up_fisher_bytes"] > 0
            assert row["down_bytes_by_round"] == client["bytes_received_model_by_round"]
            assert row["peak_rss_bytes"] == client["peak_rss_mb"] * 2**20 > 0
        assert run["server_peak_bytes"] == results["server_peak_rss_mb"] * 2**20 > 0
        assert run["client_peak_bytes"] == max(c["peak_rss_bytes"] for c in run["clients"])
        assert run["up_bytes"] == max(c["up_bytes"] for c in run["clients"])
        assert run["merge_seconds"] == results["merge"]["seconds"] > 0
        assert run["round_seconds"] == results["seconds"]["federated_round"] > 0
        assert run["model_bytes"] == 2 * parameter_count(shape, int(layer))
    # a second layer adds its seven adapted weights to every upload
    assert report["runs"]["2"]["up_bytes"] > report["runs"]["1"]["up_bytes"]


def test_slope_and_extrapolation_are_the_formula_on_the_written_numbers(two_depths):
    report, out = two_depths
    n = report["full_depth"]
    assert n == 28
    for key, _, _ in scale_check.FIGURES:
        one, two = report["runs"]["1"][key], report["runs"]["2"][key]
        fit = report["extrapolation"][key]
        assert fit["per_layer"] == pytest.approx(two - one, rel=1e-12, abs=1e-9)
        assert fit["full_depth"] == pytest.approx(one + (two - one) * (n - 1), rel=1e-12, abs=1e-6)
    # the weights are exactly linear in the depth: extrapolated, they are the full model's
    full = report["extrapolation"]["model_bytes"]["full_depth"]
    assert full == pytest.approx(report["full_model_bytes"], rel=1e-12)
    assert report["full_model_bytes"] == 2 * parameter_count(shrunk(SHAPES["qwen2.5-7b"], 32), n)
    text = (out / "scale_check.md").read_text()
    assert report["formula"] in text and "full depth N = 28" in text
    server = report["extrapolation"]["server_peak_bytes"]["full_depth"] / 1e9
    assert scale_check.final_line(report).startswith(
        f"scale-check: qwen2.5-7b full depth: server {server:.2f} GB, client "
    )


def test_least_squares_over_three_depths():
    a, b = scale_check.fit_line([1, 2, 4], [3.0, 5.0, 9.0])
    assert (a, b) == pytest.approx((1.0, 2.0))
    with pytest.raises(ValueError, match="two different"):
        scale_check.fit_line([2, 2], [1.0, 3.0])


def test_mpu_at_one_layer_prints_the_figures_last(tmp_path, capsys):
    """llama-3.1-8b shrunk (GQA 32:8, llama3 RoPE scaling) with MPU around FIRM."""
    report, printed = _check(
        tmp_path, capsys, "--shape", "llama-3.1-8b", "--layers", "1", "--wrapper", "mpu"
    )
    run = report["runs"]["1"]
    assert "extrapolation" not in report and report["wrapper"] == "mpu"
    assert len(run["clients"]) == 6 and all(c["up_bytes"] > 0 for c in run["clients"])
    results = json.loads((tmp_path / "out" / "L1" / "results.json").read_text())
    assert results["config"]["wrapper"] == "mpu"
    assert all(c["mpu_copies"] == 2 for c in results["clients"])
    assert printed[-1] == scale_check.final_line(report)
    assert printed[-1].startswith("scale-check: llama-3.1-8b 1 layer(s), no extrapolation: server ")
