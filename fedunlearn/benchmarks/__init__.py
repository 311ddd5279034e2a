"""Registry of benchmark data builders, looked up by name.

A benchmark builder is any callable that returns the data for one benchmark (for example
:func:`fedunlearn.benchmarks.tofu.generate_tofu`). Builders register themselves with
:func:`register_benchmark`; experiment code finds them with :func:`get_benchmark`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

BENCHMARKS: dict[str, Callable[..., Any]] = {}


def register_benchmark(name: str) -> Callable[[F], F]:
    """Decorator that records a builder under ``name``; the builder is returned unchanged.

    Raises ``ValueError`` if ``name`` is empty or already taken.
    """
    if not name:
        raise ValueError("benchmark name must be a non-empty string")

    def decorator(fn: F) -> F:
        if name in BENCHMARKS:
            raise ValueError(f"benchmark {name!r} is already registered")
        BENCHMARKS[name] = fn
        return fn

    return decorator


def get_benchmark(name: str) -> Callable[..., Any]:
    """Builder registered under ``name``; ``KeyError`` naming the known benchmarks otherwise."""
    try:
        return BENCHMARKS[name]
    except KeyError:
        available = ", ".join(sorted(BENCHMARKS)) or "<none>"
        raise KeyError(f"unknown benchmark {name!r}; available: {available}") from None


# Imported last so the builders can use ``register_benchmark`` defined above.
from fedunlearn.benchmarks import muse as muse  # noqa: E402
from fedunlearn.benchmarks import tofu as tofu  # noqa: E402
from fedunlearn.benchmarks import wmdp as wmdp  # noqa: E402

__all__ = ["BENCHMARKS", "get_benchmark", "register_benchmark"]
