"""The wire format between the server's strategy and the ClientApp.

Server → client (TRAIN): ``arrays`` (the global model's weights), ``config`` (a
ConfigRecord with the node's role, domain, shard, training settings, and how to rebuild the
model and tokenizer: ``model-config-json``, ``tokenizer-json``).
Client → server: ``task_vector`` and ``fisher`` (ArrayRecords of upload parts keyed by model
parameter names: dense tensors, LoRA factors, bf16 or top-k Fisher — see
:mod:`fedunlearn.upload_codec`), ``metrics`` (MetricRecord) and ``info`` (ConfigRecord: role,
domain, objective). A mixed-role client (config ``kept-indices``) adds its second upload, the
task vector of the records it keeps, as the same four records under :data:`KEPT_PREFIX`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Mapping
from typing import TypeVar

import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    ConfigScalar,
    ConfigScalarList,
    MessageType,
    MetricRecord,
    RecordDict,
)
from tokenizers import Tokenizer
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from fedunlearn.merging import ClientUpdate
from fedunlearn.models.llama import resolve_dtype
from fedunlearn.upload_codec import DecodedTensors
from wire.arrays import array_tensor

R = TypeVar("R", ArrayRecord, MetricRecord, ConfigRecord)


def typed_record(content: RecordDict, key: str, kind: type[R], owner: str) -> R:
    """``content[key]`` as the record type the wire format gives it (a ``RecordDict`` types
    its values as any of the three); a ``TypeError`` naming ``owner`` when it is another."""
    record = content[key]
    if not isinstance(record, kind):
        raise TypeError(
            f"{owner}: record {key!r} is a {type(record).__name__}, not {kind.__name__}"
        )
    return record


def config_scalar(
    config: ConfigRecord, key: str, default: ConfigScalar | None = None
) -> ConfigScalar:
    """The single value ``config[key]`` (``config.get(key, default)`` when a default is given);
    a ``TypeError`` when it is a list."""
    value = config[key] if default is None else config.get(key, default)
    if isinstance(value, list):
        raise TypeError(f"config {key!r} is a list, not a single value")
    return value


def config_list(
    config: ConfigRecord, key: str, default: ConfigScalarList | None = None
) -> ConfigScalarList:
    """The list ``config[key]`` (``config.get(key, default)`` when a default is given); a
    ``TypeError`` when it is a single value."""
    value = config[key] if default is None else config.get(key, default)
    if not isinstance(value, list):
        raise TypeError(f"config {key!r} is a single value, not a list")
    return value


def describe_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> dict[str, str]:
    """Config entries that let a client rebuild the model skeleton and tokenizer offline (the
    tokenizer as its ``tokenizers`` JSON: a fast tokenizer)."""
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise TypeError(f"a {type(tokenizer).__name__} has no tokenizers JSON to send the clients")
    return {
        "model-config-json": model.config.to_json_string(use_diff=False),
        "tokenizer-json": tokenizer.backend_tokenizer.to_str(),
        "tokenizer-eos": tokenizer.eos_token,
        "tokenizer-pad": tokenizer.pad_token,
        "tokenizer-chat-template": str(getattr(tokenizer, "chat_template", None) or ""),
    }


def wire_state(model: torch.nn.Module, keys: Collection[str] | None = None) -> ArrayRecord:
    """The model's weights (those named in ``keys``; None: all) as float32 CPU arrays
    (Flower's arrays have no bfloat16; clients cast back to their ``dtype``)."""
    state = model.state_dict()
    return ArrayRecord(
        {
            k: v.detach().to("cpu", torch.float32)
            for k, v in state.items()
            if keys is None or k in keys
        }
    )


def rebuild_model(config: ConfigRecord, arrays: ArrayRecord) -> PreTrainedModel:
    """Model skeleton from ``model-config-json`` filled with the received weights, in the
    run's ``dtype`` (auto: bfloat16 on CUDA, float32 on CPU), on CUDA when present. The
    weights are decoded one tensor at a time into the model (no second copy of the state)."""
    model = _skeleton(config)
    state = model.state_dict()
    missing = set(state) - set(arrays) - _tied_keys(model)
    unexpected = set(arrays) - set(state)
    if missing or unexpected:
        raise ValueError(
            f"received weights do not fit the model: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    with torch.no_grad():
        for key in arrays:
            state[key].copy_(array_tensor(arrays[key]))
    return finish_model(model)


def _skeleton(config: ConfigRecord) -> PreTrainedModel:
    """The model of ``model-config-json`` in the run's ``dtype``, its weights not yet set."""
    spec = json.loads(str(config["model-config-json"]))
    model_config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    dtype = resolve_dtype(str(config.get("dtype", "float32")))
    return AutoModelForCausalLM.from_config(model_config, dtype=dtype)


def finish_model(model: PreTrainedModel) -> PreTrainedModel:
    """A received model ready to use: on CUDA when present, in eval mode."""
    if torch.cuda.is_available():
        # PreTrainedModel.to is @wraps(nn.Module.to): typed as unbound (self = argument 1)
        model.to("cuda")  # type: ignore[arg-type]
    model.eval()
    return model


def _tied_keys(model: PreTrainedModel) -> set[str]:
    tied = getattr(model, "_tied_weights_keys", None) or []
    return set(tied if isinstance(tied, list | tuple | set) else tied.keys())


def rebuild_tokenizer(config: ConfigRecord) -> PreTrainedTokenizerFast:
    """Tokenizer from ``tokenizer-json``, its special tokens and its chat template (QA prompts
    are chat turns when there is one: :mod:`fedunlearn.qa_format`)."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(str(config["tokenizer-json"])),
        eos_token=str(config["tokenizer-eos"]),
        pad_token=str(config["tokenizer-pad"]),
    )
    template = str(config.get("tokenizer-chat-template", ""))
    if template:
        tokenizer.chat_template = template
    return tokenizer


#: The ClientApp's train actions: Flower routes ``train`` (its default action) to one
#: unlearning round and ``train.fit`` to one round of a DP2Unlearning stage's FedAvg training.
FIT_ACTION = "fit"
FIT_MESSAGE_TYPE = f"{MessageType.TRAIN}.{FIT_ACTION}"


def wire_metrics(stats: Mapping[str, float]) -> dict[str, float]:
    """Training statistics under the names they travel by: words joined by ``-``
    (``train_seconds`` → ``train-seconds``), as every metric of a reply; the server reports
    each under its name with ``_`` (``strategies.reply_fields``)."""
    return {name.replace("_", "-"): float(value) for name, value in stats.items()}


def encode_client_reply(
    *,
    role: str,
    domain: str,
    objective: str,
    num_examples: int,
    task_vector: dict[str, torch.Tensor] | ArrayRecord,
    fisher: dict[str, torch.Tensor] | ArrayRecord | None,
    metrics: dict[str, float],
) -> RecordDict:
    """Pack a client's summary (docs/algorithms.md, "What a client uploads") into a reply
    RecordDict (the upload parts as dicts of tensors, or already packed by
    :func:`packed_record`)."""
    content = RecordDict()
    content["task_vector"] = _record(task_vector)
    if fisher is not None:
        content["fisher"] = _record(fisher)
    content["metrics"] = MetricRecord({"num-examples": num_examples, **metrics})
    content["info"] = ConfigRecord({"role": role, "domain": domain, "objective": objective})
    return content


#: Prefix of a mixed-role reply's records of its second (retain) upload: ``kept-task_vector``...
KEPT_PREFIX = "kept-"
REPLY_RECORDS = ("task_vector", "fisher", "metrics", "info")


def add_kept_part(content: RecordDict, part: RecordDict) -> None:
    """Move the records of ``part`` (an :func:`encode_client_reply` of the kept records) into
    ``content`` under :data:`KEPT_PREFIX`."""
    for name in list(part):
        content[KEPT_PREFIX + name] = part.pop(name)


def kept_part(content: RecordDict) -> RecordDict:
    """The second upload of a mixed-role reply as a reply of its own (its records renamed
    back; an empty RecordDict when the reply has none)."""
    names = [name for name in REPLY_RECORDS if KEPT_PREFIX + name in content]
    return RecordDict({name: content[KEPT_PREFIX + name] for name in names})


def _record(parts: dict[str, torch.Tensor] | ArrayRecord) -> ArrayRecord:
    if isinstance(parts, ArrayRecord):
        return parts
    return ArrayRecord({k: v.contiguous() for k, v in parts.items()})


def packed_record(parts: dict[str, torch.Tensor]) -> ArrayRecord:
    """``parts`` moved into an ArrayRecord one tensor at a time: each is taken out of
    ``parts`` once serialised, so the tensors and their bytes are not all held twice."""
    record = ArrayRecord()
    for key in list(parts):
        record[key] = Array(parts.pop(key).contiguous())
    return record


def decoded_arrays(
    record: ArrayRecord, shapes: Mapping[str, tuple[int, ...]] | None = None
) -> DecodedTensors:
    """The dense tensors of an uploaded record (or of a record of weights, any dtype
    :mod:`wire.arrays` writes), decoded from its parts one weight at a time when a merge asks
    for them (:mod:`fedunlearn.upload_codec`)."""
    return DecodedTensors(list(record), lambda name: array_tensor(record[name]), shapes)


def decode_client_reply(
    node_id: int | str, content: RecordDict, shapes: Mapping[str, tuple[int, ...]] | None = None
) -> tuple[ClientUpdate, dict]:
    """Unpack a reply into a ``ClientUpdate`` and its metrics; errors (``ValueError`` /
    ``TypeError``) name the node. The server validates the reply before
    (``strategies.reply_validation``); this only refuses what cannot be decoded at all.
    ``shapes`` (the global weights' shapes) are needed to decode a top-k Fisher; without
    them the task vector's shapes are used."""
    for key in ("task_vector", "metrics", "info"):
        if key not in content:
            raise ValueError(f"client {node_id}: reply has no {key!r} record")
    info = content["info"]
    metrics = dict(content["metrics"])
    if "num-examples" not in metrics:
        raise ValueError(f"client {node_id}: reply's metrics have no 'num-examples'")
    count = metrics["num-examples"]
    if not isinstance(count, int | float) or not math.isfinite(count) or count != int(count):
        raise ValueError(f"client {node_id}: num-examples {count!r} is not a whole number")
    owner = f"client {node_id}"
    task_vector = decoded_arrays(typed_record(content, "task_vector", ArrayRecord, owner), shapes)
    if shapes is None:
        shapes = {key: tuple(task_vector[key].shape) for key in task_vector}
    fisher = (
        decoded_arrays(typed_record(content, "fisher", ArrayRecord, owner), shapes)
        if "fisher" in content
        else None
    )
    update = ClientUpdate(
        node_id=node_id,
        role=str(info["role"]),
        domain=str(info["domain"]),
        num_examples=int(count),
        task_vector=task_vector,
        fisher=fisher,
    )
    return update, metrics
