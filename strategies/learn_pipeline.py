"""Federated training stages on the server: one cached stage (:func:`run_stage`, shared by
DP2Unlearning's stages and the learning stage) and the learning stage itself
(:func:`learn_federated`, ``learn.source='federated'``; docs/scenarios.md, "Federated learning
stage").

A stage is ``rounds`` rounds of a Flower strategy of :data:`~strategies.learn_strategy.
LEARN_STRATEGIES` over the data clients from a start model; its result is cached on the
server (``strategies.stage_cache``) under a key of everything that determines it — the start
model's key, the strategy and its settings, the rounds, the client config, the shards and the
seed — so a later run with the same inputs loads it instead of training again.
"""

from __future__ import annotations

import copy
import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from logging import INFO
from pathlib import Path
from typing import Any, cast

import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from transformers import AutoModelForCausalLM

from fedunlearn.dp2u import DataShard
from fedunlearn.files import default_cache_dir
from fedunlearn.learn import learn_shards
from fedunlearn.training.full import warmup_cosine
from fedunlearn.training.lora import LoraSettings, adapted_parameter_names
from strategies.learn_strategy import LEARN_STRATEGIES
from strategies.run_setup import RunModel, client_settings
from strategies.settings import RunSettings
from strategies.stage_cache import StageCache
from strategies.upload_spool import SPOOL_DIR, UploadSpool
from wire.messages import describe_model

#: The learning stage's two models: (name in results, client stage)
LEARNED_MODELS = (("knowledgeable", "deploy"), ("reference", "retrain"))


def run_stage(
    grid: Grid,
    settings: RunSettings,
    cache: StageCache,
    *,
    stage: str,
    start: tuple[str, Mapping[str, torch.Tensor]],
    shards: Sequence[DataShard],
    rounds: int,
    client_config: Mapping[str, Any],
    strategy: str = "fedavg",
    flower: Mapping[str, Any] | None = None,
    trained_keys: Sequence[str] | None = None,
    round_config: Callable[[int], Mapping[str, Any]] | None = None,
) -> tuple[str, dict[str, torch.Tensor], dict[str, Any]]:
    """Run (or load from ``cache``) ``rounds`` rounds of ``strategy`` from ``start`` = (key,
    weights); returns (its key, its weights, its info: rounds, seconds, client reports,
    ``cached``). ``trained_keys``: the weights the clients train (None: all);
    ``round_config``: config keys of each round (they are part of the cache key through
    ``client_config``, which must name what determines them)."""
    s = settings
    key = StageCache.key(
        stage=stage,
        start=start[0],
        rounds=rounds,
        config=dict(client_config),
        clients=[asdict(sh) for sh in shards]
        if stage in ("unlearn", "retrain")
        else [list(sh.training) for sh in shards],
        seed=s.seed,
        **({"strategy": strategy, "flower": dict(flower or {})} if strategy != "fedavg" else {}),
    )
    cached = cache.load(key)
    if cached is not None:
        log(INFO, "stage %s loaded from cache %s", stage, key)
        return key, cached[0], {**cached[1], "cached": True}
    log(INFO, "stage %s (%s, %d rounds) on %d clients", stage, strategy, rounds, len(shards))
    runner = LEARN_STRATEGIES[strategy](
        stage=stage,
        shards=shards,
        client_config=client_config,
        num_rounds=rounds,
        node_wait_timeout=s.server.node_wait_timeout,
        max_upload_mb=s.server.max_upload_mb,
        max_update_ratio=s.server.max_update_ratio,
        spool=UploadSpool(s.resolved_output_dir() / SPOOL_DIR) if s.upload.stream else None,
        trained_keys=trained_keys,
        round_config=round_config,
        **dict(flower or {}),
    )
    started = time.perf_counter()
    try:
        result = cast(Strategy, runner).start(  # ShardTraining is a Flower strategy's mixin
            grid=grid,
            initial_arrays=ArrayRecord({k: v.contiguous() for k, v in start[1].items()}),
            num_rounds=rounds,
            timeout=s.server.round_timeout,
            train_config=ConfigRecord(),
        )
    finally:
        if runner.spool is not None:
            runner.spool.clear()
    state = result.arrays.to_torch_state_dict()
    info = {
        "stage": stage,
        "strategy": strategy,
        "key": key,
        "rounds": rounds,
        "seconds": time.perf_counter() - started,
        # training compute: the clients' own seconds, summed (the wall time above also
        # holds waiting for nodes, e.g. Ray starting them before the first stage)
        "client_seconds": sum(
            float(c.get("total_seconds", 0.0)) for r in runner.rounds for c in r["clients"]
        ),
        "round_reports": runner.rounds,
    }
    cache.save(key, state, info)
    return key, state, {**info, "cached": False}


def learn_federated(grid: Grid, settings: RunSettings, run_model: RunModel) -> dict[str, Any]:
    """``learn.source='federated'``: the knowledgeable model (every client on all its records)
    and the retain-only reference (the forget records dropped on their clients), each learned
    from the pre-trained start by ``learn.rounds`` rounds of ``learn.strategy``, replace
    ``run_model``'s weights (a ``model.path`` run gains a reference). Returns what
    results.json records under ``substrate.learn``."""
    s = settings.learn
    layout = run_model.scenario.learn_layout()
    if layout is None:  # RunSettings refuses such scenarios first
        raise ValueError(f"scenario {settings.scenario.name!r} has no federated learning layout")
    shards = learn_shards(
        layout.forget,
        settings.num_clients,
        layout.kept,
        layout.kept_groups,
        partitioner=s.partitioner,
        seed=settings.seed,
        dirichlet_alpha=s.dirichlet_alpha,
    )
    start_path = _start_checkpoint(settings, run_model)
    start_key = "start-" + hashlib.sha256(str(start_path).encode()).hexdigest()[:16]
    cache_dir = settings.model.cache_dir
    cache_root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    cache = StageCache(cache_root / "learn" / start_key)
    start = _checkpoint_state(start_path)
    client_config = {
        **describe_model(run_model.model, run_model.tokenizer),
        **client_settings(settings),
        "lr": s.lr,  # round r's: s.lr × the cosine decay over the rounds (_round_lr)
        "lr-schedule": "constant",
        "batch-size": s.batch_size,
        "local-epochs": s.local_epochs,
        "learn-finetune": s.finetune,
    }
    record: dict[str, Any] = {
        "strategy": s.strategy,
        "rounds": s.rounds,
        "local_epochs": s.local_epochs,
        "finetune": s.finetune,
        "partitioner": s.partitioner,
        **({"dirichlet_alpha": s.dirichlet_alpha} if s.partitioner == "dirichlet" else {}),
        "start": str(start_path),
        "shards": [{"records": len(sh.indices), "forget_records": len(sh.forget)} for sh in shards],
        "stages": {},
    }
    if run_model.reference is None:
        run_model.reference = copy.deepcopy(run_model.model)
    targets = {"knowledgeable": run_model.model, "reference": run_model.reference}
    for name, stage in LEARNED_MODELS:
        _, state, info = run_stage(
            grid,
            settings,
            cache,
            stage=stage,
            start=(start_key, start),
            shards=shards,
            rounds=s.rounds,
            client_config=client_config,
            strategy=s.strategy,
            flower=_flower_options(settings),
            trained_keys=_trained_keys(settings, run_model),
            round_config=lambda r: {"lr": _round_lr(s.lr, r, s.rounds)},
        )
        targets[name].load_state_dict(state, strict=False)
        record["stages"][name] = _stage_summary(info)
    run_model.checkpoint = None  # the weights no longer match the folder they were loaded from
    return record


def _round_lr(lr: float, server_round: int, rounds: int) -> float:
    """The clients' learning rate in ``server_round`` (1-based): ``lr`` decayed by a cosine
    over the rounds to 0.05 × ``lr`` in the last (constant within a round)."""
    return lr * warmup_cosine(server_round - 1, rounds - 1, 0) if rounds > 1 else lr


def _trained_keys(settings: RunSettings, run_model: RunModel) -> list[str] | None:
    """``learn.finetune='lora'``: the weights LoRA adapts (``lora.*``); full: None (all)."""
    if settings.learn.finetune != "lora":
        return None
    lora = LoraSettings(
        rank=settings.lora.rank,
        alpha=settings.lora.alpha,
        target_modules=tuple(t.strip() for t in settings.lora.targets.split(",")),
        layers_to_transform=settings.lora_layer_indices(),
    )
    return adapted_parameter_names(run_model.model, lora)


def _flower_options(settings: RunSettings) -> dict[str, Any]:
    """The Flower strategy's own constructor arguments from the ``learn`` keys."""
    s = settings.learn
    if s.strategy == "fedprox":
        return {"proximal_mu": s.proximal_mu}
    if s.strategy in ("fedadam", "fedyogi"):
        return {"eta": s.server_lr, "eta_l": s.lr}
    return {}


def _start_checkpoint(settings: RunSettings, run_model: RunModel) -> Path:
    """Where federated learning starts: the built-in substrate's pre-trained stage, a
    registry model's pretrained checkpoint, or ``model.path``."""
    if settings.model.path and run_model.checkpoint is not None:  # a GGUF file's conversion
        return run_model.checkpoint
    if "pretrained" in run_model.info:  # a registry model: the converted pretrained checkpoint
        return Path(run_model.info["pretrained"])
    return Path(run_model.info["folder"]) / "pretrained"


def _checkpoint_state(path: Path) -> dict[str, torch.Tensor]:
    """The float32 weights of the checkpoint folder ``path``."""
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def _stage_summary(info: Mapping[str, Any]) -> dict[str, Any]:
    """A stage's record for results.json: per round the clients' mean loss and exclusions,
    and every client's report of the last round."""
    return {
        "cached": info["cached"],
        "key": info["key"],
        "seconds": info["seconds"],
        "client_seconds": info["client_seconds"],
        "rounds": [
            {
                "round": r["round"],
                "loss_mean": _mean(c.get("loss_last") for c in r["clients"]),
                "excluded": [c["excluded"] for c in r["clients"] if "excluded" in c],
            }
            for r in info["round_reports"]
        ],
        "clients_last_round": info["round_reports"][-1]["clients"],
    }


def _mean(values: Any) -> float | None:
    numbers = [float(v) for v in values if v is not None]
    return sum(numbers) / len(numbers) if numbers else None
