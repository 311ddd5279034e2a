"""Registry of benchmark data builders, looked up by name.

A benchmark builder is any callable that returns the data for one benchmark (for example
:func:`fedunlearn.benchmarks.tofu.generate_tofu`). Builders register themselves with
:func:`register_benchmark`; experiment code finds them with :func:`get_benchmark`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from fedunlearn.registry import Registry

F = TypeVar("F", bound=Callable[..., Any])

BENCHMARKS: Registry[Callable[..., Any]] = Registry("benchmark")


def register_benchmark(name: str) -> Callable[[F], F]:
    """Decorator that records a builder under ``name``; the builder is returned unchanged.

    Raises ``ValueError`` if ``name`` is empty or already taken.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a benchmark name must be a non-empty string, got {name!r}")

    def decorator(fn: F) -> F:
        BENCHMARKS.add(name, fn)
        return fn

    return decorator


def get_benchmark(name: str) -> Callable[..., Any]:
    """Builder registered under ``name``; ``KeyError`` naming the known benchmarks otherwise."""
    return BENCHMARKS[name]


# Imported last so the builders can use ``register_benchmark`` defined above.
from fedunlearn.benchmarks import muse as muse  # noqa: E402
from fedunlearn.benchmarks import tofu as tofu  # noqa: E402
from fedunlearn.benchmarks import wmdp as wmdp  # noqa: E402

__all__ = ["BENCHMARKS", "get_benchmark", "register_benchmark"]
