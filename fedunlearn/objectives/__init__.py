"""Local training objectives, looked up by name (run config ``objective=``).

An objective maps ``(model, batch, context)`` to a scalar loss that the optimiser
MINIMISES. Adding one is one new module with a ``@register_objective`` function, imported
at the bottom of this file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

ObjectiveFn = Callable[[torch.nn.Module, dict[str, torch.Tensor], "ObjectiveContext"], torch.Tensor]

OBJECTIVES: dict[str, ObjectiveFn] = {}


@dataclass
class ObjectiveContext:
    """What an objective may use beyond the current batch."""

    reference_model: torch.nn.Module | None = None
    retain_batch: dict[str, torch.Tensor] | None = None
    options: dict[str, float] = field(default_factory=dict)


def register_objective(name: str) -> Callable[[ObjectiveFn], ObjectiveFn]:
    """Register ``fn`` under ``name``; a name can be registered once."""

    def decorator(fn: ObjectiveFn) -> ObjectiveFn:
        if name in OBJECTIVES:
            raise ValueError(f"objective {name!r} is already registered")
        OBJECTIVES[name] = fn
        return fn

    return decorator


def get_objective(name: str) -> ObjectiveFn:
    """The objective registered under ``name``."""
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise KeyError(
            f"unknown objective {name!r}; available: {', '.join(sorted(OBJECTIVES))}"
        ) from None


from fedunlearn.objectives import basic  # noqa: E402,F401  (registers ga, nll)
