"""The ``unlearn`` pipeline of the ServerApp: evaluate, federate, evaluate again.

Multi-round runs resume from ``<output-dir>/checkpoint``; the strategy is the merge the run
config names (:class:`~strategies.merge_strategy.MergeStrategy`), or MPU around it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping, MutableMapping, Sequence
from logging import INFO
from pathlib import Path
from typing import Any, cast

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from transformers import PreTrainedModel

from fedunlearn.files import default_cache_dir
from fedunlearn.scenarios import ClientAssignment, fold_mixed
from fedunlearn.uploads import save_uploads
from strategies.checkpoint import (
    CHECKPOINT_DIR,
    CheckpointError,
    RunCheckpoint,
    config_fingerprint,
    model_structure,
)
from strategies.copy_files import COPIES_DIR, CopyFiles
from strategies.eval_cache import cached_evaluation, evaluation_key
from strategies.memory import peak_rss_bytes
from strategies.merge_strategy import MergeStrategy
from strategies.mpu_strategy import MpuStrategy
from strategies.run_setup import RunModel, client_settings, evaluate_model, pretrained_state
from strategies.secret_files import given_secret
from strategies.settings import RunSettings
from strategies.streaming_grid import StreamingGrid
from strategies.upload_spool import SPOOL_DIR, UploadSpool
from wire.arrays import array_tensor, weight_array, weights_record
from wire.delivery import model_digests
from wire.messages import describe_model


def run_unlearning(
    grid: Grid,
    settings: RunSettings,
    run_model: RunModel,
    output_dir: Path,
    phases: dict[str, Any],
    run_started: float,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``unlearn`` pipeline: evaluate, run the federated rounds of the merge strategy
    (resuming from ``<output-dir>/checkpoint``), evaluate the unlearned model; returns the
    results and the metrics. ``phases`` collects the seconds of each phase."""
    model = run_model.model
    checkpoint, done, resumed_state, resumed_record = open_checkpoint(settings, output_dir, model)

    t0 = time.perf_counter()
    metrics = evaluate_before(settings, run_model)
    reference_metrics = metrics.get("reference")
    run_model.reference = None  # its metrics are all the run needs of it: free its weights
    phases["evaluation_before"] = time.perf_counter() - t0

    base = initial_digests(settings, run_model) if done else None  # round 1's are θ_base
    strategy = build_strategy(settings, run_model, checkpoint, done, output_dir, base_digests=base)
    t0 = time.perf_counter()
    final: MutableMapping[str, Any]  # the final weights, taken out as they are loaded
    shapes: dict[str, torch.Size] | None = None  # the emptied parameters' shapes
    if done >= settings.num_rounds:
        log(INFO, "all %d rounds were finished before: evaluating the saved weights", done)
        assert resumed_state is not None  # done >= num-rounds >= 1: a round was loaded
        final, record = resumed_state, resumed_record
    else:
        # while the rounds run, the weights live in the strategy's arrays only
        if resumed_state is not None:
            initial, shapes = weights_record(resumed_state), release_parameters(model)
            resumed_state = None
        else:
            initial, shapes = move_into_arrays(model)
        try:
            final, record = federate(grid, strategy, settings, initial, done)
        except BaseException:
            strategy.release_weights()  # e.g. MPU's copy files are removed
            raise
        del initial
    phases["federated_round"] = time.perf_counter() - t0

    # the original model becomes the unlearned one in place (its metrics are taken)
    load_into(model, final, shapes)
    del final
    strategy.release_weights()  # the model holds the final weights now
    unlearned = model
    t0 = time.perf_counter()
    if settings.evaluate:
        metrics["after"] = evaluate_model(
            "unlearned", unlearned, run_model, settings, reference_metrics
        )
    phases["evaluation_after"] = time.perf_counter() - t0
    phases["total"] = time.perf_counter() - run_started

    results = {
        "config": settings.as_dict(),
        "metrics": metrics,
        "clients": record["clients"],
        "merge": record["merge"],
        "substrate": run_model.info,
        **({"mpu": record["mpu"]} if "mpu" in record else {}),
        "assignments": record["assignments"],
        "seconds": phases,
        "server_peak_rss_mb": peak_rss_bytes() / 2**20,
        **({"resumed_from_round": done} if done else {}),
    }
    if settings.save_uploads and strategy.last_updates:
        results["uploads"] = str(save_uploads(strategy.last_updates, output_dir / "uploads"))
    elif settings.save_uploads:
        log(INFO, "no round ran in this process: the uploads of the last round are not saved")
    if strategy.spool is not None:
        strategy.spool.clear()
    phases["server_peak_rss_bytes"] = peak_rss_bytes()
    return results, metrics


def federate(
    grid: Grid,
    strategy: MergeStrategy,
    settings: RunSettings,
    initial: ArrayRecord,
    done: int,
    rounds: int | None = None,
) -> tuple[ArrayRecord, dict[str, Any]]:
    """Rounds ``done + 1 .. num-rounds`` (or ``done + 1 .. done + rounds``) of ``strategy``
    from ``initial`` (θ, or the resumed weights): the final weights and the strategy's
    record."""
    result = strategy.start(
        # a StreamingGrid is the Grid with send_and_receive streamed (it forwards the rest)
        grid=(
            cast(
                Grid,
                StreamingGrid(
                    grid, strategy.receive_reply, max_in_flight=settings.server.max_in_flight
                ),
            )
            if settings.upload.stream
            else grid
        ),
        initial_arrays=initial,
        # Flower counts them from 1 (+ round_offset)
        num_rounds=settings.num_rounds - done if rounds is None else rounds,
        timeout=settings.server.round_timeout,
        train_config=ConfigRecord(),
    )
    return result.arrays, strategy.round_record()


def move_into_arrays(model: torch.nn.Module) -> tuple[ArrayRecord, dict[str, torch.Size]]:
    """The model's weights as the arrays the rounds start from, in the model's own dtype
    (:mod:`wire.arrays`), moved one tensor at a time: a parameter's storage is freed once
    every key of it is in the arrays, so the weights are never held twice. Returns the
    arrays and the emptied parameters' shapes (for :func:`load_into`)."""
    shapes = {name: param.shape for name, param in model.named_parameters()}
    owners = {param.data_ptr(): param for param in model.parameters()}
    state = model.state_dict()
    keys_left = Counter(tensor.data_ptr() for tensor in state.values())
    arrays = ArrayRecord()
    for key in list(state):
        tensor = state.pop(key).detach()
        arrays[key] = weight_array(tensor)
        pointer = tensor.data_ptr()
        del tensor
        keys_left[pointer] -= 1
        if keys_left[pointer] == 0 and pointer in owners:
            param = owners.pop(pointer)
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    return arrays, shapes


def load_into(
    model: torch.nn.Module,
    weights: MutableMapping[str, Any],
    shapes: Mapping[str, torch.Size] | None = None,
) -> None:
    """Copy ``weights`` (tensors or arrays) into ``model`` and take each out of ``weights``
    once copied; parameters emptied by :func:`move_into_arrays` or
    :func:`release_parameters` (``shapes``) get storage again first."""
    if shapes is not None:
        for name, param in model.named_parameters():
            if param.shape != shapes[name]:  # emptied: its values come from ``weights``
                param.data = torch.empty(shapes[name], dtype=param.dtype, device=param.device)
    state = model.state_dict()
    with torch.no_grad():
        for key in list(weights):
            value = weights.pop(key)
            state[key].copy_(array_tensor(value) if isinstance(value, Array) else value)


def release_parameters(model: torch.nn.Module) -> dict[str, torch.Size]:
    """Free the storage of every parameter of ``model`` (tied ones once); returns their
    shapes for :func:`load_into`."""
    shapes = {}
    for name, param in model.named_parameters():
        shapes[name] = param.shape
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    return shapes


def evaluate_before(settings: RunSettings, run_model: RunModel) -> dict[str, Any]:
    """``reference`` (when the scenario has one) and ``before`` metrics; {} with
    ``evaluate=false``."""
    metrics: dict[str, Any] = {}
    if not settings.evaluate:
        log(INFO, "evaluate=false: the model is not evaluated before or after")
        return metrics
    if run_model.reference is not None:
        metrics["reference"] = baseline_evaluation(
            "reference", run_model.reference, run_model, settings
        )
    metrics["before"] = baseline_evaluation(
        "original", run_model.model, run_model, settings, metrics.get("reference")
    )
    return metrics


def build_strategy(
    settings: RunSettings,
    run_model: RunModel,
    checkpoint: RunCheckpoint,
    done: int,
    output_dir: Path,
    assignments: Sequence[ClientAssignment] | None = None,
    base_digests: Mapping[str, str] | None = None,
) -> MergeStrategy:
    """The merge strategy of ``merge`` (MPU around it with ``wrapper=mpu``),
    configured for this run's clients (``assignments``; None: the scenario's), checkpoint,
    resume point and (a strategy starting after round 1) the digests of the run's initial
    weights (:func:`initial_digests`)."""
    model, tokenizer, scenario = run_model.model, run_model.tokenizer, run_model.scenario
    if assignments is None:
        assignments = fold_mixed(scenario.assignments(), settings.scenario.mixed_clients)
    client_config = {
        **describe_model(model, tokenizer),
        **client_settings(settings),
    }
    common: dict[str, Any] = {
        "merge_parameters": settings.merge_parameters(),
        "assignments": assignments,
        "client_config": client_config,
        "role_config": {
            "forget": {"steps": settings.training.forget_steps, "lr": settings.training.forget_lr},
            "retain": {"steps": settings.training.retain_steps, "lr": settings.training.retain_lr},
        },
        "node_wait_timeout": settings.server.node_wait_timeout,
        "min_replies": settings.server.min_replies,
        "max_upload_mb": settings.server.max_upload_mb,
        "robust_norm_bound": settings.server.robust_norm_bound,
        "fisher_cap": settings.server.fisher_cap,
        "client_norm_ratio": settings.server.client_norm_ratio,
        "max_update_ratio": settings.server.max_update_ratio,
        "checkpoint": checkpoint,
        "round_offset": done,
        "spool": UploadSpool(output_dir / SPOOL_DIR) if settings.upload.stream else None,
        "base_offer": str(run_model.checkpoint) if run_model.checkpoint else None,
        "delivery": settings.model.delivery,
        "base_digests": base_digests,
        "model_dtype": model.dtype,
    }
    if settings.wrapper == "mpu":
        strategy: MergeStrategy = MpuStrategy(
            merge=settings.merge,
            model_config=model.config,
            # the file's secret or $FEDUNLEARN_MPU_SECRET; a fresh one is kept for a resume
            secret=checkpoint.mpu_secret(given_secret(settings.mpu.secret_file)),
            mode=settings.mpu.mode,
            copies=settings.mpu.copies,
            publish=settings.mpu.publish,
            kappa=settings.mpu.kappa,
            permute_groups=settings.mpu.permute_groups,
            shared_kappa=settings.mpu.shared_kappa,  # -1 resolved by the strategy
            server_lr=settings.mpu.server_lr,
            sigma_reference=(
                pretrained_state(settings, run_model)
                if settings.mpu.sigma_source == "task-vector"
                else None
            ),
            copy_files=CopyFiles(output_dir / COPIES_DIR),
            **common,
        )
    else:
        strategy = MergeStrategy(merge=settings.merge, **common)
    return strategy


def baseline_evaluation(
    name: str,
    model: PreTrainedModel,
    run_model: RunModel,
    settings: RunSettings,
    reference_metrics: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``evaluate_model`` of a model the run does not change (original, reference); with a
    real model the result is cached across runs (``strategies.eval_cache``)."""

    def evaluate() -> dict[str, Any]:
        return evaluate_model(name, model, run_model, settings, reference_metrics)

    if settings.model.name == "builtin" and not settings.model.path:
        return evaluate()
    cache_dir = Path(settings.model.cache_dir).expanduser() if settings.model.cache_dir else None
    key = evaluation_key(model, settings, reference_metrics, settings.mmlu_folder())
    return cached_evaluation(cache_dir or default_cache_dir(), key, name, evaluate)


def initial_digests(settings: RunSettings, run_model: RunModel) -> dict[str, str] | None:
    """The digests of the weights the run starts from (its model, before any round or resumed
    weights are loaded into it) where nodes may hold them as their base (a checkpoint folder
    to offer, ``model.delivery`` not ``full``); None otherwise."""
    if run_model.checkpoint is None or settings.model.delivery == "full":
        return None
    return model_digests(run_model.model)


def open_checkpoint(
    settings: RunSettings, output_dir: Path, model: torch.nn.Module
) -> tuple[RunCheckpoint, int, dict[str, torch.Tensor] | None, dict[str, Any]]:
    """The run's checkpoint and what it resumes from: ``(checkpoint, finished rounds, their
    weights, their results record)``. Without a saved round, or with ``resume=false``, the
    checkpoint's own files are removed (a fresh start). A checkpoint of another config, a
    damaged one and a folder the project did not write raise ``CheckpointError`` (nothing is
    deleted)."""
    config = settings.as_dict()
    checkpoint = RunCheckpoint(
        output_dir / CHECKPOINT_DIR,
        config_fingerprint(config, model_structure(model.state_dict())),
        config,
    )
    loaded = checkpoint.load() if settings.resume else None
    if loaded is None:
        if not settings.resume and checkpoint.state_path.exists():
            log(INFO, "resume=false: removing the checkpoint files in %s", checkpoint.folder)
        checkpoint.clear()
        checkpoint.claim()
        return checkpoint, 0, None, {}
    done, state, record = loaded
    if done > settings.num_rounds:
        raise CheckpointError(
            f"{checkpoint.folder} holds round {done}, more than num-rounds={settings.num_rounds}; "
            "set num-rounds >= that, use another output-dir, or resume=false to start afresh"
        )
    log(INFO, "resuming after round %d of %d from %s", done, settings.num_rounds, checkpoint.folder)
    return checkpoint, done, state, record
