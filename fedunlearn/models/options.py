"""The ``model`` and ``substrate`` option groups: which model is unlearned, and how the
built-in one is built."""

from __future__ import annotations

from dataclasses import dataclass

from fedunlearn.options import (
    COUNT,
    POSITIVE,
    POSITIVE_INT,
    POSITIVE_INT_OR_SCENARIO,
    POSITIVE_OR_SCENARIO,
    OneOf,
    option,
    option_group,
)

#: Model dtypes (float16 would need loss scaling).
DTYPES = ("auto", "float32", "bfloat16")
#: How the server's weights reach the nodes (``strategies.model_delivery``).
DELIVERIES = ("auto", "full")


def _model_names() -> list[str]:
    from fedunlearn.models.pretrained import model_names

    return list(model_names())


@option_group("model")
@dataclass(frozen=True)
class ModelOptions:
    """The model to unlearn (``[tool.flwr.app.config.model]``)."""

    name: str = option(
        "builtin",
        "builtin, or a registry model (smollm2-135m: converted once and fine-tuned on the "
        "scenario's data into the knowledgeable model and the reference, cached)",
        OneOf(_model_names),
    )
    path: str = option(
        "", "a local Hugging Face causal-LM checkpoint (or .gguf file) to unlearn as it is"
    )
    dtype: str = option(
        "auto", "model dtype (auto: bf16 on CUDA, fp32 on CPU)", OneOf(lambda: DTYPES)
    )
    load_in_4bit: bool = option(False, "NF4 training copies on the clients (LoRA only)")
    cache_dir: str = option(
        "", "model cache ($FEDUNLEARN_CACHE_DIR or ~/.cache/fedunlearn; run_local uses .cache/)"
    )
    base_checkpoint: str = option(
        "",
        "a node's local copy of the checkpoint the server starts from (a SuperNode's "
        "--node-config wins): where its hash matches, the node is sent only the weights that "
        "differ from it",
    )
    delivery: str = option(
        "auto",
        "auto: a node holding the server's starting checkpoint (declared, or in a simulation "
        "the folder the server loaded, where the node can read it) is sent only the weights "
        "that differ from it; full: every node is sent the whole model every round",
        OneOf(lambda: DELIVERIES),
    )
    finetune_epochs: int = option(
        0,
        "full fine-tuning epochs of a registry model on the scenario's data; default 6 (muse 8)",
        POSITIVE_INT_OR_SCENARIO,
    )
    finetune_lr: float = option(
        0.0, "its learning rate; default 1e-4 (muse 5e-4)", POSITIVE_OR_SCENARIO
    )


@option_group("substrate")
@dataclass(frozen=True)
class SubstrateOptions:
    """Size and training of the built-in model (``[tool.flwr.app.config.substrate]``)."""

    hidden_size: int = option(192, "hidden size", POSITIVE_INT)
    layers: int = option(4, "decoder layers", POSITIVE_INT)
    intermediate_size: int = option(512, "MLP width", POSITIVE_INT)
    pretrain_epochs: int = option(2, "pre-training epochs on the background corpus", COUNT)
    finetune_epochs: int = option(16, "knowledge fine-tuning epochs", COUNT)
    finetune_lr: float = option(2e-3, "knowledge fine-tuning learning rate", POSITIVE)
    background_documents: int = option(1500, "documents of the background corpus", COUNT)
