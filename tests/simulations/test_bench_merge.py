"""The merge benchmark at a tiny scale: every case runs and the JSON report is consistent."""

import json
import math

import pytest

from fedunlearn.merging import MERGES
from simulations import bench_merge

TINY = ["--tensors", "2", "--rows", "64", "--cols", "32", "--repeats", "1", "--dtype", "fp32"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    assert bench_merge.main([*TINY, "--no-progress", "--output", str(out)]) == 0
    return json.loads(out.read_text())


def test_every_case_present_with_sane_ratios(results):
    cases = results["cases"]
    expected = {"read-pass", "projection-m1", "firm-projected-m1", "projection-m3-exact"}
    expected |= {bench_merge.case_name(n) for n in MERGES}
    assert {"avg", "sum", "ties", "fulm", "fulm-mean", "firm-base"} <= expected
    assert expected <= set(cases)
    assert set(results["case_order"]) == set(cases)
    assert cases["read-pass"]["seconds"] > 0
    for name, case in cases.items():
        ratio = case["ratio_to_read_pass"]
        assert ratio is not None and math.isfinite(ratio) and ratio > 0, name
        assert len(case["all_seconds"]) == 1
    assert cases["fulm"]["details"]["num_clusters"] == 3  # two forget domains + the retain client
    assert results["input"]["main_bytes"] == 7 * 2 * 2 * 64 * 32 * 4
    assert {t["name"] for t in results["targets"]} >= {
        "FIRM base <= 10x read pass",
        "projection (m=1) <= 1x FIRM base",
        "exact projection (m=3) reported",
    }


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
    assert "exact projection (m=3) reported" not in {t["name"] for t in res["targets"]}
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
