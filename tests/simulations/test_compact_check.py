"""simulations.compact_check's comparison of two runs (the whole check on a real Flower run:
tests/simulations/test_end_to_end.py)."""

import pytest
import torch

from simulations.compact_check import (
    DENSE_OVERRIDES,
    compare,
    merged_update_error,
    report_markdown,
    run_summary,
)
from simulations.run_local import with_overrides


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(4, 3, generator=g), "b": torch.randn(5, generator=g)}


def test_merged_update_error_is_relative_to_the_dense_update():
    theta0 = _weights(0)
    delta = _weights(1)
    noise = _weights(2)
    dense = {k: theta0[k] + delta[k] for k in theta0}
    compact = {k: dense[k] + 0.1 * noise[k] for k in theta0}
    compact["b"] = dense["b"].clone()  # one weight exact
    result = merged_update_error(theta0, dense, compact)
    expected = (0.1 * noise["a"]).double().norm() / torch.cat(
        [delta["a"].double().flatten(), delta["b"].double().flatten()]
    ).norm()
    assert result["error"] == pytest.approx(float(expected), rel=1e-5)
    assert result["worst_tensor"] == "a"
    assert result["worst_tensor_error"] == pytest.approx(
        float((0.1 * noise["a"]).double().norm() / delta["a"].double().norm()), rel=1e-5
    )
    assert result["changed_weights"] == 2
    same = merged_update_error(theta0, dense, dense)
    assert same["error"] == 0.0 and same["worst_tensor_error"] == 0.0


def test_unchanged_weights_are_not_counted_and_missing_ones_are_refused():
    theta0 = _weights(0)
    dense = {"a": theta0["a"] + 1.0, "b": theta0["b"].clone()}
    assert merged_update_error(theta0, dense, dict(dense))["changed_weights"] == 1
    with pytest.raises(ValueError, match="'b'"):
        merged_update_error(theta0, dense, {"a": dense["a"]})


def test_dense_run_config_replaces_the_upload_keys():
    config = "gamma=2.0 upload.fisher='bf16' upload.stream=true seed=3"
    dense = with_overrides(config, DENSE_OVERRIDES)
    assert dense == f"gamma=2.0 seed=3 {DENSE_OVERRIDES}"


def _results(sent: int, peak: int, excluded_sent: int = 0) -> dict:
    client = {"bytes_sent": sent, "bytes_task_vector": sent // 2, "bytes_fisher": sent // 2}
    return {
        "clients": [
            {**client, "bytes_dense": 8000},
            {**client, "bytes_dense": 8000},
            {"bytes_sent": excluded_sent, "excluded": True, "reason": "crashed"},
        ],
        "merge": {"streamed": sent < 8000, "round_peak_rss_bytes": peak, "seconds": 0.5},
        "server_peak_rss_mb": peak / 2**20,
        "seconds": {"federated_round": 12.0},
        "metrics": {"after": {"forget_rouge_l": 0.5, "model_utility": 0.4}},
    }


def test_report_averages_merged_clients_and_gives_ratios():
    runs = {
        "dense": run_summary(_results(8000, 4_000_000)),
        "compact": run_summary(_results(800, 1_000_000, excluded_sent=10**9)),
    }
    assert runs["compact"]["clients"] == 2
    assert runs["compact"]["bytes_sent_per_client"] == 800
    error = {
        "error": 0.01,
        "worst_tensor_error": 0.02,
        "worst_tensor": "a",
        "dense_update_norm": 3.0,
        "changed_weights": 2,
    }
    report = compare(runs, error)
    assert report["bytes_ratio"] == pytest.approx(10.0)
    assert report["round_peak_rss_ratio"] == pytest.approx(4.0)
    text = report_markdown(report)
    assert "| bytes per client (sent) | 8,000 | 800 |" in text
    assert "| after: forget_rouge_l | 0.500 | 0.500 |" in text
    assert "10.0×" in text and "e = 0.01" in text


def test_a_run_that_merged_nobody_is_refused():
    results = _results(800, 1)
    for client in results["clients"]:
        client["excluded"] = True
    with pytest.raises(ValueError, match="no client"):
        run_summary(results)
