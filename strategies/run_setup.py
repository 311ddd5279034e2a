"""What a run needs before and after the federated part: model, data, evaluation.

Shared by the ServerApp and the offline drivers in ``simulations/`` (sweeps re-merge saved
uploads and must evaluate exactly like the server does).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from logging import INFO
from pathlib import Path
from typing import Any

from flwr.common.logger import log
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fedunlearn.benchmarks.tofu import TofuData, generate_tofu
from fedunlearn.benchmarks.tofu_files import load_tofu_files
from fedunlearn.evaluation import evaluate_tofu
from fedunlearn.models.llama import load_local_causal_lm
from fedunlearn.models.substrate import load_substrate
from strategies.settings import RunSettings


@dataclass
class RunModel:
    """The model to unlearn, its tokenizer, the benchmark data and (if any) the reference."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    data: TofuData
    reference: PreTrainedModel | None = None
    info: dict[str, Any] = field(default_factory=dict)


def load_run_model(settings: RunSettings, *, show_progress: bool = True) -> RunModel:
    """A local checkpoint (``model-path``) or the built-in substrate (built when missing)."""
    if settings.model_path:
        model, tokenizer = load_local_causal_lm(settings.model_path)
        data = (
            load_tofu_files(settings.data_path)
            if settings.data_path
            else generate_tofu(settings.seed, settings.num_authors, settings.qa_per_author)
        )
        return RunModel(model, tokenizer, data, None, {"model_path": settings.model_path})
    substrate = load_substrate(
        settings.substrate_config(),
        Path(settings.cache_dir).expanduser() if settings.cache_dir else None,
        show_progress=show_progress,
    )
    return RunModel(
        substrate.model,
        substrate.tokenizer,
        substrate.data,
        substrate.reference_model,
        {"folder": str(substrate.folder), **substrate.info},
    )


def evaluation_splits(data: TofuData, settings: RunSettings) -> dict[str, list[dict]]:
    """Forget split, a seeded retain sample, and the two never-forgotten sets."""
    retain = data.retain_split(settings.forget_percent)
    rng = random.Random(settings.seed + 7)
    sample = rng.sample(retain, min(settings.eval_retain_samples, len(retain)))
    return {
        "forget": data.forget_split(settings.forget_percent),
        "retain": sample,
        "real_authors": data.real_authors,
        "world_facts": data.world_facts,
    }


def evaluate_model(
    name: str,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    splits: dict[str, list[dict]],
    settings: RunSettings,
    reference_truth_ratios: list[float] | None = None,
) -> dict[str, Any]:
    """SPEC §5.1 metrics of ``model`` (with three sample generations per split)."""
    started = time.perf_counter()
    metrics = evaluate_tofu(
        model,
        tokenizer,
        splits,
        reference_truth_ratios=reference_truth_ratios,
        batch_size=settings.eval_batch_size,
        max_new_tokens=settings.eval_max_new_tokens,
        n_samples=3,
    )
    log(INFO, "evaluated %s model in %.1f s", name, time.perf_counter() - started)
    return metrics
