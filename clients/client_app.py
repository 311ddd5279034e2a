"""The Flower ClientApp: a forget or retain client for one unlearning request.

On a TRAIN message the client rebuilds the model it was sent, materialises its own data
shard, computes the empirical Fisher diagonal at the received weights (SPEC §1.1), trains a
LoRA adapter with its role's objective and replies with the dense task vector s·B@A, the
Fisher diagonal and its metrics.
"""

from __future__ import annotations

import functools
import time

import torch
from flwr.app import ConfigRecord, Context, Message
from flwr.clientapp import ClientApp

from clients.messages import encode_client_reply, rebuild_model, rebuild_tokenizer
from fedunlearn.benchmarks.tofu import TofuData, generate_tofu
from fedunlearn.benchmarks.tofu_files import load_tofu_files
from fedunlearn.fisher import empirical_fisher_diagonal
from fedunlearn.qa_format import encode_qa
from fedunlearn.scenarios import all_records
from fedunlearn.training.lora import (
    LocalTrainSettings,
    LoraSettings,
    adapted_parameter_names,
    train_lora_task_vector,
)

app = ClientApp()

ROLES = ("forget", "retain")


@functools.lru_cache(maxsize=4)
def _benchmark(seed: int, num_authors: int, qa_per_author: int, data_path: str) -> TofuData:
    if data_path:
        return load_tofu_files(data_path)
    return generate_tofu(seed, num_authors, qa_per_author)


def client_records(config: ConfigRecord, context: Context) -> list[dict]:
    """This client's own QA records (its shard of its local copy of the benchmark).

    A ``data-path`` in the node config (deployment: each machine's own files) takes
    precedence over the one in the message.
    """
    data_path = str(context.node_config.get("data-path", config.get("data-path", "")))
    data = _benchmark(
        int(config["data-seed"]),
        int(config["num-authors"]),
        int(config["qa-per-author"]),
        data_path,
    )
    records = all_records(data)
    indices = [int(i) for i in config["indices"]]
    bad = [i for i in indices if not 0 <= i < len(records)]
    if bad:
        raise IndexError(f"shard indices {bad[:5]} are outside the {len(records)} records")
    return [records[i] for i in indices]


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Fisher at the received weights, then LoRA training with the role's objective."""
    config = msg.content["config"]
    role = str(config["role"])
    if role not in ROLES:
        raise ValueError(f"node {context.node_id}: unknown role {role!r} (expected {ROLES})")
    torch.set_num_threads(max(1, int(config.get("client-threads", 1))))
    started = time.perf_counter()
    model = rebuild_model(config, msg.content["arrays"])
    tokenizer = rebuild_tokenizer(config)
    records = client_records(config, context)
    examples = [encode_qa(tokenizer, r["question"], r["answer"]) for r in records]
    lora = LoraSettings(
        rank=int(config["lora-rank"]),
        alpha=float(config["lora-alpha"]),
        target_modules=tuple(str(config["lora-targets"]).split(",")),
    )
    names = adapted_parameter_names(model, lora)
    t_fisher = time.perf_counter()
    fisher = empirical_fisher_diagonal(
        model,
        examples,
        names,
        pad_token_id=tokenizer.pad_token_id,
        num_batches=int(config["fisher-batches"]),
    )
    fisher_seconds = time.perf_counter() - t_fisher
    objective = str(config["objective"]) if role == "forget" else "nll"
    settings = LocalTrainSettings(
        objective=objective,
        steps=int(config["steps"]),
        lr=float(config["lr"]),
        batch_size=int(config["batch-size"]),
        seed=int(config["seed"]),
    )
    task_vector, stats = train_lora_task_vector(
        model, examples, pad_token_id=tokenizer.pad_token_id, lora=lora, train=settings
    )
    tv_norm = torch.sqrt(sum((v.double() ** 2).sum() for v in task_vector.values())).item()
    upload = sum(v.numel() * v.element_size() for v in task_vector.values())
    upload += sum(v.numel() * v.element_size() for v in fisher.values())
    metrics = {
        **stats,
        "fisher-seconds": fisher_seconds,
        "total-seconds": time.perf_counter() - started,
        "task-vector-norm": tv_norm,
        "bytes-sent": float(upload),
    }
    content = encode_client_reply(
        role=role,
        domain=str(config["domain"]),
        objective=objective,
        num_examples=len(examples),
        task_vector=task_vector,
        fisher=fisher,
        metrics=metrics,
    )
    return Message(content=content, reply_to=msg)
