"""The ``unlearn`` pipeline with a schedule of deletion requests (``requests.schedule``;
docs/scenarios.md, "Deletion requests over time").

Clients hold their records as in the federated learning stage. Round r serves the requests
pending before it: the clients asked unlearn what they asked to forget, every other client
retains a sample of what it keeps; the merge is the run's (FIRM by default, MPU and the robust
options as configured). After each round the model is evaluated once on the whole forget split,
the retain sample and the utility sets, and every request's forget metrics (with intervals) are
taken from that evaluation's per-question scores — served requests must stay forgotten, later
ones show what is still known. Each round is checkpointed (``<output-dir>/checkpoint``) and
its evaluation kept in ``<output-dir>/requests_rounds.json``: a killed run resumes after its
last finished round with the same results as an uninterrupted one.
"""

from __future__ import annotations

import json
import time
from logging import INFO
from pathlib import Path
from typing import Any, cast

from flwr.common.logger import log
from flwr.serverapp import Grid

from fedunlearn.dp2u import DataShard, apply_forget_request
from fedunlearn.files import write_file_atomic
from fedunlearn.learn import learn_shards
from fedunlearn.requests import (
    ScheduledRequest,
    read_schedule,
    request_metrics,
    round_assignments,
)
from fedunlearn.scenarios.tofu import TofuScenario
from strategies.memory import peak_rss_bytes
from strategies.results import json_safe
from strategies.run_setup import RunModel, evaluate_model
from strategies.settings import RunSettings
from strategies.unlearn_pipeline import (
    build_strategy,
    evaluate_before,
    federate,
    initial_digests,
    load_into,
    move_into_arrays,
    open_checkpoint,
)

#: Each finished round's evaluation, beside results.json (what a resumed run reads back)
ROUNDS_FILE = "requests_rounds.json"


def scheduled_requests(
    settings: RunSettings, scenario: TofuScenario, shards: list[DataShard]
) -> list[ScheduledRequest]:
    """The schedule checked against the clients' records, before any round: every author and
    record exists and is held by the client that asks, and lies in the forget split (the
    records the retain-only reference never saw, so forget quality means something)."""
    forget_split = {i for part in scenario.learn_layout().forget for i in part}
    out = []
    schedule = read_schedule(settings.requests.schedule, settings.num_rounds)
    for server_round, requests in schedule.items():
        for request in requests:
            try:
                marked = apply_forget_request(scenario.data, shards, [request])
            except ValueError as err:
                raise ValueError(f"requests.schedule, round {server_round}: {err}") from None
            records = marked[request.client].forget
            outside = sorted(set(records) - forget_split)
            if outside:
                raise ValueError(
                    f"requests.schedule, round {server_round}, client {request.client}: records "
                    f"{outside[:5]} are not in the forget split (scenario.forget-percent="
                    f"{settings.scenario.forget_percent:g}), which the reference never learned"
                )
            out.append(ScheduledRequest(server_round, request.client, request.authors, records))
    return out


def run_requests(
    grid: Grid,
    settings: RunSettings,
    run_model: RunModel,
    output_dir: Path,
    phases: dict[str, Any],
    run_started: float,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Serve the schedule round by round (see the module docstring); returns the results and
    the metrics (``after``: the model after the last round)."""
    scenario = cast(TofuScenario, run_model.scenario)  # RunSettings allows tofu only
    layout = scenario.learn_layout()
    shards = learn_shards(
        layout.forget,
        settings.num_clients,
        layout.kept,
        layout.kept_groups,
        partitioner=settings.learn.partitioner,
        dirichlet_alpha=settings.learn.dirichlet_alpha,
        seed=settings.seed,
    )
    requests = scheduled_requests(settings, scenario, shards)
    model = run_model.model
    base = initial_digests(settings, run_model)  # every round's nodes compare with θ_base
    checkpoint, done, resumed_state, record = open_checkpoint(settings, output_dir, model)
    rounds_path = output_dir / ROUNDS_FILE
    evaluated = _read_rounds(rounds_path, done)

    t0 = time.perf_counter()
    metrics = evaluate_before(settings, run_model)
    reference = metrics.get("reference")
    run_model.reference = None
    phases["evaluation_before"] = time.perf_counter() - t0
    forget_split = scenario.evaluation_splits()["forget"]
    position = {id(r): p for p, r in enumerate(forget_split)}
    positions = [[position[id(scenario.data.author_qa[i])] for i in q.records] for q in requests]

    if resumed_state is not None:
        load_into(model, resumed_state)
        if settings.evaluate and done not in evaluated:  # killed before its evaluation
            evaluated[done] = _evaluate_round(
                done, run_model, settings, reference, requests, positions
            )
            evaluated[done]["clients"] = record.get("clients", [])  # the checkpoint's record
            write_file_atomic(rounds_path, json.dumps(json_safe(evaluated)).encode())
    t0 = time.perf_counter()
    for server_round in range(done + 1, settings.num_rounds + 1):
        serving = [q for q in requests if q.round == server_round]
        forgotten = {i for q in requests if q.round <= server_round for i in q.records}
        assignments = round_assignments(
            shards,
            serving,
            forgotten,
            retain_samples=settings.scenario.retain_samples,
            local_retain_samples=settings.scenario_params().local_retain_samples,
            seed=settings.seed + server_round,
            mixed_clients=settings.scenario.mixed_clients,
        )
        log(INFO, "round %d serves %d request(s)", server_round, len(serving))
        strategy = build_strategy(
            settings, run_model, checkpoint, server_round - 1, output_dir, assignments, base
        )
        initial, shapes = move_into_arrays(model)
        try:
            final, record = federate(grid, strategy, settings, initial, server_round - 1, 1)
        finally:
            strategy.release_weights()
        load_into(model, final, shapes)
        if strategy.spool is not None:
            strategy.spool.clear()
        if settings.evaluate:
            evaluated[server_round] = _evaluate_round(
                server_round, run_model, settings, reference, requests, positions
            )
            evaluated[server_round]["clients"] = record.get("clients", [])
            write_file_atomic(rounds_path, json.dumps(json_safe(evaluated)).encode())
    phases["federated_rounds"] = time.perf_counter() - t0
    if settings.evaluate:
        metrics["after"] = evaluated[settings.num_rounds]["metrics"]
    phases["total"] = time.perf_counter() - run_started
    results = {
        "config": settings.as_dict(),
        "metrics": metrics,
        "requests": _requests_record(requests, evaluated, reference, positions, settings.seed),
        "rounds": [
            {"round": r, **{k: v for k, v in e.items() if k not in ("metrics", "clients")}}
            for r, e in sorted(evaluated.items())
        ],
        # every round's node reports (a mixed-role node's second upload under "kept")
        "clients_by_round": {str(r): e.get("clients", []) for r, e in sorted(evaluated.items())},
        "clients": record.get("clients", []),
        "merge": record.get("merge", {}),
        **({"mpu": record["mpu"]} if "mpu" in record else {}),  # wrapper='mpu': the last round's
        "substrate": run_model.info,
        "assignments": record.get("assignments", []),
        "seconds": phases,
        "server_peak_rss_mb": peak_rss_bytes() / 2**20,
        **({"resumed_from_round": done} if done else {}),
    }
    return results, metrics


def _evaluate_round(
    server_round: int,
    run_model: RunModel,
    settings: RunSettings,
    reference: dict[str, Any] | None,
    requests: list[ScheduledRequest],
    positions: list[list[int]],
) -> dict[str, Any]:
    """The model after ``server_round``: the scenario's metrics, and every request's forget
    metrics with intervals (``served``: it was asked before or in this round)."""
    metrics = evaluate_model(
        f"after round {server_round}", run_model.model, run_model, settings, reference
    )
    per_request = []
    for request, where in zip(requests, positions, strict=True):
        values, intervals = request_metrics(metrics, where, reference, settings.seed)
        per_request.append(
            {"served": request.round <= server_round, "metrics": values, "metrics_ci": intervals}
        )
    served = sum(1 for q in requests if q.round <= server_round)
    return {
        "requests_served": served,
        "model_utility": metrics.get("model_utility"),
        "retain_rouge_l": metrics.get("retain_rouge_l"),
        "forget_rouge_l": metrics.get("forget_rouge_l"),
        "per_request": per_request,
        "metrics": metrics,
    }


def _requests_record(
    requests: list[ScheduledRequest],
    evaluated: dict[int, dict[str, Any]],
    reference: dict[str, Any] | None,
    positions: list[list[int]],
    seed: int,
) -> list[dict[str, Any]]:
    """results.json ``requests``: each request, its forget metrics after every round, and the
    retain-only reference's on the same questions (what "forgotten" is measured against)."""
    out = []
    for i, request in enumerate(requests):
        on_reference = request_metrics(reference, positions[i], None, seed) if reference else None
        out.append(
            {
                **(
                    {"reference": on_reference[0], "reference_ci": on_reference[1]}
                    if on_reference
                    else {}
                ),
                "round": request.round,
                "client": request.client,
                "authors": list(request.authors),
                "records": len(request.records),
                "metrics_by_round": {
                    str(r): e["per_request"][i]["metrics"] for r, e in sorted(evaluated.items())
                },
                "metrics_ci_by_round": {
                    str(r): e["per_request"][i]["metrics_ci"] for r, e in sorted(evaluated.items())
                },
            }
        )
    return out


def _read_rounds(path: Path, done: int) -> dict[int, dict[str, Any]]:
    """The evaluations of the rounds a resumed run finished before (rounds 1..``done``); a
    fresh start ({} when ``done`` is 0) ignores the file, which its rounds overwrite."""
    if done == 0 or not path.is_file():
        return {}
    saved = {int(r): e for r, e in json.loads(path.read_text()).items()}
    return {r: e for r, e in saved.items() if r <= done}
