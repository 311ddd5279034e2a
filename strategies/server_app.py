"""The ServerApp: build or load the model, run the unlearning round, evaluate, write results."""

from __future__ import annotations

import copy
import json
import logging
import time
from logging import INFO
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from clients.messages import describe_model
from fedunlearn.scenarios import tofu_assignments
from fedunlearn.uploads import save_uploads
from strategies.merge_strategy import MergeStrategy
from strategies.results import format_summary_table, json_safe
from strategies.run_setup import evaluate_model, evaluation_splits, load_run_model
from strategies.settings import RunSettings

app = ServerApp()

REPORTED_METRICS = (
    "forget_rouge_l",
    "forget_exact_match",
    "forget_truth_ratio",
    "forget_quality",
    "model_utility",
    "retain_rouge_l",
    "retain_exact_match",
)


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
    model, tokenizer, data = run_model.model, run_model.tokenizer, run_model.data
    reference = run_model.reference
    phases["model_load_or_build"] = time.perf_counter() - t0
    log(INFO, "model ready (%.1f s)", phases["model_load_or_build"])

    splits = evaluation_splits(data, settings)
    t0 = time.perf_counter()
    metrics: dict[str, Any] = {}
    reference_trs = None
    if reference is not None:
        metrics["reference"] = evaluate_model("reference", reference, tokenizer, splits, settings)
        reference_trs = metrics["reference"]["forget_truth_ratios"]
        metrics["reference"]["forget_quality"] = 1.0 if reference_trs else None
    metrics["before"] = evaluate_model(
        "original", model, tokenizer, splits, settings, reference_trs
    )
    phases["evaluation_before"] = time.perf_counter() - t0

    assignments = tofu_assignments(
        data,
        forget_percent=settings.forget_percent,
        num_forget_clients=settings.num_forget_clients,
        num_retain_clients=settings.num_retain_clients,
        retain_samples=settings.retain_samples,
        num_forget_domains=settings.num_forget_domains,
        retain_layout=settings.retain_layout,
        seed=settings.seed,
    )
    client_config = {
        **describe_model(model, tokenizer),
        "objective": settings.objective,
        "batch-size": settings.batch_size,
        "lora-rank": settings.lora_rank,
        "lora-alpha": settings.lora_alpha,
        "lora-targets": settings.lora_targets,
        "fisher-batches": settings.fisher_batches,
        "seed": settings.seed,
        "data-seed": settings.seed,
        "num-authors": settings.num_authors,
        "qa-per-author": settings.qa_per_author,
        "data-path": settings.data_path,
        "client-threads": settings.client_threads,
    }
    strategy = MergeStrategy(
        merge=settings.strategy,
        merge_parameters=settings.merge_parameters(),
        assignments=assignments,
        client_config=client_config,
        role_config={
            "forget": {"steps": settings.forget_steps, "lr": settings.forget_lr},
            "retain": {"steps": settings.retain_steps, "lr": settings.retain_lr},
        },
        node_wait_timeout=settings.node_wait_timeout,
    )
    t0 = time.perf_counter()
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(model.state_dict()),
        num_rounds=settings.num_rounds,
        timeout=settings.round_timeout,
        train_config=ConfigRecord(),
    )
    phases["federated_round"] = time.perf_counter() - t0

    unlearned = copy.deepcopy(model)
    unlearned.load_state_dict(result.arrays.to_torch_state_dict())
    t0 = time.perf_counter()
    metrics["after"] = evaluate_model(
        "unlearned", unlearned, tokenizer, splits, settings, reference_trs
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
        },
        "substrate": run_model.info,
        "assignments": [
            {"node_id": node_id, "role": a.role, "domain": a.domain, "indices": list(a.indices)}
            for node_id, a in strategy.node_assignment.items()
        ],
        "seconds": phases,
    }
    if settings.save_uploads:
        results["uploads"] = str(save_uploads(strategy.last_updates, output_dir / "uploads"))
    path = output_dir / "results.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(json_safe(results), indent=2))
    tmp.replace(path)
    for line in format_summary_table(metrics, REPORTED_METRICS).splitlines():
        log(INFO, "%s", line)
    for before, after in zip(
        metrics["before"]["samples"]["forget"], metrics["after"]["samples"]["forget"], strict=True
    ):
        log(INFO, "forget Q: %s", before["question"])
        log(INFO, "   before: %s", before["generation"])
        log(INFO, "   after:  %s", after["generation"])
    log(INFO, "results written to %s", path)
