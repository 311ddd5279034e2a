"""One registry type for every kind of pluggable thing (merges, objectives, scenarios,
benchmarks): a name → item mapping that refuses a second item under a taken name and whose
lookup of an unknown name says what is available."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Registry(dict[str, T]):
    """Items of one ``kind`` by name. ``registry[name]`` raises a ``KeyError`` naming the
    kind, the name and every registered name; :meth:`register` is the decorator form of
    :meth:`add`."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def add(self, name: str, item: T) -> T:
        """Register ``item`` under ``name`` (a non-empty string, not taken yet)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} name must be a non-empty string, got {name!r}")
        if name in self:
            taken = self[name]
            where = f"{getattr(taken, '__module__', '?')}.{getattr(taken, '__qualname__', taken)}"
            raise ValueError(f"a {self.kind} named {name!r} is already registered ({where})")
        self[name] = item
        return item

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@registry.register("name")`` adds the decorated item, unchanged."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} name must be a non-empty string, got {name!r}")
        return lambda item: self.add(name, item)

    def __missing__(self, name: str) -> T:
        available = ", ".join(repr(n) for n in sorted(self)) or "<none>"
        raise KeyError(f"unknown {self.kind} {name!r}; available: {available}")
