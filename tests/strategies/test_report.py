"""report.html from a results dictionary: escaping, exclusions, runs without evaluation."""

from pathlib import Path

from strategies.report import render_report, write_report

NAMES = ("forget_accuracy", "general_accuracy", "privleak")


def _results(**overrides):
    results = {
        "config": {
            "scenario.name": "wmdp",
            "merge": "firm",
            "model.name": "builtin",
            "firm.epsilon": 0.5,
        },
        "metrics": {
            "before": {
                "forget_accuracy": 1.0,
                "general_accuracy": 0.98,
                "privleak": 37.5,
                "samples": {"bio": [{"question": "Q<1>", "correct": "A", "chosen": "A"}]},
            },
            "after": {
                "forget_accuracy": 0.56,
                "general_accuracy": 0.93,
                "privleak": 12.0,
                "samples": {"bio": [{"question": "Q<1>", "correct": "A", "chosen": "<script>x"}]},
            },
        },
        "clients": [
            {"node_id": 11, "role": "forget", "domain": "bio", "bytes_task_vector": 2_500_000},
            {"node_id": 12, "role": "retain", "excluded": "task vector has NaN in layer.0"},
        ],
        "merge": {
            "method": "firm",
            "params": {"gamma": 4.0, "epsilon": 0.5},
            "tensors": {
                "model.layers.0.mlp.down_proj.weight": {
                    "norm_base": 2.0,
                    "norm_final": 1.5,
                    "damage_before": {"12": 0.9},
                    "damage_after": {"12": 0.5},
                    "multipliers": {"12": 0.25},
                }
            },
        },
        "seconds": {"total": 3.5, "server_peak_rss_bytes": 2_000_000_000},
    }
    results.update(overrides)
    return results


def test_values_exclusions_and_escaping():
    page = render_report(_results(), NAMES)
    assert "<td>0.56</td>" in page and "<td>0.93</td>" in page
    assert "<td>12</td>" in page  # privleak (per cent) is tabled, not plotted
    assert page.count("src='data:image/png;base64,") == 2
    assert "<tr class='bad'>" in page and "task vector has NaN in layer.0" in page
    assert "<td>2.50 MB</td>" in page and "<td>2.00 GB</td>" in page
    assert "<td>0.9 → 0.5</td><td>0.25</td>" in page
    assert "<script>" not in page and "&lt;script&gt;x" in page and "Q&lt;1&gt;" in page
    # the run section reads results.json's dotted config keys
    assert "<h1>fedunlearn run: wmdp / firm</h1>" in page
    assert "<th class='text'>firm.epsilon</th>" in page and "<th class='text'>merge</th>" in page
    mpu = {**_results()["config"], "wrapper": "mpu", "merge": "ties"}
    assert "fedunlearn run: wmdp / mpu + ties" in render_report(_results(config=mpu), NAMES)
    dp2u = {**_results()["config"], "pipeline": "dp2u"}
    assert "fedunlearn run: wmdp / dp2u" in render_report(_results(config=dp2u), NAMES)


def test_run_without_evaluation_and_atomic_write(tmp_path: Path):
    path = write_report(_results(metrics={}), NAMES, tmp_path / "report.html")
    page = path.read_text(encoding="utf-8")
    assert "Not evaluated (evaluate=false)" in page
    assert page.count("src='data:image/png;base64,") == 1  # only the damage plot
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]


def test_request_schedule_section_plots_every_request_and_the_reference_row():
    from strategies.report_requests import requests_section

    def request(served_in: int, values: list[float]) -> dict:
        return {
            "round": served_in,
            "client": served_in - 1,
            "metrics_by_round": {str(r + 1): {"forget_rouge_l": v} for r, v in enumerate(values)},
            "metrics_ci_by_round": {
                str(r + 1): {"forget_rouge_l": [v - 0.05, v + 0.05]} for r, v in enumerate(values)
            },
            "reference": {"forget_rouge_l": 0.6},
            "reference_ci": {"forget_rouge_l": [0.55, 0.65]},
        }

    results = {
        "requests": [request(1, [0.66, 0.65]), request(2, [0.98, 0.46])],
        "rounds": [
            {"round": 1, "requests_served": 1, "model_utility": 0.51, "retain_rouge_l": 0.96},
            {"round": 2, "requests_served": 2, "model_utility": 0.46, "retain_rouge_l": 0.80},
        ],
    }
    page = requests_section(results)
    assert page.count("<img") == 1 and "Deletion requests" in page
    assert "0.460 <span class='note'>[0.410, 0.510]</span>" in page  # request 2 after round 2
    assert "<td>reference</td>" in page and "0.600 <span class='note'>[0.550, 0.650]" in page
    assert requests_section({"requests": [], "rounds": []}) == ""
