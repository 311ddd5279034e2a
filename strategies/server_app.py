"""The ServerApp: build or load the model, run the unlearning round, evaluate, write results."""

from __future__ import annotations

import copy
import json
import logging
import resource
import time
from collections.abc import Iterator
from logging import INFO, WARNING
from pathlib import Path
from typing import Any, cast

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from transformers import PreTrainedModel

from fedunlearn.files import exclusive_folder
from fedunlearn.models.substrate import default_cache_dir
from fedunlearn.mpu import plan_reparam
from fedunlearn.uploads import save_uploads
from strategies.checkpoint import (
    CHECKPOINT_DIR,
    CheckpointError,
    RunCheckpoint,
    config_fingerprint,
    model_structure,
)
from strategies.dp2u_pipeline import Dp2uPipeline
from strategies.eval_cache import cached_evaluation, evaluation_key
from strategies.log_progress import progress_in_log
from strategies.memory import peak_rss_bytes
from strategies.merge_strategy import MergeStrategy
from strategies.mpu_strategy import MpuStrategy
from strategies.report import write_report
from strategies.results import format_summary_table, json_safe, summary_names
from strategies.run_setup import (
    RunModel,
    client_settings,
    evaluate_model,
    load_run_model,
    pretrained_state,
)
from strategies.secret_files import given_secret
from strategies.settings import RunSettings
from strategies.streaming_grid import StreamingGrid
from strategies.upload_spool import SPOOL_DIR, UploadSpool
from wire.messages import describe_model, wire_state

app = ServerApp()


@app.lifespan()
def one_run_per_output_dir(context: Context) -> Iterator[None]:
    """Hold the output-dir for the whole run. A second run on it is refused at once
    (``FolderInUseError`` naming the first run's PID), and so is a checkpoint folder that is
    not the project's or is damaged (``CheckpointError``) — before any model is loaded."""
    settings = RunSettings.from_run_config(dict(context.run_config))
    output_dir = settings.resolved_output_dir()
    context.run_config["output-dir"] = str(output_dir)  # main uses the same (timestamped) one
    with exclusive_folder(output_dir, "output-dir"):
        if settings.strategy != "dp2u":  # dp2u resumes per cached stage, not from here
            checkpoint = RunCheckpoint(output_dir / CHECKPOINT_DIR, "")
            if settings.resume:
                checkpoint.verified_state()
            else:
                checkpoint.claim()
        yield


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run one federated unlearning request end to end."""
    run_started = time.perf_counter()
    logging.getLogger("flwr").propagate = False  # one copy of each line, not two
    settings = RunSettings.from_run_config(dict(context.run_config))
    output_dir = settings.resolved_output_dir()
    output_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(settings.seed)
    phases: dict[str, float] = {}

    t0 = time.perf_counter()
    with progress_in_log():  # a first run builds the substrate here: show it in `flwr log`
        run_model = load_run_model(settings)
    model, tokenizer, scenario = run_model.model, run_model.tokenizer, run_model.scenario
    reference = run_model.reference
    settings = settings.for_model(int(model.config.num_hidden_layers))
    if settings.strategy == "mpu" and settings.mpu_mode == "mpu":
        # an architecture the reparameterisation would break is refused before any evaluation
        plan_reparam(model.config, permute_groups=settings.mpu_permute_groups)
    phases["model_load_or_build"] = time.perf_counter() - t0
    log(INFO, "model ready (%.1f s)", phases["model_load_or_build"])
    if settings.strategy == "dp2u":
        t0 = time.perf_counter()
        outcome = Dp2uPipeline(grid, settings, run_model).run()
        phases["dp2u"] = time.perf_counter() - t0
        phases["total"] = time.perf_counter() - run_started
        results = {
            "config": settings.as_dict(),
            **outcome,
            "substrate": run_model.info,
            "seconds": phases,
        }
        _write_results(output_dir, results, outcome["metrics"], scenario)
        return
    # multi-round runs resume from <output-dir>/checkpoint (dp2u resumes per cached stage)
    checkpoint, done, resumed_state, resumed_record = _open_checkpoint(settings, output_dir, model)

    t0 = time.perf_counter()
    metrics: dict[str, Any] = {}
    reference_metrics = None
    if settings.evaluate:
        if reference is not None:
            reference_metrics = _baseline_evaluation("reference", reference, run_model, settings)
            metrics["reference"] = reference_metrics
        metrics["before"] = _baseline_evaluation(
            "original", model, run_model, settings, reference_metrics
        )
    else:
        log(INFO, "evaluate=false: the model is not evaluated before or after")
    phases["evaluation_before"] = time.perf_counter() - t0

    assignments = scenario.assignments()
    client_config = {
        **describe_model(model, tokenizer),
        **client_settings(settings),
    }
    common: dict[str, Any] = {
        "merge_parameters": settings.merge_parameters(),
        "assignments": assignments,
        "client_config": client_config,
        "role_config": {
            "forget": {"steps": settings.forget_steps, "lr": settings.forget_lr},
            "retain": {"steps": settings.retain_steps, "lr": settings.retain_lr},
        },
        "node_wait_timeout": settings.node_wait_timeout,
        "min_replies": settings.min_replies,
        "max_upload_mb": settings.max_upload_mb,
        "robust_norm_bound": settings.robust_norm_bound,
        "fisher_cap": settings.fisher_cap,
        "client_norm_ratio": settings.client_norm_ratio,
        "max_update_ratio": settings.max_update_ratio,
        "checkpoint": checkpoint,
        "round_offset": done,
        "spool": UploadSpool(output_dir / SPOOL_DIR) if settings.stream_uploads else None,
    }
    if settings.strategy == "mpu":
        strategy: MergeStrategy = MpuStrategy(
            merge=settings.mpu_merge,
            model_config=model.config,
            # the file's secret or $FEDUNLEARN_MPU_SECRET; a fresh one is kept for a resume
            secret=checkpoint.mpu_secret(given_secret(settings.mpu_secret_file)),
            mode=settings.mpu_mode,
            copies=settings.mpu_copies,
            publish=settings.mpu_publish,
            kappa=settings.mpu_kappa,
            permute_groups=settings.mpu_permute_groups,
            shared_kappa=settings.mpu_shared_kappa,
            server_lr=settings.mpu_server_lr,
            sigma_reference=(
                pretrained_state(settings, run_model)
                if settings.mpu_sigma_source == "task-vector"
                else None
            ),
            **common,
        )
    else:
        strategy = MergeStrategy(merge=settings.strategy, **common)
    t0 = time.perf_counter()
    final_state: dict[str, torch.Tensor]
    if done < settings.num_rounds:
        result = strategy.start(
            # a StreamingGrid is the Grid with send_and_receive streamed (it forwards the rest)
            grid=(
                cast(Grid, StreamingGrid(grid, strategy.receive_reply))
                if settings.stream_uploads
                else grid
            ),
            initial_arrays=(
                ArrayRecord(resumed_state) if resumed_state is not None else wire_state(model)
            ),
            num_rounds=settings.num_rounds - done,  # Flower counts them from 1 (+ round_offset)
            timeout=settings.round_timeout,
            train_config=ConfigRecord(),
        )
        final_state = result.arrays.to_torch_state_dict()
        record = strategy.round_record()
    else:
        log(INFO, "all %d rounds were finished before: evaluating the saved weights", done)
        assert resumed_state is not None  # done >= num-rounds >= 1: a round was loaded
        final_state, record = resumed_state, resumed_record
    phases["federated_round"] = time.perf_counter() - t0

    unlearned = copy.deepcopy(model)
    unlearned.load_state_dict(final_state)
    applied_error = (
        applied_update_error(model, unlearned, strategy.last_merge.delta)
        if strategy.last_merge
        else None
    )
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
        "merge": {**record["merge"], "applied_relative_error": applied_error},
        "substrate": run_model.info,
        **({"mpu": record["mpu"]} if "mpu" in record else {}),
        "assignments": record["assignments"],
        "seconds": phases,
        "server_peak_rss_mb": peak_rss_mb(),
        **({"resumed_from_round": done} if done else {}),
    }
    if settings.save_uploads and strategy.last_updates:
        results["uploads"] = str(save_uploads(strategy.last_updates, output_dir / "uploads"))
    elif settings.save_uploads:
        log(INFO, "no round ran in this process: the uploads of the last round are not saved")
    if strategy.spool is not None:
        strategy.spool.clear()
    phases["server_peak_rss_bytes"] = peak_rss_bytes()
    _write_results(output_dir, results, metrics, scenario)


def _baseline_evaluation(
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

    if settings.model == "builtin" and not settings.model_path:
        return evaluate()
    cache_dir = Path(settings.cache_dir).expanduser() if settings.cache_dir else None
    key = evaluation_key(model, settings, reference_metrics, settings.mmlu_folder())
    return cached_evaluation(cache_dir or default_cache_dir(), key, name, evaluate)


def peak_rss_mb() -> float:
    """The server process's peak resident memory so far (``ru_maxrss``, MiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _open_checkpoint(
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


def _write_results(output_dir, results: dict, metrics: dict, scenario) -> None:
    """results.json (atomically), report.html beside it, then the summary table and sample
    generations in the log.  A report that cannot be rendered is logged, never fatal: the
    results are already on disk."""
    path = output_dir / "results.json"
    tmp = path.with_suffix(".json.tmp")
    safe = json_safe(results)
    tmp.write_text(json.dumps(safe, indent=2))
    tmp.replace(path)
    names = summary_names(metrics, scenario)
    try:
        log(INFO, "report written to %s", write_report(safe, names, output_dir / "report.html"))
    except Exception as err:  # the page is a view of results.json, not the result
        log(
            WARNING,
            "report.html not written (%s: %s); results.json is complete",
            type(err).__name__,
            err,
        )
    if not metrics:
        log(INFO, "results written to %s (no metrics: evaluate=false)", path)
        return
    for line in format_summary_table(metrics, summary_names(metrics, scenario)).splitlines():
        log(INFO, "%s", line)
    for line in scenario.sample_lines(metrics["before"], metrics["after"]):
        log(INFO, "%s", line)
    log(INFO, "results written to %s", path)


def applied_update_error(
    original: torch.nn.Module, unlearned: torch.nn.Module, delta: dict[str, torch.Tensor]
) -> float:
    """‖(θ_unlearned − θ₀) − Δ‖ / ‖Δ‖: how much of the merged update the model's dtype kept
    (0 in float32; a bfloat16 model rounds small entries of Δ away)."""
    before, after = original.state_dict(), unlearned.state_dict()
    num, den = 0.0, 0.0
    for name, d in delta.items():
        applied = after[name].double().cpu() - before[name].double().cpu()
        num += float(((applied - d.double()) ** 2).sum())
        den += float((d.double() ** 2).sum())
    return (num / den) ** 0.5 if den > 0 else 0.0
