"""The Flower ClientApp: a forget or retain client for one unlearning request.

On a TRAIN message the client rebuilds the model it was sent, materialises its own data
shard, computes the empirical Fisher diagonal at the received weights (docs/algorithms.md,
"What a client uploads"), trains a LoRA adapter (or, with ``finetune='full'``, the targeted
weights themselves) with its role's objective and replies with the task vector, the Fisher
diagonal and its metrics, in the run's upload forms (``upload.task-vector``, ``upload.fisher``:
:mod:`fedunlearn.upload_codec`).
"""

from __future__ import annotations

import json
import resource
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import cast

import torch
from flwr.app import ArrayRecord, ConfigRecord, ConfigRecordValues, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from clients.base_checkpoint import base_declaration, received_model, simulated_node
from clients.fit_task import fit_reply, lora_settings
from clients.local_data import client_scenario, shard
from fedunlearn.allocator import return_freed_memory
from fedunlearn.fisher import empirical_fisher_diagonal
from fedunlearn.models.quantization import quantize_4bit
from fedunlearn.objectives import objective_requirements
from fedunlearn.objectives.refusal import refusal_examples
from fedunlearn.qa_format import encode_record
from fedunlearn.training.full_finetune import train_full_task_vector
from fedunlearn.training.lora import (
    LocalTrainSettings,
    adapted_parameter_names,
    train_lora_task_vector,
)
from fedunlearn.upload_codec import LowRankDelta, encode_fisher, encode_task_vector, upload_bytes
from wire.delivery import BASE_OFFER_KEY, SHARED_MACHINE_KEY
from wire.messages import (
    FIT_ACTION,
    add_kept_part,
    config_list,
    config_scalar,
    encode_client_reply,
    packed_record,
    rebuild_tokenizer,
    typed_record,
    wire_metrics,
)

app = ClientApp()

ROLES = ("forget", "retain")


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Tell the server the role and partition this node declared in ``--node-config``.

    Replies ``{"node-info": {"role": ..., "partition-id": ...}}`` with only the keys the
    node config sets (simulation: ``partition-id`` alone); the server maps the scenario's
    clients onto the nodes with it (``strategies.node_roles``). The data path stays local.
    A node that has a base checkpoint (declared, or in a simulation the ``base-offer`` of the
    server's query) also replies its ``base-sha256`` (or ``base-problem``):
    ``clients.base_checkpoint``; a simulated node replies ``shared-machine`` (it can read the
    files the server writes).
    """
    info: dict[str, ConfigRecordValues] = {
        key: context.node_config[key]
        for key in ("role", "partition-id")
        if key in context.node_config
    }
    asked = msg.content.config_records.get("node-info")
    offer = asked.get(BASE_OFFER_KEY) if asked is not None else None
    info.update(base_declaration(context, str(offer) if offer else None))
    if simulated_node(context):  # can read what the server writes (MPU's copies)
        info[SHARED_MACHINE_KEY] = True
    return Message(content=RecordDict({"node-info": ConfigRecord(info)}), reply_to=msg)


@app.train(FIT_ACTION)
def fit(msg: Message, context: Context) -> Message:
    """One round of a DP2Unlearning stage's federated training (``train.fit`` messages)."""
    return_freed_memory()
    return fit_reply(msg, context)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Fisher at the received weights, then LoRA training with the role's objective.

    With ``mpu.copies`` = m the message holds m published copies (``arrays-0`` ...); the
    client runs the same local update on each and replies ``task_vector-k`` / ``fisher-k``.
    A mixed-role forget client (``kept-indices``) adds the retain upload of the records it
    keeps (:func:`kept_reply`, under ``kept-``).
    """
    return_freed_memory()  # the process holds what it uses, not the most it ever held
    owner = f"node {context.node_id}"
    config = typed_record(msg.content, "config", ConfigRecord, owner)
    role = str(config["role"])
    if role not in ROLES:
        raise ValueError(f"node {context.node_id}: unknown role {role!r} (expected {ROLES})")
    torch.set_num_threads(max(1, int(config_scalar(config, "client-threads", 1))))
    started = time.perf_counter()
    tokenizer = rebuild_tokenizer(config)
    records = client_scenario(config, context).records()
    own = shard(records, [int(i) for i in config_list(config, "indices")], "shard")
    examples = [encode_record(tokenizer, r) for r in own]
    objective = str(config["objective"]) if role == "forget" else "nll"
    needs = objective_requirements(objective)
    retain_examples = None
    if needs.needs_retain:
        local = shard(
            records, [int(i) for i in config_list(config, "retain-indices")], "local retain"
        )
        retain_examples = [encode_record(tokenizer, r) for r in local] or None
    alternate_examples = None
    if needs.needs_alternate:
        if any("question" not in r for r in own):
            raise ValueError(
                f"node {context.node_id}: objective {objective!r} needs question/answer "
                "records (it prefers a refusal answer), but this shard holds plain text"
            )
        questions = [r["question"] for r in own]
        alternate_examples = refusal_examples(
            tokenizer, questions, int(config_scalar(config, "seed"))
        )
    settings = LocalTrainSettings(
        objective=objective,
        steps=int(config_scalar(config, "steps")),
        lr=float(config_scalar(config, "lr")),
        batch_size=int(config_scalar(config, "batch-size")),
        seed=int(config_scalar(config, "seed")),
        options=json.loads(str(config["objective-options-json"])),
        activation_checkpointing=bool(config.get("activation-checkpointing", False)),
    )
    copies = int(config_scalar(config, "mpu-copies", 0))
    kept = [int(i) for i in config_list(config, "kept-indices", [])]
    if kept and copies:
        raise ValueError(f"{owner}: a mixed-role client receives one copy of the model, not MPU's")
    names = ["arrays"] if copies == 0 else [f"arrays-{k}" for k in range(copies)]
    outputs = []
    for k, name in enumerate(names):
        # the copy's weights move into the model and the message lets go of them: one copy of
        # the model is alive at a time (the next copy is decoded after this one is trained;
        # a mixed-role client keeps the received weights for its second upload)
        model = received_model(
            config,
            typed_record(msg.content, name, ArrayRecord, owner),
            context,
            copy=k if copies else None,
        )
        if not kept:
            del msg.content[name]
        outputs.append(
            local_update(
                model,
                examples,
                config,
                settings,
                pad_token_id=tokenizer.pad_token_id,
                retain_examples=retain_examples,
                alternate_examples=alternate_examples,
            )
        )
        del model
    content = encode_client_reply(
        role=role,
        domain=str(config["domain"]),
        objective=objective,
        num_examples=len(examples),
        task_vector=packed_record(outputs[0][0]),
        fisher=packed_record(outputs[0][1]),
        metrics=reply_metrics(outputs, started),
    )
    if kept:
        arrays = typed_record(msg.content, "arrays", ArrayRecord, owner)
        model = received_model(config, arrays, context)
        del msg.content["arrays"], arrays
        add_kept_part(content, kept_reply(model, records, kept, tokenizer, config, settings))
    if copies:
        content["task_vector-0"] = content["task_vector"]
        content["fisher-0"] = content["fisher"]
        del content["task_vector"], content["fisher"]
        for k, (task_vector, fisher, _) in enumerate(outputs[1:], start=1):
            content[f"task_vector-{k}"] = packed_record(task_vector)
            content[f"fisher-{k}"] = packed_record(fisher)
    return Message(content=content, reply_to=msg)


def reply_metrics(
    outputs: list[tuple[dict, dict, dict[str, float]]], started: float
) -> dict[str, float]:
    """The reply's metrics: the last copy's, with times and upload sizes summed over the
    copies, and the process's peak resident memory so far (ru_maxrss, MiB on Linux)."""
    return {
        **outputs[-1][2],
        "fisher-seconds": sum(o[2]["fisher-seconds"] for o in outputs),
        "train-seconds": sum(o[2]["train-seconds"] for o in outputs),
        "total-seconds": time.perf_counter() - started,
        "task-vector-norm": outputs[-1][2]["task-vector-norm"],
        **{
            key: sum(o[2][key] for o in outputs)
            for key in ("bytes-sent", "bytes-task-vector", "bytes-fisher", "bytes-dense")
        },
        "peak-rss-mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def kept_reply(
    model: PreTrainedModel,
    records: list,
    kept: list[int],
    tokenizer: PreTrainedTokenizerBase,
    config: ConfigRecord,
    forget_settings: LocalTrainSettings,
) -> RecordDict:
    """A mixed-role client's second upload: what a retain client holding the ``kept``
    records would send — Fisher and task vector of ``model`` trained with ``nll`` and the
    retain role's ``kept-steps``, ``kept-lr`` and ``kept-seed``."""
    started = time.perf_counter()
    examples = [encode_record(tokenizer, r) for r in shard(records, kept, "kept")]
    settings = replace(
        forget_settings,
        objective="nll",
        steps=int(config_scalar(config, "kept-steps")),
        lr=float(config_scalar(config, "kept-lr")),
        seed=int(config_scalar(config, "kept-seed")),
    )
    output = local_update(
        model,
        examples,
        config,
        settings,
        pad_token_id=tokenizer.pad_token_id,
        retain_examples=None,
        alternate_examples=None,
    )
    return encode_client_reply(
        role="retain",
        domain=str(config["kept-domain"]),
        objective="nll",
        num_examples=len(examples),
        task_vector=packed_record(output[0]),
        fisher=packed_record(output[1]),
        metrics=reply_metrics([output], started),
    )


def local_update(
    model: PreTrainedModel,
    examples: list,
    config: ConfigRecord,
    settings: LocalTrainSettings,
    *,
    pad_token_id: int,
    retain_examples: list | None,
    alternate_examples: list | None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, float]]:
    """Fisher diagonal at ``model``'s weights, then a task vector (docs/algorithms.md, "What a
    client uploads"): s·B@A of a LoRA adapter, or with ``finetune='full'`` θ_after − θ_received
    of the same targeted weights."""
    lora = lora_settings(config)
    names = adapted_parameter_names(model, lora)
    t_fisher = time.perf_counter()
    fisher = empirical_fisher_diagonal(
        model,
        examples,
        names,
        pad_token_id=pad_token_id,
        num_batches=int(config_scalar(config, "fisher-batches")),
    )
    fisher_seconds = time.perf_counter() - t_fisher
    dense_bytes = 2 * 4 * sum(v.numel() for v in fisher.values())
    fisher_parts = encoded_fisher(fisher, config)  # the dense Fisher is not kept in training
    if bool(config.get("load-in-4bit", False)):
        # the Fisher above came from the unquantised weights; train on an NF4 copy
        # (docs/algorithms.md, "What a client uploads")
        model = quantize_4bit(model)
    finetune = str(config.get("finetune", "lora"))
    task_vector: Mapping[str, torch.Tensor | LowRankDelta]
    if finetune == "full":
        task_vector, stats = train_full_task_vector(
            model,
            examples,
            pad_token_id=pad_token_id,
            target_names=names,
            train=settings,
            retain_examples=retain_examples,
            alternate_examples=alternate_examples,
        )
    elif finetune == "lora":
        task_vector, stats = train_lora_task_vector(
            model,
            examples,
            pad_token_id=pad_token_id,
            lora=lora,
            train=settings,
            retain_examples=retain_examples,
            alternate_examples=alternate_examples,
            as_factors=str(config.get("task-vector-upload", "dense")) == "factors",
        )
    else:
        raise ValueError(f"finetune must be 'lora' or 'full', got {finetune!r}")
    tv_parts, sizes = encode_upload(task_vector, fisher_parts, dense_bytes, config)
    metrics = {
        **wire_metrics(stats),
        **sizes,
        "fisher-seconds": fisher_seconds,
        "task-vector-norm": task_vector_norm(task_vector),
        "cuda": float(next(model.parameters()).is_cuda),
    }
    return tv_parts, fisher_parts, metrics


def task_vector_norm(task_vector: Mapping[str, torch.Tensor | LowRankDelta]) -> float:
    """‖Δθ‖ over every weight (float64), dense or kept as LoRA factors."""
    dense = (v.dense() if isinstance(v, LowRankDelta) else v for v in task_vector.values())
    total = sum((t.double() ** 2).sum() for t in dense)
    # a tensor: a task vector has at least one weight (sum's start, 0, is never returned)
    return torch.sqrt(cast(torch.Tensor, total)).item()


def encoded_fisher(
    fisher: dict[str, torch.Tensor], config: ConfigRecord
) -> dict[str, torch.Tensor]:
    """The Fisher's parts in the run's upload form (``upload.fisher``,
    ``upload.fisher-fraction``), each dense tensor taken out of ``fisher`` as soon as its parts
    exist: the dense Fisher is as large as the adapted weights, and it is let go of before
    local training instead of being held through it."""
    form = str(config.get("fisher-upload", "dense"))
    fraction = float(config_scalar(config, "fisher-upload-fraction", 1.0))
    parts: dict[str, torch.Tensor] = {}
    for key in list(fisher):
        parts.update(encode_fisher({key: fisher.pop(key)}, form, fraction))
    return parts


def encode_upload(
    task_vector: Mapping[str, torch.Tensor | LowRankDelta],
    fisher_parts: dict[str, torch.Tensor],
    dense_bytes: int,
    config: ConfigRecord,
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The task vector in the run's upload form (``upload.task-vector``) and the sizes of the
    upload: ``bytes-task-vector``, ``bytes-fisher`` (of ``fisher_parts``), ``bytes-sent``
    (both) and ``bytes-dense`` (``dense_bytes``: both as dense float32)."""
    tv_parts = encode_task_vector(task_vector, str(config.get("task-vector-upload", "dense")))
    tv_bytes, fisher_bytes = upload_bytes(tv_parts), upload_bytes(fisher_parts)
    sizes = {
        "bytes-task-vector": float(tv_bytes),
        "bytes-fisher": float(fisher_bytes),
        "bytes-sent": float(tv_bytes + fisher_bytes),
        "bytes-dense": float(dense_bytes),
    }
    return tv_parts, sizes
