"""What a run needs before and after the federated part: model, data, evaluation.

Shared by the ServerApp and the offline drivers in ``simulations/`` (sweeps re-merge saved
uploads and must evaluate exactly like the server does).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from logging import INFO
from pathlib import Path
from typing import Any

import torch
from flwr.common.logger import log
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from fedunlearn.benchmarks.mmlu_files import load_mmlu_csv, mmlu_subset
from fedunlearn.evaluation.harness_mc import harness_accuracy
from fedunlearn.evaluation.intervals import record_scores
from fedunlearn.files import default_cache_dir
from fedunlearn.models.finetuned import FINETUNED_INFO, FinetuneRecipe, ensure_finetuned
from fedunlearn.models.llama import load_local_causal_lm, resolve_dtype
from fedunlearn.models.pretrained import ensure_converted, pretrained_checkpoint
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
    #: the checkpoint folder ``model`` was loaded from (a simulated node's base: the server
    #: offers it, ``strategies.model_delivery``); None when there is none
    checkpoint: Path | None = None
    #: a real model's general-utility questions (zero-shot MMLU subset); empty = not scored
    general_questions: list[dict[str, Any]] = field(default_factory=list)

    @property
    def data(self) -> Any:
        """The scenario's benchmark data."""
        return self.scenario.data


def load_run_model(settings: RunSettings, *, show_progress: bool = True) -> RunModel:
    """A local checkpoint or GGUF file (``model.path``), a registry model fine-tuned on the
    scenario's data (``model``), or the built-in substrate (each built when missing); a
    real model also gets its MMLU subset (:func:`general_questions`)."""
    run_model = _load_model(settings, show_progress=show_progress)
    run_model.general_questions = general_questions(settings)
    return run_model


def general_questions(settings: RunSettings) -> list[dict[str, Any]]:
    """The seeded MMLU subset (``eval.mmlu-subjects`` × ``eval.mmlu-per-subject`` test questions)
    a real model is scored on before and after unlearning; [] without an MMLU folder."""
    folder = settings.mmlu_folder()
    if folder is None:
        return []
    records = load_mmlu_csv(folder, split="test")
    return mmlu_subset(
        records,
        subjects=settings.eval.mmlu_subjects,
        per_subject=settings.eval.mmlu_per_subject,
        seed=settings.seed,
    )


def _load_model(settings: RunSettings, *, show_progress: bool) -> RunModel:
    scenario = get_scenario(settings.scenario.name)(settings.scenario_params())
    cache_dir = Path(settings.model.cache_dir).expanduser() if settings.model.cache_dir else None
    dtype = resolve_dtype(settings.model.dtype)
    if settings.model.path:
        path = Path(settings.model.path).expanduser()
        if path.suffix == ".gguf":
            path = ensure_converted(path, cache_dir or default_cache_dir())
        model, tokenizer = load_local_causal_lm(path, dtype=dtype)
        if torch.cuda.is_available():
            # PreTrainedModel.to is @wraps(nn.Module.to): typed as unbound (self = argument 1)
            model.to("cuda")  # type: ignore[arg-type]
        info = {"model_path": settings.model.path, "dtype": str(dtype).removeprefix("torch.")}
        return RunModel(model, tokenizer, scenario, None, info, path.resolve())
    if settings.model.name != "builtin":
        return _finetuned_run_model(settings, scenario, cache_dir or default_cache_dir(), dtype)
    substrate = load_substrate(settings.substrate_config(), cache_dir, show_progress=show_progress)
    return RunModel(
        substrate.model,
        substrate.tokenizer,
        scenario,
        substrate.reference_model,
        {"folder": str(substrate.folder), **substrate.info},
        (substrate.folder / "knowledgeable").resolve(),
    )


def finetune_recipe(settings: RunSettings) -> FinetuneRecipe:
    """How a registry model is fine-tuned on the scenario's data (``model-finetune-*``)."""
    return FinetuneRecipe(
        epochs=settings.model.finetune_epochs,
        lr=settings.model.finetune_lr,
        batch_size=settings.training.batch_size,
        seed=settings.seed,
    )


def _finetuned_run_model(
    settings: RunSettings, scenario: Scenario, cache_dir: Path, dtype: torch.dtype
) -> RunModel:
    """Registry model ``model`` (converted once), fine-tuned on the scenario's data into the
    knowledgeable model and the retain-only reference (cached: ``fedunlearn.models.finetuned``)."""
    base = pretrained_checkpoint(settings.model.name, cache_dir)
    folder = ensure_finetuned(base, scenario, finetune_recipe(settings), cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer", local_files_only=True)
    model, _ = load_local_causal_lm(folder / "knowledgeable", dtype=dtype, tokenizer=tokenizer)
    reference, _ = load_local_causal_lm(folder / "reference", dtype=dtype, tokenizer=tokenizer)
    if torch.cuda.is_available():
        # PreTrainedModel.to is @wraps(nn.Module.to): typed as unbound (self = argument 1)
        model.to("cuda")  # type: ignore[arg-type]
        reference.to("cuda")  # type: ignore[arg-type]
    info = json.loads((folder / FINETUNED_INFO).read_text())
    info.update({"folder": str(folder), "pretrained": str(base), "model": settings.model.name})
    return RunModel(
        model, tokenizer, scenario, reference, info, (folder / "knowledgeable").resolve()
    )


def pretrained_state(settings: RunSettings, run_model: RunModel) -> dict[str, torch.Tensor]:
    """θ_pretrained for MPU's task-vector σ (``mpu.sigma-source='task-vector'``):
    ``mpu.pretrained-path`` or, for the built-in model, the substrate's pre-trained stage."""
    if settings.mpu.pretrained_path:
        path = Path(settings.mpu.pretrained_path).expanduser()
    elif "folder" in run_model.info:
        path = Path(run_model.info["folder"]) / "pretrained"
    else:
        raise ValueError("mpu.sigma-source='task-vector' needs mpu.pretrained-path")
    if not path.is_dir():
        raise FileNotFoundError(f"mpu.pretrained-path {path} is not a checkpoint folder")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"mpu.pretrained-path {path} has no config.json")
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    expected = run_model.model.state_dict()
    wrong = [k for k, v in expected.items() if k in state and state[k].shape != v.shape]
    if wrong:
        raise ValueError(
            f"mpu.pretrained-path {path}: tensor {wrong[0]!r} has shape "
            f"{tuple(state[wrong[0]].shape)}, the model's is {tuple(expected[wrong[0]].shape)}"
        )
    return state


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
        batch_size=settings.eval.batch_size,
        max_new_tokens=settings.eval.max_new_tokens,
        n_samples=3,
        **kwargs,
    )
    if run_model.general_questions:
        mmlu = harness_accuracy(
            model,
            run_model.tokenizer,
            run_model.general_questions,
            batch_size=settings.eval.batch_size,
            disable_tqdm=True,
        )
        metrics["mmlu_accuracy"] = mmlu["accuracy"]
        metrics["mmlu_questions"] = mmlu["n"]
        questions = [r["question"] for r in run_model.general_questions]
        record_scores(metrics, "mmlu_accuracy", mmlu["hits"], "mmlu", questions)
    log(INFO, "evaluated %s model in %.1f s", name, time.perf_counter() - started)
    return metrics


def client_settings(settings: RunSettings) -> dict[str, Any]:
    """What every client needs besides the model: scenario parameters (to rebuild its own
    data shard locally), training and LoRA settings, objective options."""
    return {
        "scenario": settings.scenario.name,
        "scenario-params-json": json.dumps(dataclasses.asdict(settings.scenario_params())),
        "objective": settings.objective.name,
        "objective-options-json": json.dumps(settings.objective_options()),
        "batch-size": settings.training.batch_size,
        "lora-rank": settings.lora.rank,
        "lora-alpha": settings.lora.alpha,
        "lora-targets": settings.lora.targets,
        "lora-layers": settings.lora.layers,
        "finetune": settings.training.finetune,
        "load-in-4bit": settings.model.load_in_4bit,
        "dtype": settings.model.dtype,
        "fisher-batches": settings.training.fisher_batches,
        "task-vector-upload": settings.upload.task_vector,
        "fisher-upload": settings.upload.fisher,
        "fisher-upload-fraction": settings.upload.fisher_fraction,
        "seed": settings.client_seed(),
        "client-threads": settings.training.client_threads,
        "activation-checkpointing": settings.activation_checkpointing(),
    }
