"""Federated training tasks of DP2Unlearning on a data client (docs/algorithms.md, "DP2Unlearning").

A TRAIN message with ``task='fit'`` asks the client to train the received full weights on
its own records for one round and send them back (the server averages them):

* ``stage='dp-base'`` (stage A, DP-SGD): Opacus DP-SGD; the client's RDP accountant lives in
  ``context.state`` and persists across rounds; the ε it has spent is in the reply;
* ``stage='mlm-base'`` (stage A, DP-MLM): plain training on the client's records rewritten by
  the DP-MLM (rewritten once, on the client, with ε per replaced token; cached in the state);
* ``stage='deploy'`` (stage B, and the learning stage's knowledgeable model) and
  ``'retrain'`` (RFS-R, and the learning stage's reference): plain training on every record
  (``learn-finetune='lora'``: a LoRA adapter merged into the weights; ``proximal-mu`` > 0:
  FedProx's proximal term; ``lr-schedule='constant'``: the round's ``lr`` throughout);
* ``stage='unlearn'`` (stage C) and ``'retrain'``: the records named in ``forget-indices`` are
  dropped HERE, before anything is encoded; the reply carries a digest of exactly the
  examples that reached the training loop, so the server can verify it.
"""

from __future__ import annotations

import json
import math
import time

import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    MetricRecordValues,
    RecordDict,
)
from peft import get_peft_model
from transformers import PreTrainedModel

from clients.local_data import client_scenario, shard
from fedunlearn.dp.dpsgd import AccountantState, DpSgdSettings, train_dp_sgd
from fedunlearn.dp2u import examples_digest
from fedunlearn.qa_format import encode_record
from fedunlearn.training.batching import Example
from fedunlearn.training.full import train_full
from fedunlearn.training.lora import (
    LoraSettings,
    adapted_parameter_names,
    lora_config,
    parse_layers,
)
from wire.messages import (
    config_list,
    config_scalar,
    rebuild_model,
    rebuild_tokenizer,
    typed_record,
    wire_state,
)

FIT_STAGES = ("dp-base", "mlm-base", "deploy", "unlearn", "retrain")
DROPS_FORGET = ("unlearn", "retrain")


def _local_records(
    config: ConfigRecord, context: Context, stage: str
) -> tuple[list[dict], list[dict]]:
    """(private, public) records this client trains on in ``stage``; the forget records are
    dropped here in stages that must never see them."""
    records = client_scenario(config, context).records()
    public = {int(i) for i in config_list(config, "public-indices", [])}
    indices = [int(i) for i in config_list(config, "indices")]
    if stage in DROPS_FORGET:
        forget = {int(i) for i in config_list(config, "forget-indices")}
        indices = [i for i in indices if i not in forget]
    if not indices:
        raise ValueError(f"node {context.node_id}: no records left to train on in {stage!r}")
    private = shard(records, [i for i in indices if i not in public], "shard")
    return private, shard(records, [i for i in indices if i in public], "public")


def _rewritten(records: list[dict], config: ConfigRecord, context: Context) -> list[dict]:
    """The client's records after DP-MLM rewriting, done once per run and kept locally."""
    key = "dp-mlm"
    if key in context.state:
        cached = context.state[key]
        return json.loads(str(cached["records-json"]))
    from fedunlearn.dp.mlm import load_masked_lm, rewrite_records  # DP-MLM stage only

    path = str(context.node_config.get("mlm-path", config["mlm-path"]))
    mlm, mlm_tokenizer = load_masked_lm(path)
    rewritten, report = rewrite_records(
        records,
        mlm,
        mlm_tokenizer,
        epsilon_per_token=float(config_scalar(config, "mlm-epsilon")),
        seed=int(config_scalar(config, "seed")),
        sensitive_only=bool(config["mlm-sensitive-only"]),
    )
    context.state[key] = ConfigRecord(
        {"records-json": json.dumps(rewritten), "report-json": json.dumps(report)}
    )
    return rewritten


def lora_settings(config: ConfigRecord) -> LoraSettings:
    """LoRA rank, alpha, target module names and (optionally) layer indices."""
    return LoraSettings(
        rank=int(config_scalar(config, "lora-rank")),
        alpha=float(config_scalar(config, "lora-alpha")),
        target_modules=tuple(t.strip() for t in str(config["lora-targets"]).split(",")),
        layers_to_transform=parse_layers(str(config["lora-layers"])),
    )


def _train_round(
    model: PreTrainedModel,
    examples: list[Example],
    pad_token_id: int,
    config: ConfigRecord,
    seed: int,
) -> tuple[PreTrainedModel, list[float], list[str] | None]:
    """One round of plain training: every weight, or (``learn-finetune='lora'``) a fresh LoRA
    adapter merged into the weights afterwards; FedProx's ``proximal-mu`` when the server's
    strategy sends it. Returns the trained model, its epoch losses and the names of the
    weights that changed (None: all of them)."""
    lora = str(config.get("learn-finetune", "full")) == "lora"
    adapted = None
    if lora:
        settings = lora_settings(config)
        adapted = adapted_parameter_names(model, settings)
        model = get_peft_model(model, lora_config(settings))  # type: ignore[assignment]
    losses = train_full(
        model,
        examples,
        pad_token_id=pad_token_id,
        epochs=int(config_scalar(config, "local-epochs")),
        lr=float(config_scalar(config, "lr")),
        batch_size=int(config_scalar(config, "batch-size")),
        seed=seed,
        show_progress=False,
        proximal_mu=float(config_scalar(config, "proximal-mu", 0.0)),
        lr_schedule=str(config.get("lr-schedule", "warmup-cosine")),
    )
    if lora:  # the weights W + s·B·A, under the base model's own names
        model = model.merge_and_unload()  # type: ignore[operator]
    return model, losses, adapted


def fit_reply(msg: Message, context: Context) -> Message:
    """Train the received weights for one round of ``config['stage']`` and reply with them."""
    owner = f"node {context.node_id}"
    config = typed_record(msg.content, "config", ConfigRecord, owner)
    stage = str(config["stage"])
    if stage not in FIT_STAGES:
        raise ValueError(f"node {context.node_id}: unknown stage {stage!r} (expected {FIT_STAGES})")
    torch.set_num_threads(max(1, int(config_scalar(config, "client-threads", 1))))
    started = time.perf_counter()
    tokenizer = rebuild_tokenizer(config)
    private, public = _local_records(config, context, stage)
    metrics: dict[str, MetricRecordValues] = {}
    if stage == "mlm-base":  # only the private records are rewritten
        private = _rewritten(private, config, context)
        report = json.loads(str(context.state["dp-mlm"]["report-json"]))
        metrics["mlm-epsilon-max"] = float(report.get("epsilon_per_record_max", math.nan))
        metrics["mlm-tokens-replaced"] = float(report.get("tokens_replaced", 0))
    examples = [encode_record(tokenizer, r) for r in private + public]
    model = rebuild_model(config, typed_record(msg.content, "arrays", ArrayRecord, owner))
    seed = int(config_scalar(config, "seed"))
    changed: list[str] | None = None  # the weights the reply carries (None: all)
    if stage == "dp-base":
        state = (
            AccountantState.from_json(str(context.state["dp-accountant"]["json"]))
            if "dp-accountant" in context.state
            else AccountantState()
        )
        settings = DpSgdSettings(
            epsilon=float(config_scalar(config, "dp-epsilon")),
            delta=float(config_scalar(config, "dp-delta")),
            max_grad_norm=float(config_scalar(config, "dp-clip")),
            sample_rate=min(1.0, float(config_scalar(config, "batch-size")) / len(examples)),
            steps_per_round=max(
                1, math.ceil(len(examples) / float(config_scalar(config, "batch-size")))
            ),
            total_rounds=int(config_scalar(config, "total-rounds")),
            lr=float(config_scalar(config, "lr")),
            seed=seed,
        )
        stats, state = train_dp_sgd(
            model, examples, pad_token_id=tokenizer.pad_token_id, settings=settings, state=state
        )
        context.state["dp-accountant"] = ConfigRecord({"json": state.to_json()})
        metrics.update(
            {
                "epsilon-spent": float(stats["epsilon_spent"]),
                "delta": settings.delta,
                "noise-multiplier": float(stats["noise_multiplier"]),
                "loss-last": float(stats["loss_last"]),
                "steps": float(stats["steps"]),
            }
        )
    else:
        model, losses, changed = _train_round(model, examples, tokenizer.pad_token_id, config, seed)
        metrics["loss-last"] = float(losses[-1])
        metrics["proximal-mu"] = float(config_scalar(config, "proximal-mu", 0.0))
    metrics.update(
        {
            "num-examples": float(len(examples)),
            "total-seconds": time.perf_counter() - started,
        }
    )
    content = RecordDict(
        {
            "arrays": wire_state(model, changed),
            "metrics": MetricRecord(metrics),
            "info": ConfigRecord({"stage": stage, "examples-digest": examples_digest(examples)}),
        }
    )
    return Message(content=content, reply_to=msg)
