"""The ServerApp: build or load the model, run the unlearning round, evaluate, write results."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import torch
from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from fedunlearn.allocator import return_freed_memory
from fedunlearn.files import exclusive_folder, write_file_atomic
from fedunlearn.mpu import plan_reparam
from strategies.checkpoint import (
    CHECKPOINT_DIR,
    RunCheckpoint,
)
from strategies.dp2u_pipeline import Dp2uPipeline
from strategies.learn_pipeline import learn_federated
from strategies.log_progress import progress_in_log
from strategies.report import write_report
from strategies.requests_pipeline import run_requests
from strategies.results import format_summary_table, json_safe, summary_names, take_scores
from strategies.run_setup import (
    RunModel,
    load_run_model,
)
from strategies.settings import RunSettings
from strategies.unlearn_pipeline import run_unlearning

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
        if settings.pipeline != "dp2u":  # dp2u resumes per cached stage, not from here
            checkpoint = RunCheckpoint(output_dir / CHECKPOINT_DIR, "")
            if settings.resume:
                checkpoint.verified_state()
            else:
                checkpoint.claim()
        yield


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run one federated unlearning request end to end: load (or build) the model, then the
    pipeline the run names (:data:`PIPELINES`), then results.json and report.html."""
    run_started = time.perf_counter()
    return_freed_memory()  # freed tensors leave the process (fedunlearn.allocator)
    logging.getLogger("flwr").propagate = False  # one copy of each line, not two
    settings = RunSettings.from_run_config(dict(context.run_config))
    output_dir = settings.resolved_output_dir()
    output_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(settings.seed)
    phases: dict[str, float] = {}

    t0 = time.perf_counter()
    with progress_in_log():  # a first run builds the substrate here: show it in `flwr log`
        run_model = load_run_model(settings)
    config = run_model.model.config
    settings = settings.for_model(int(config.num_hidden_layers))
    if settings.wrapper == "mpu" and settings.mpu.mode == "mpu":
        # an architecture the reparameterisation would break is refused before any evaluation
        plan_reparam(config, permute_groups=settings.mpu.permute_groups)
    phases["model_load_or_build"] = time.perf_counter() - t0
    log(INFO, "model ready (%.1f s)", phases["model_load_or_build"])
    if settings.learn.source == "federated":
        t0 = time.perf_counter()
        run_model.info["learn"] = learn_federated(grid, settings, run_model)
        phases["federated_learning"] = time.perf_counter() - t0
    pipeline = "requests" if settings.requests.schedule else settings.pipeline
    results, metrics = PIPELINES[pipeline](
        grid, settings, run_model, output_dir, phases, run_started
    )
    _write_results(output_dir, results, metrics, run_model.scenario)


def run_dp2u(
    grid: Grid,
    settings: RunSettings,
    run_model: RunModel,
    output_dir: Path,
    phases: dict[str, Any],
    run_started: float,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``dp2u`` pipeline: DP base model, deployed fine-tune, retain-only unlearning
    (:class:`~strategies.dp2u_pipeline.Dp2uPipeline`, which resumes per cached stage)."""
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
    return results, outcome["metrics"]


#: The ServerApp's pipelines: each takes the grid, the settings, the loaded model, the output
#: folder, the seconds per phase so far and the run's start (``perf_counter``), and returns
#: (results, metrics) for results.json.
PIPELINES: dict[str, Callable[..., tuple[dict[str, Any], dict[str, Any]]]] = {
    "unlearn": run_unlearning,
    "dp2u": run_dp2u,
    "requests": run_requests,  # the unlearn pipeline with requests.schedule
}


#: Per-question scores of every evaluated stage, beside results.json (strategies.results)
SCORES_FILE = "scores.json"


def _write_results(output_dir, results: dict, metrics: dict, scenario) -> None:
    """scores.json and results.json with ``metrics_ci`` (atomically), report.html beside them,
    then the summary table and sample generations in the log. A report that cannot be
    rendered is logged, never fatal: the results are already on disk."""
    path = output_dir / "results.json"
    if metrics:
        scores, results["metrics_ci"] = take_scores(metrics, int(results["config"]["seed"]))
        write_file_atomic(output_dir / SCORES_FILE, json.dumps(json_safe(scores)).encode())
    tmp = path.with_suffix(".json.tmp")
    safe = json_safe(results)
    tmp.write_text(json.dumps(safe, indent=2))
    tmp.replace(path)
    try:
        names = summary_names(metrics, scenario)
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
    names = summary_names(metrics, scenario)
    for line in format_summary_table(metrics, names, results.get("metrics_ci")).splitlines():
        log(INFO, "%s", line)
    for line in scenario.sample_lines(metrics["before"], metrics["after"]):
        log(INFO, "%s", line)
    log(INFO, "results written to %s", path)
