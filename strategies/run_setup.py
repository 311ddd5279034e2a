"""What a run needs before and after the federated part: model, data, evaluation.

Shared by the ServerApp and the offline drivers in ``simulations/`` (sweeps re-merge saved
uploads and must evaluate exactly like the server does).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from logging import INFO
from pathlib import Path
from typing import Any

import torch
from flwr.common.logger import log
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fedunlearn.models.llama import load_local_causal_lm, resolve_dtype
from fedunlearn.models.substrate import load_substrate
from fedunlearn.scenarios import Scenario, get_scenario
from strategies.settings import RunSettings


@dataclass
class RunModel:
    """The model to unlearn, its tokenizer, the scenario and (if any) the reference."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    scenario: Scenario
    reference: PreTrainedModel | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def data(self) -> Any:
        """The scenario's benchmark data."""
        return self.scenario.data


def load_run_model(settings: RunSettings, *, show_progress: bool = True) -> RunModel:
    """A local checkpoint (``model-path``) or the built-in substrate (built when missing)."""
    scenario = get_scenario(settings.scenario)(settings.scenario_params())
    if settings.model_path:
        dtype = resolve_dtype(settings.dtype)
        model, tokenizer = load_local_causal_lm(settings.model_path, dtype=dtype)
        if torch.cuda.is_available():
            model.to("cuda")
        info = {"model_path": settings.model_path, "dtype": str(dtype).removeprefix("torch.")}
        return RunModel(model, tokenizer, scenario, None, info)
    substrate = load_substrate(
        settings.substrate_config(),
        Path(settings.cache_dir).expanduser() if settings.cache_dir else None,
        show_progress=show_progress,
    )
    return RunModel(
        substrate.model,
        substrate.tokenizer,
        scenario,
        substrate.reference_model,
        {"folder": str(substrate.folder), **substrate.info},
    )


def evaluate_model(
    name: str,
    model: PreTrainedModel,
    run_model: RunModel,
    settings: RunSettings,
    reference_metrics: dict[str, Any] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """The scenario's metrics of ``model`` (with three sample generations per split);
    ``kwargs`` go to :meth:`Scenario.evaluate` (e.g. custom TOFU ``splits``)."""
    started = time.perf_counter()
    metrics = run_model.scenario.evaluate(
        model,
        run_model.tokenizer,
        reference_metrics=reference_metrics,
        batch_size=settings.eval_batch_size,
        max_new_tokens=settings.eval_max_new_tokens,
        n_samples=3,
        **kwargs,
    )
    log(INFO, "evaluated %s model in %.1f s", name, time.perf_counter() - started)
    return metrics
