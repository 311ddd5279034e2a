"""Reading the official TOFU per-question evaluation logs (model-free metric fixtures).

The TOFU authors published, per fine-tuned model, one JSON log per evaluation set
(``eval_log.json`` = retain, ``eval_log_forget.json`` = forget,
``eval_real_author_wo_options.json``, ``eval_real_world_wo_options.json``). Each maps a field
name to ``{"0": value, "1": value, ...}``; the fields used here are ``avg_gt_loss`` (mean token
NLL of the answer), ``avg_paraphrased_loss``, ``average_perturb_loss`` (one mean NLL per
perturbed answer) and ``rougeL_recall``. This module only reads them into per-question tensors;
the metrics are computed by :mod:`fedunlearn.evaluation.tofu_metrics`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fedunlearn.benchmarks.data_files import DataFileError

__all__ = ["OFFICIAL_LOG_FILES", "SplitLog", "read_official_log_dir", "read_split_log"]

#: Split name (as in ``tofu_metrics.SPLIT_KINDS``) -> official log file name.
OFFICIAL_LOG_FILES: dict[str, str] = {
    "forget": "eval_log_forget.json",
    "retain": "eval_log.json",
    "real_authors": "eval_real_author_wo_options.json",
    "world_facts": "eval_real_world_wo_options.json",
}
_FIELDS = ("avg_gt_loss", "avg_paraphrased_loss", "average_perturb_loss", "rougeL_recall")


@dataclass(frozen=True)
class SplitLog:
    """Per-question numbers of one evaluation set, in question order.

    ``nll_perturbed`` is ``[n, k]`` with NaN padding where a question has fewer perturbed
    answers; the other tensors are ``[n]``. On the extra sets (real authors, world facts)
    ``nll_paraphrased`` is the answer itself, scored a second time in the truth-ratio pass.
    """

    nll_answer: torch.Tensor
    nll_paraphrased: torch.Tensor
    nll_perturbed: torch.Tensor
    rouge_l_recall: torch.Tensor


def _ordered_values(path: Path, log: dict[str, Any], field: str) -> list[Any]:
    column = log.get(field)
    if not isinstance(column, dict) or not column:
        raise DataFileError(f"{path}: no per-question field {field!r}")
    try:
        keys = sorted(column, key=int)
    except ValueError as err:
        raise DataFileError(f"{path}: field {field!r} has a non-integer question index") from err
    if [int(k) for k in keys] != list(range(len(keys))):
        raise DataFileError(f"{path}: field {field!r} does not index questions 0..{len(keys) - 1}")
    return [column[k] for k in keys]


def _padded(path: Path, rows: list[Any]) -> torch.Tensor:
    lists = [r if isinstance(r, list) else [r] for r in rows]
    if any(not r for r in lists):
        raise DataFileError(f"{path}: a question without perturbed-answer losses")
    out = torch.full((len(lists), max(len(r) for r in lists)), math.nan, dtype=torch.float64)
    for i, r in enumerate(lists):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float64)
    return out


def read_split_log(path: Path) -> SplitLog:
    """Read one official per-set log; errors name the file and the field."""
    path = Path(path)
    if not path.is_file():
        raise DataFileError(f"{path}: TOFU evaluation log not found")
    try:
        log = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataFileError(f"{path}: not a readable json file: {err}") from err
    if not isinstance(log, dict):
        raise DataFileError(f"{path}: expected a JSON object of per-question fields")
    values = {field: _ordered_values(path, log, field) for field in _FIELDS}
    sizes = {field: len(v) for field, v in values.items()}
    if len(set(sizes.values())) != 1:
        raise DataFileError(f"{path}: fields hold different numbers of questions: {sizes}")
    scalars = {
        field: torch.tensor(values[field], dtype=torch.float64)
        for field in ("avg_gt_loss", "avg_paraphrased_loss", "rougeL_recall")
    }
    return SplitLog(
        nll_answer=scalars["avg_gt_loss"],
        nll_paraphrased=scalars["avg_paraphrased_loss"],
        nll_perturbed=_padded(path, values["average_perturb_loss"]),
        rouge_l_recall=scalars["rougeL_recall"],
    )


def read_official_log_dir(log_dir: Path) -> dict[str, SplitLog]:
    """The four per-set logs of one model folder, keyed by split name."""
    log_dir = Path(log_dir)
    if not log_dir.is_dir():
        raise DataFileError(f"{log_dir}: TOFU evaluation log folder not found")
    return {split: read_split_log(log_dir / name) for split, name in OFFICIAL_LOG_FILES.items()}
