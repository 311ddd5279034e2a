"""The merge benchmark at a tiny scale: every case runs and the JSON report is consistent."""

import json
import math

import pytest
import torch

from fedunlearn.merging import MERGES
from fedunlearn.upload_codec import DecodedTensors
from simulations import bench_merge
from strategies.upload_spool import UploadSpool

TINY = ["--tensors", "2", "--rows", "64", "--cols", "32", "--repeats", "1", "--dtype", "fp32"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    assert bench_merge.main([*TINY, "--no-progress", "--output", str(out)]) == 0
    return json.loads(out.read_text())


def test_every_case_present_with_sane_ratios(results):
    cases = results["cases"]
    expected = {"read-pass", "projection-m1", "firm-projected-m1", "projection-m3-exact"}
    expected |= {bench_merge.case_name(n) for n in MERGES} | {"firm-streaming"}
    assert {"avg", "sum", "ties", "fulm", "fulm-mean", "firm-base"} <= expected
    assert expected <= set(cases)
    assert set(results["case_order"]) == set(cases)
    assert cases["read-pass"]["seconds"] > 0
    for name, case in cases.items():
        ratio = case["ratio_to_read_pass"]
        assert ratio is not None and math.isfinite(ratio) and ratio > 0, name
        if name != "read-pass":
            assert len(case["all_seconds"]) == 1
    assert cases["fulm"]["details"]["num_clusters"] == 3  # two forget domains + the retain client
    assert results["input"]["main_bytes"] == 7 * 2 * 2 * 64 * 32 * 4
    assert [t["name"] for t in results["targets"]] == [
        "FIRM base <= 3x read pass",
        "TIES <= 8x read pass",
        "FULM <= 8x read pass",
        "projection (m=1) <= 1x FIRM base",
        "exact projection (m=3) <= 2x FIRM base",
    ]
    for t in results["targets"]:
        assert t["met"] == (t["value"] <= t["limit"])


def test_read_pass_interleaved_and_is_the_minimum(results):
    reads = results["cases"]["read-pass"]
    # one read pass at the start (repeats = 1) and one before every other case's repetition
    assert len(reads["all_seconds"]) == len(results["cases"])
    assert reads["seconds"] == min(reads["all_seconds"])
    check = results["baseline_check"]
    assert check["read_pass_seconds"] == reads["seconds"]
    assert check["avg_below_read_pass"] == (check["avg_seconds"] < reads["seconds"])
    firm = results["cases"]["firm-base"]
    assert firm["ratio_to_read_pass"] == pytest.approx(firm["seconds"] / reads["seconds"])


def test_avg_below_baseline_is_flagged():
    bench = bench_merge._Bench(bench_merge.BenchConfig(), [], [], bench_merge.ReadPasses([]), None)
    bench.reads.seconds += [0.5, 0.4]
    bench.cases["avg"] = {"seconds": 0.3}
    check = bench_merge._finish_baseline(bench)
    assert check["avg_below_read_pass"] and check["read_pass_seconds"] == 0.4
    assert any("AVG ran faster" in n for n in bench.notes)
    bench.cases["avg"] = {"seconds": 0.45}
    assert not bench_merge._finish_baseline(bench)["avg_below_read_pass"]


def test_streaming_case_merges_the_same_uploads_from_disk(results):
    stream = results["cases"]["firm-streaming"]["details"]
    base = results["cases"]["firm-base"]["details"]
    assert stream["norm_final"] == base["norm_final"]
    assert stream["spool_bytes"] > results["input"]["main_bytes"]  # plus safetensors headers
    assert not stream["inputs_in_memory"]
    assert len(stream["all_spool_write_seconds"]) == results["config"]["repeats"]
    for case in results["cases"].values():
        if "first_seconds" in case:
            assert case["first_seconds"] == case["all_seconds"][0]
    assert results["cases"]["firm-streaming"]["peak_extra_rss_bytes"] is not None
    assert not list((bench_merge.REPO_ROOT / "outputs" / "bench").glob("spool-*"))


def test_spooled_rounds_store_the_uploads_afresh_as_the_server_does(tmp_path):
    """Every call is a new round of the server's spool (the previous files removed): the
    clients read back one weight at a time from new memory maps, equal to the uploads."""
    cfg = bench_merge.BenchConfig(tensors=2, rows=8, cols=4, dtype="bf16")
    updates, _ = bench_merge.make_inputs(cfg)
    rounds = bench_merge.SpooledRounds(UploadSpool(tmp_path / "spool"), updates)
    for r in (1, 2):
        rounds()
        files = sorted(p.name for p in (tmp_path / "spool" / f"round-{r}").iterdir())
        assert files == sorted(f"node-{u.node_id}.safetensors" for u in updates)
        assert not (tmp_path / "spool" / f"round-{r - 1}").exists()
        for mem, disk in zip(updates, rounds.updates, strict=True):
            assert isinstance(disk.task_vector, DecodedTensors)
            assert list(disk.task_vector) == list(mem.task_vector)
            for key in mem.task_vector:
                assert torch.equal(disk.task_vector[key], mem.task_vector[key])
                assert torch.equal(disk.fisher[key], mem.fisher[key])  # type: ignore[index]
    assert len(rounds.write_seconds) == 2 and rounds.spool_bytes > 0
    rounds.spool.clear()
    assert not (tmp_path / "spool").exists()


@pytest.mark.parametrize("case", ["projection-m1", "firm-projected-m1", "projection-m3-exact"])
def test_projection_active_and_feasible(results, case):
    details = results["cases"][case]["details"]
    eps = details["summary"]["epsilon"]
    assert eps == pytest.approx(results["epsilon"]["m3" if "m3" in case else "m1"])
    per_tensor = details["per_tensor"]
    assert len(per_tensor) == 2
    assert details["summary"]["active_tensors"] >= 1
    for rep in per_tensor.values():
        assert max(rep["damage_after"]) <= eps * (1 + bench_merge.BUDGET_RTOL)
        if rep["active"]:
            assert max(rep["damage_before"]) > eps
    if case.endswith("exact"):
        assert all(len(rep["multipliers"]) == 3 for rep in per_tensor.values())
        assert details["summary"]["converged_all"]


def test_report_text(results):
    text = bench_merge.format_report(results)
    assert "firm-base" in text and "Targets:" in text and "217" in text


@pytest.mark.parametrize(
    "argv",
    [
        ["--domains", "7"],
        ["--rows", "0"],
        ["--epsilon-factor", "1.5"],
        ["--multi-retain", "1"],
        ["--paper-scale", "--rows", "8"],
        ["--dtype", "fp16"],
    ],
)
def test_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as err:
        bench_merge.main(argv)
    assert err.value.code == 2
    assert "error" in capsys.readouterr().err


def test_cases_selects_cases(tmp_path):
    out = tmp_path / "bench.json"
    argv = [*TINY, "--no-progress", "--output", str(out)]
    assert bench_merge.main([*argv, "--cases", "projection-m1, firm-projected-m1"]) == 0
    res = json.loads(out.read_text())
    assert set(res["cases"]) == {"read-pass", "projection-m1", "firm-projected-m1"}
    assert res["case_order"] == ["read-pass", "projection-m1", "firm-projected-m1"]
    assert res["config"]["cases"] == ["projection-m1", "firm-projected-m1"]
    assert res["epsilon"]["m1"] > 0 and res["epsilon"]["m3"] is None
    assert res["cases"]["projection-m1"]["details"]["summary"]["active_tensors"] >= 1
    assert not any("m=3" in t["name"] for t in res["targets"])
    assert "projection-m1" in bench_merge.format_report(res)


@pytest.mark.parametrize("cases", ["firm-base,nonsense", "", "projection-m3-exact"])
def test_bad_cases(cases, capsys):
    argv = [*TINY, "--cases", cases]
    if cases == "projection-m3-exact":
        argv += ["--multi-retain", "0"]
    with pytest.raises(SystemExit) as err:
        bench_merge.main(argv)
    assert err.value.code == 2
    assert "--cases" in capsys.readouterr().err
