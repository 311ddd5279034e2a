"""The MPU overhead benchmark at a tiny scale: every row present, ratios from the same run."""

import json

import pytest

from simulations import bench_mpu


@pytest.fixture(scope="module")
def results(tmp_path_factory, tiny_checkpoint, tiny_data):
    folder = tmp_path_factory.mktemp("bench-mpu")
    tofu = folder / "tofu"
    tofu.mkdir()
    lines = [
        json.dumps({"question": r["question"], "answer": r["answer"]}) for r in tiny_data.author_qa
    ]
    (tofu / "full.json").write_text("\n".join(lines) + "\n")
    out = folder / "bench.json"
    argv = ["--model-path", str(tiny_checkpoint), "--tofu-dir", str(tofu), "--records", "4"]
    argv += ["--steps", "4", "--probe-steps", "1", "2", "--lora-rank", "4", "--output", str(out)]
    assert bench_mpu.main(argv) == 0
    return json.loads(out.read_text())


def test_rows_and_ratios_are_consistent(results):
    local = results["client_round"]
    cfg = results["config"]
    rows = {row["publish"]: row for row in results["rows"]}
    assert set(rows) == {"per-client", "per-round"}
    for clock in ("wall", "cpu"):
        assert local["round"][clock] == pytest.approx(cfg["copies"] * local["one_copy"][clock])
        assert local["one_copy"][clock] > local["probe_low"][clock] > 0
        for row in rows.values():
            assert [len(r) for r in row["publish_s"]] == [cfg["clients"]] * cfg["repeats"]
            r = row[clock]
            fastest = min(sum(s[clock] for s in one) for one in row["publish_s"])
            assert r["publish_per_client_s"] == pytest.approx(fastest / 3)
            overhead = r["publish_per_client_s"] + r["map_back_s"]
            assert r["percent_per_client"] == pytest.approx(100 * overhead / r["round_s"])
            assert r["percent_per_round"] == pytest.approx(3 * r["percent_per_client"])
            assert 0 < row["maps"]["validate"][clock] < r["map_back_s"]
    for row in rows.values():
        assert row["maps"]["tv_dense"]["wall"] > 0 and row["maps"]["tv_factors"]["wall"] > 0
    # per round: the first client's call builds the copies, the others reuse them
    for one in rows["per-round"]["publish_s"]:
        first, *others = (s["wall"] for s in one)
        assert max(others) < first
    assert results["peak_rss_mb"] > 0


def test_report_names_the_target(results):
    text = bench_mpu.format_report(results)
    assert "| per-client |" in text and "| per-round |" in text
    assert "target: publish + map back <= 10 %" in text


def test_probe_steps_must_fit_the_steps():
    with pytest.raises(SystemExit, match="--probe-steps"):
        bench_mpu.main(["--steps", "4", "--probe-steps", "4", "2"])
