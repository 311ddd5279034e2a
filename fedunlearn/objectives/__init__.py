"""Local training objectives, looked up by name (run config ``objective=``).

An objective maps ``(model, batch, context)`` to a scalar loss that the optimiser
MINIMISES. Adding one is one new module with a ``@register_objective`` function, imported
at the bottom of this file. ``objective_requirements(name)`` says which extra data a client
must prepare for it (retain examples, refusal "alternate" answers, a frozen reference model).

Registered (docs/algorithms.md, "Local unlearning objectives"): ``nll``, ``ga``, ``graddiff``,
``npo``, ``simnpo``, ``dpo``, ``idk``, ``rmu``, ``undial``, ``satimp``, ``kl``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from peft import PeftModel

from fedunlearn.registry import Registry

ObjectiveFn = Callable[[torch.nn.Module, dict[str, torch.Tensor], "ObjectiveContext"], torch.Tensor]

OBJECTIVES: Registry[ObjectiveFn] = Registry("objective")


@dataclass(frozen=True)
class ObjectiveSpec:
    """The data an objective needs beyond the forget/train batch.

    * ``needs_retain``: retain examples on the same client (``context.next_retain_batch``).
    * ``needs_alternate``: the refusal answer for every training example; the batch then
      also carries ``alt_input_ids``, ``alt_labels``, ``alt_attention_mask``.
    * ``needs_reference``: the frozen received model π_ref (see :func:`reference_outputs`;
      a PEFT model provides it for free by disabling its adapter).
    """

    needs_retain: bool = False
    needs_alternate: bool = False
    needs_reference: bool = False


_REQUIREMENTS: dict[str, ObjectiveSpec] = {}


@dataclass
class ObjectiveContext:
    """What an objective may use beyond the current batch.

    ``reference_model`` is an explicit frozen π_ref (optional when the trained model is a
    PEFT model); ``retain_batches`` an endless iterator of retain batches (same keys as a
    training batch); ``options`` the objective's hyper-parameters by name (e.g. ``npo_beta``).
    """

    reference_model: torch.nn.Module | None = None
    retain_batches: Iterator[dict[str, torch.Tensor]] | None = None
    options: dict[str, float] = field(default_factory=dict)

    def next_retain_batch(self, objective_name: str) -> dict[str, torch.Tensor]:
        """The next retain batch; a clear ValueError when this client has no retain data."""
        if self.retain_batches is None:
            raise ValueError(
                f"objective {objective_name!r} needs retain examples on the forget client, "
                "but none were given (pass retain_examples= to train_lora_task_vector or set "
                "ObjectiveContext.retain_batches)"
            )
        try:
            return next(self.retain_batches)
        except StopIteration:
            raise ValueError(
                f"objective {objective_name!r}: the retain batch iterator is exhausted"
            ) from None

    def option(self, name: str, default: float) -> float:
        """Option ``name`` as a float, ``default`` when absent."""
        return float(self.options.get(name, default))


def register_objective(
    name: str,
    *,
    needs_retain: bool = False,
    needs_alternate: bool = False,
    needs_reference: bool = False,
) -> Callable[[ObjectiveFn], ObjectiveFn]:
    """Register ``fn`` under ``name`` with its data requirements; a name can be registered once."""

    def decorator(fn: ObjectiveFn) -> ObjectiveFn:
        OBJECTIVES.add(name, fn)
        _REQUIREMENTS[name] = ObjectiveSpec(
            needs_retain=needs_retain,
            needs_alternate=needs_alternate,
            needs_reference=needs_reference,
        )
        return fn

    return decorator


def get_objective(name: str) -> ObjectiveFn:
    """The objective registered under ``name``."""
    return OBJECTIVES[name]


def objective_requirements(name: str) -> ObjectiveSpec:
    """The data requirements of the objective registered under ``name``."""
    OBJECTIVES[name]  # an unknown name raises the registry's KeyError
    return _REQUIREMENTS[name]


def reference_outputs(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    context: ObjectiveContext,
    *,
    output_hidden_states: bool = False,
) -> Any:
    """Outputs of the frozen reference π_ref on ``batch``, computed under ``torch.no_grad()``.

    π_ref is ``context.reference_model`` when given; otherwise, when ``model`` is a
    ``peft.PeftModel``, the same model with its adapter disabled — that is exactly the
    received model, so no copy is needed. Anything else is a ValueError.
    """
    kwargs: dict[str, Any] = {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
    }
    if output_hidden_states:
        kwargs["output_hidden_states"] = True
    with torch.no_grad():
        if context.reference_model is not None:
            return context.reference_model(**kwargs)
        if isinstance(model, PeftModel):
            with model.disable_adapter():
                return model(**kwargs)
    raise ValueError(
        "this objective needs the frozen reference model π_ref: pass "
        "ObjectiveContext(reference_model=...) or train a peft.PeftModel (its adapter-disabled "
        "base model is used)"
    )


def reference_logits(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], context: ObjectiveContext
) -> torch.Tensor:
    """Logits of the frozen reference π_ref on ``batch`` (no gradient); see reference_outputs."""
    return reference_outputs(model, batch, context).logits


from fedunlearn.objectives import (  # noqa: E402,F401  (registration side effects)
    basic,
    distillation,
    preference,
    representation,
)
