"""The TOFU metric code against the benchmark authors' own per-question logs (model-free).

``expected_aggregates_llama2.json`` holds aggregates this project computed from the published
llama2-7b per-question logs with the TOFU authors' published formulas; feeding the same
per-question numbers through :func:`aggregate_official_logs` must reproduce every one of them.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedunlearn.benchmarks.data_files import DataFileError
from fedunlearn.evaluation.tofu_logs import OFFICIAL_LOG_FILES
from fedunlearn.evaluation.tofu_metrics import aggregate_official_logs

SHARED_LOGS = Path(__file__).resolve().parents[3] / ".." / "shared" / "data" / "tofu-eval-logs"
EXPECTED_FILE = SHARED_LOGS / "expected_aggregates_llama2.json"
SPLIT_NAMES = {
    "Retain": "retain",
    "Forget": "forget",
    "Real Authors": "real_authors",
    "Real World": "world_facts",
}
METRIC_NAMES = {"Prob.": "prob", "ROUGE": "rouge_l", "Truth Ratio": "truth_ratio"}
LLAMA2_MODELS = [
    f"ft_epoch5_lr1e-05_llama2-7b_{split}_wd{wd}"
    for split in ("full", "retain90", "retain95", "retain99")
    for wd in ("0", "0.01")
]


@pytest.fixture(scope="module")
def expected() -> dict[str, dict[str, Any]]:
    assert EXPECTED_FILE.is_file(), f"{EXPECTED_FILE} is missing: the tests need shared/data"
    return json.loads(EXPECTED_FILE.read_text(encoding="utf-8"))


def _reference_dir(model: str, official: dict[str, Any]) -> Path:
    """The retain-only model the official forget quality is measured against (same wd)."""
    (key,) = [k for k in official if k.startswith("Forget Quality vs ")]
    retain_split = key.removeprefix("Forget Quality vs ")
    return SHARED_LOGS / re.sub(r"_(full|retain\d+)_", f"_{retain_split}_", model)


def _as_project_keys(official: dict[str, Any]) -> dict[str, float]:
    out = {"model_utility": official["Model Utility"]}
    out["forget_quality"] = next(v for k, v in official.items() if k.startswith("Forget Quality"))
    for split_label, split in SPLIT_NAMES.items():
        for metric_label, metric in METRIC_NAMES.items():
            out[f"{split}_{metric}"] = official[f"{metric_label} {split_label}"]
    return out


@pytest.mark.parametrize("model", LLAMA2_MODELS)
def test_aggregates_reproduce_the_expected_numbers(
    model: str, expected: dict[str, dict[str, Any]]
) -> None:
    official = expected[model]
    got = aggregate_official_logs(SHARED_LOGS / model, _reference_dir(model, official))
    want = _as_project_keys(official)
    assert len(want) == 14
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=0.0), key


def test_the_full_model_is_told_apart_from_its_retain_reference(
    expected: dict[str, dict[str, Any]],
) -> None:
    model = "ft_epoch5_lr1e-05_llama2-7b_full_wd0"
    got = aggregate_official_logs(SHARED_LOGS / model, _reference_dir(model, expected[model]))
    assert got["forget_quality"] < 1e-15
    assert got["forget_rouge_l"] > 0.95


def test_truncate_scores_only_the_first_questions(expected: dict[str, dict[str, Any]]) -> None:
    model_dir = SHARED_LOGS / "ft_epoch5_lr1e-05_llama2-7b_full_wd0"
    reference_dir = SHARED_LOGS / "ft_epoch5_lr1e-05_llama2-7b_retain90_wd0"
    log = json.loads((model_dir / "eval_log_forget.json").read_text(encoding="utf-8"))
    rouge = [log["rougeL_recall"][str(i)] for i in range(300)]
    first_100 = aggregate_official_logs(model_dir, reference_dir, truncate=100)
    everything = aggregate_official_logs(model_dir, reference_dir, truncate=None)
    assert first_100["forget_rouge_l"] == pytest.approx(np.mean(rouge[:100]), rel=1e-12)
    assert everything["forget_rouge_l"] == pytest.approx(np.mean(rouge), rel=1e-12)
    assert first_100["forget_quality"] != everything["forget_quality"]


def test_extra_sets_can_use_the_probability_pass_loss(expected: dict[str, dict[str, Any]]) -> None:
    model_dir = SHARED_LOGS / "ft_epoch5_lr1e-05_llama2-7b_full_wd0"
    log = json.loads((model_dir / "eval_real_world_wo_options.json").read_text(encoding="utf-8"))
    answer = np.array(list(log["avg_gt_loss"].values()))
    perturbed = np.array(list(log["average_perturb_loss"].values())).mean(axis=1)
    want = np.mean(np.maximum(0.0, 1.0 - np.exp(answer - perturbed)))
    got = aggregate_official_logs(model_dir, model_dir, extra_truth_ratio_pass="probability")
    assert got["world_facts_truth_ratio"] == pytest.approx(want, rel=1e-12)
    official = expected["ft_epoch5_lr1e-05_llama2-7b_full_wd0"]["Truth Ratio Real World"]
    assert abs(got["world_facts_truth_ratio"] - official) > 1e-4


def test_unknown_extra_truth_ratio_pass_is_refused_before_reading() -> None:
    with pytest.raises(ValueError, match="extra_truth_ratio_pass must be"):
        aggregate_official_logs(
            Path("no-such-dir"), Path("no-such-dir"), extra_truth_ratio_pass="x"
        )


def _damaged_copy(tmp_path: Path, model: str) -> Path:
    source = SHARED_LOGS / model
    assert source.is_dir(), f"{source} is missing: the tests need shared/data"
    copy = tmp_path / model
    copy.mkdir()
    for name in OFFICIAL_LOG_FILES.values():  # plain, writable copies of the per-set logs
        shutil.copyfile(source / name, copy / name)
    return copy


def test_log_without_a_field_names_file_and_field(tmp_path: Path) -> None:
    copy = _damaged_copy(tmp_path, "ft_epoch5_lr1e-05_llama2-7b_retain90_wd0")
    path = copy / "eval_real_author_wo_options.json"
    log = json.loads(path.read_text(encoding="utf-8"))
    del log["average_perturb_loss"]
    path.write_text(json.dumps(log), encoding="utf-8")
    with pytest.raises(
        DataFileError, match=r"eval_real_author_wo_options\.json: no .* 'average_perturb_loss'"
    ):
        aggregate_official_logs(copy, copy)


def test_missing_log_file_is_named(tmp_path: Path) -> None:
    copy = _damaged_copy(tmp_path, "ft_epoch5_lr1e-05_llama2-7b_retain90_wd0")
    (copy / "eval_log_forget.json").unlink()
    with pytest.raises(
        DataFileError, match=r"eval_log_forget\.json: TOFU evaluation log not found"
    ):
        aggregate_official_logs(copy, SHARED_LOGS / "ft_epoch5_lr1e-05_llama2-7b_retain90_wd0")


def test_questions_out_of_order_are_read_in_index_order(tmp_path: Path) -> None:
    model = "ft_epoch5_lr1e-05_llama2-7b_retain90_wd0"
    copy = _damaged_copy(tmp_path, model)
    path = copy / "eval_log.json"
    log = json.loads(path.read_text(encoding="utf-8"))
    shuffled = {field: dict(reversed(column.items())) for field, column in log.items()}
    path.write_text(json.dumps(shuffled), encoding="utf-8")
    assert aggregate_official_logs(copy, copy) == aggregate_official_logs(
        SHARED_LOGS / model, SHARED_LOGS / model
    )
