"""Resolving the run config's ``strategy`` to a merge function, built-in or plug-in.

``strategy`` may be
* a name registered in ``fedunlearn.merging.MERGES`` (``firm``, ``fulm``, ``ties`` ...);
* ``package.module:function`` — any importable merge function, e.g. one of your own;
* a name published by an installed package in the ``fedunlearn.merges`` entry-point group.

A merge function takes ``updates: Sequence[ClientUpdate]`` and keyword-only parameters and
returns a ``MergeResult``. It receives only the run-config parameters its signature names
(see :func:`merge_kwargs`).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import Any

from fedunlearn.merging import MERGES, MergeResult

ENTRY_POINT_GROUP = "fedunlearn.merges"

MergeFn = Callable[..., MergeResult]


def resolve_merge(name: str) -> MergeFn:
    """The merge function ``name`` refers to; a clear error when there is none."""
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ValueError(
                f"strategy {name!r}: cannot import module {module_name!r}: {err}"
            ) from err
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise ValueError(f"strategy {name!r}: {module_name} has no callable {attr!r}")
        return fn
    if name in MERGES:
        return MERGES[name]
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        if entry.name == name:
            return entry.load()
    plugins = sorted(e.name for e in entry_points(group=ENTRY_POINT_GROUP))
    raise ValueError(
        f"unknown strategy {name!r}: built-in merges are {', '.join(sorted(MERGES))}"
        + (f"; plug-ins: {', '.join(plugins)}" if plugins else "")
        + "; or give 'package.module:function'"
    )


def merge_kwargs(fn: MergeFn, parameters: Mapping[str, Any]) -> dict[str, Any]:
    """The subset of ``parameters`` that ``fn`` accepts as keyword arguments."""
    signature = inspect.signature(fn)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        return dict(parameters)
    accepted = {
        n
        for n, p in signature.parameters.items()
        if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    }
    return {k: v for k, v in parameters.items() if k in accepted}
