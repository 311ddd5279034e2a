"""The ServerApp: build or load the model, run the unlearning round, evaluate, write results."""

from __future__ import annotations

import copy
import json
import logging
import time
from logging import INFO
from typing import Any

import torch
from flwr.app import ConfigRecord, Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from clients.messages import describe_model, wire_state
from fedunlearn.mpu import server_secret
from fedunlearn.uploads import save_uploads
from strategies.dp2u_pipeline import Dp2uPipeline
from strategies.merge_strategy import MergeStrategy
from strategies.mpu_strategy import MpuStrategy
from strategies.results import format_summary_table, json_safe
from strategies.run_setup import (
    client_settings,
    evaluate_model,
    load_run_model,
    pretrained_state,
)
from strategies.settings import RunSettings

app = ServerApp()


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
    run_model = load_run_model(settings)
    model, tokenizer, scenario = run_model.model, run_model.tokenizer, run_model.scenario
    reference = run_model.reference
    settings = settings.for_model(int(model.config.num_hidden_layers))
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

    t0 = time.perf_counter()
    metrics: dict[str, Any] = {}
    if reference is not None:
        metrics["reference"] = evaluate_model("reference", reference, run_model, settings)
    reference_metrics = metrics.get("reference")
    metrics["before"] = evaluate_model("original", model, run_model, settings, reference_metrics)
    phases["evaluation_before"] = time.perf_counter() - t0

    assignments = scenario.assignments()
    client_config = {
        **describe_model(model, tokenizer),
        **client_settings(settings),
    }
    common = {
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
    }
    if settings.strategy == "mpu":
        strategy: MergeStrategy = MpuStrategy(
            merge=settings.mpu_merge,
            model_config=model.config,
            secret=server_secret(settings.mpu_secret),
            mode=settings.mpu_mode,
            copies=settings.mpu_copies,
            kappa=settings.mpu_kappa,
            permute_groups=settings.mpu_permute_groups,
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
    result = strategy.start(
        grid=grid,
        initial_arrays=wire_state(model),
        num_rounds=settings.num_rounds,
        timeout=settings.round_timeout,
        train_config=ConfigRecord(),
    )
    phases["federated_round"] = time.perf_counter() - t0

    unlearned = copy.deepcopy(model)
    unlearned.load_state_dict(result.arrays.to_torch_state_dict())
    applied_error = (
        applied_update_error(model, unlearned, strategy.last_merge.delta)
        if strategy.last_merge
        else None
    )
    t0 = time.perf_counter()
    metrics["after"] = evaluate_model(
        "unlearned", unlearned, run_model, settings, reference_metrics
    )
    phases["evaluation_after"] = time.perf_counter() - t0
    phases["total"] = time.perf_counter() - run_started

    results = {
        "config": settings.as_dict(),
        "metrics": metrics,
        "clients": strategy.client_reports,
        "merge": {
            **(strategy.last_merge.report if strategy.last_merge else {}),
            "seconds": strategy.merge_seconds,
            "applied_relative_error": applied_error,
        },
        "substrate": run_model.info,
        **({"mpu": strategy.report()} if isinstance(strategy, MpuStrategy) else {}),
        "assignments": [
            {
                "node_id": node_id,
                "role": a.role,
                "domain": a.domain,
                "indices": list(a.indices),
                "retain_indices": list(a.retain_indices),
            }
            for node_id, a in strategy.node_assignment.items()
        ],
        "seconds": phases,
    }
    if settings.save_uploads:
        results["uploads"] = str(save_uploads(strategy.last_updates, output_dir / "uploads"))
    _write_results(output_dir, results, metrics, scenario)


def _write_results(output_dir, results: dict, metrics: dict, scenario) -> None:
    """results.json (atomically), then the summary table and sample generations in the log."""
    path = output_dir / "results.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(json_safe(results), indent=2))
    tmp.replace(path)
    for line in format_summary_table(metrics, scenario.summary_metrics).splitlines():
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
