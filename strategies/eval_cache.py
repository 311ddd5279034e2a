"""Evaluations of unchanged models, cached: the original and the reference model of a run.

Every run evaluates its original (knowledgeable) model and its retain-only reference before
unlearning; on a real model each evaluation takes minutes. Runs that compare methods on the
same model repeat exactly the same evaluation, so its result is stored under
``<cache>/evaluations/<key>.json`` and reused. The key hashes everything the numbers depend
on: the model's weights (sha256 over every tensor), the scenario's data and evaluation
settings, the MMLU subset, the reference metrics it is compared with, and the source of the
evaluation code (``fedunlearn/evaluation``, ``fedunlearn/scenarios``, ``fedunlearn/benchmarks``,
``fedunlearn/qa_format.py``), so a changed model, setting or metric is evaluated afresh.
A cached file that does not parse is ignored and rewritten.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import fedunlearn
from fedunlearn.files import write_file_atomic
from strategies.results import json_safe
from strategies.settings import RunSettings

EVALUATION_SOURCES = ("evaluation", "scenarios", "benchmarks", "qa_format.py")
#: the ``eval`` options that change a model's metrics (the MMLU folder is keyed by its path)
EVALUATION_KEYS = (
    "retain_samples",
    "max_new_tokens",
    "batch_size",
    "mmlu_subjects",
    "mmlu_per_subject",
)

logger = logging.getLogger(__name__)


def weights_fingerprint(model: torch.nn.Module) -> str:
    """sha256 over the names, dtypes, shapes and bytes of every tensor of ``model``."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}|{flat.dtype}|{tuple(flat.shape)}".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def evaluation_source_hash() -> str:
    """sha256 of the evaluation code's source files."""
    root = Path(fedunlearn.__file__).parent
    digest = hashlib.sha256()
    for name in EVALUATION_SOURCES:
        path = root / name
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            digest.update(str(file.relative_to(root)).encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()


def evaluation_key(
    model: torch.nn.Module,
    settings: RunSettings,
    reference_metrics: dict[str, Any] | None,
    mmlu_folder: Path | None,
) -> str:
    """The cache key of evaluating ``model`` under ``settings`` (see the module docstring)."""
    payload = {
        "weights": weights_fingerprint(model),
        "scenario": settings.scenario.name,
        "scenario_params": dataclasses.asdict(settings.scenario_params()),
        "evaluation": {key: getattr(settings.eval, key) for key in EVALUATION_KEYS},
        "mmlu": str(mmlu_folder) if mmlu_folder else None,
        "reference": json.dumps(json_safe(reference_metrics), sort_keys=True),
        "source": evaluation_source_hash(),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def cached_evaluation(
    cache_dir: Path, key: str, name: str, evaluate: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """``evaluate()``'s result, read from ``<cache_dir>/evaluations/<key>.json`` when an
    earlier run stored it (logged), else computed and stored."""
    path = cache_dir / "evaluations" / f"{key}.json"
    if path.is_file():
        try:
            metrics = json.loads(path.read_text())
            logger.info("%s model: evaluation reused from %s", name, path)
            return metrics
        except (OSError, ValueError) as err:
            logger.warning("cached evaluation %s is unreadable (%s): evaluating again", path, err)
    metrics = json_safe(evaluate())
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomic(path, json.dumps(metrics, indent=2).encode())
    return metrics
