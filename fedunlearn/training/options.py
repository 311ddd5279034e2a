"""The ``training`` and ``lora`` option groups: the clients' local training."""

from __future__ import annotations

from dataclasses import dataclass

from fedunlearn.options import (
    POSITIVE,
    POSITIVE_INT,
    POSITIVE_INT_OR_SCENARIO,
    POSITIVE_OR_SCENARIO,
    Number,
    OneOf,
    Parsed,
    option,
    option_group,
)

FINETUNE_MODES = ("lora", "full")
#: ``training.activation-checkpointing``: auto = on for a registry model or a checkpoint
#: (``model.name``, ``model.path``), off for the built-in model
ACTIVATION_CHECKPOINTING = ("auto", "on", "off")


def _check_layers(text: str) -> None:
    from fedunlearn.training.lora import parse_layers

    if text != "auto":
        parse_layers(text)


@option_group("training")
@dataclass(frozen=True)
class TrainingOptions:
    """Local optimisation on the clients (``[tool.flwr.app.config.training]``)."""

    forget_steps: int = option(
        0,
        "forget clients' steps (scenario: 12; wmdp 30; muse on a registry model 24)",
        POSITIVE_INT_OR_SCENARIO,
    )
    forget_lr: float = option(
        0.0,
        "forget clients' learning rate (scenario: 1e-3; wmdp 5e-3; a registry model 2e-4, "
        "on muse 1e-3)",
        POSITIVE_OR_SCENARIO,
    )
    retain_steps: int = option(
        0,
        "retain clients' steps (next-token NLL); default 40, a registry model 10 (on muse 24)",
        POSITIVE_INT_OR_SCENARIO,
    )
    retain_lr: float = option(
        0.0,
        "retain clients' learning rate; default 1e-3, a registry model 2e-4 (on muse 1e-3)",
        POSITIVE_OR_SCENARIO,
    )
    batch_size: int = option(8, "local batch size", POSITIVE_INT)
    seed: int = option(
        -1,
        "seeds the clients' local training alone (batch order, LoRA initialisation, refusal "
        "answers); the data, the model and the evaluation keep seed; -1 = seed",
        Number(low=0, special=((-1.0, "the run's seed"),)),
    )
    finetune: str = option(
        "lora",
        "lora, or full: clients train the targeted weights themselves (dense task vectors; "
        "not with model.load-in-4bit)",
        OneOf(lambda: FINETUNE_MODES),
    )
    fisher_batches: int = option(
        0,
        "batches of one sequence for the empirical Fisher diagonal; default 20, a registry model 4",
        POSITIVE_INT_OR_SCENARIO,
    )
    client_threads: int = option(1, "torch threads per client process", POSITIVE_INT)
    activation_checkpointing: str = option(
        "auto",
        "recompute each decoder layer in the backward pass instead of keeping its activations "
        "(the same gradients; one more forward pass per step, the activations of one layer "
        "alive instead of all): on, off, or auto = on for a registry model or a checkpoint, "
        "off for the built-in model",
        OneOf(lambda: ACTIVATION_CHECKPOINTING),
    )


@option_group("lora")
@dataclass(frozen=True)
class LoraOptions:
    """The LoRA adapter W + (alpha / rank)·B·A (``[tool.flwr.app.config.lora]``)."""

    rank: int = option(16, "adapter rank", POSITIVE_INT)
    alpha: float = option(32.0, "adapter scale numerator (s = alpha / rank)", POSITIVE)
    targets: str = option("auto", "comma-separated module names LoRA adapts; auto = the scenario's")
    layers: str = option(
        "auto",
        "layer indices LoRA adapts (e.g. 1,2 or 0-3); auto = the scenario's",
        Parsed(_check_layers, "auto, or layer indices / ranges"),
    )
