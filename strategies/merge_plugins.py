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
    """The merge function ``name`` refers to, importing a plug-in now; a ``ValueError`` naming
    ``name`` and the cause (the plug-in's import error, the merges there are) otherwise."""
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except Exception as err:  # a plug-in may fail on import with anything: name it
            raise ValueError(
                f"merge {name!r}: cannot import module {module_name!r}: {type(err).__name__}: {err}"
            ) from err
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise ValueError(f"merge {name!r}: {module_name} has no callable {attr!r}")
        return fn
    if name in MERGES:
        return MERGES[name]
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        if entry.name == name:
            try:
                return entry.load()
            except Exception as err:  # as above: the installed plug-in is broken
                raise ValueError(
                    f"merge {name!r}: entry point {entry.value!r} does not load: "
                    f"{type(err).__name__}: {err}"
                ) from err
    plugins = sorted(e.name for e in entry_points(group=ENTRY_POINT_GROUP))
    raise ValueError(
        f"unknown merge {name!r}: built-in merges are {', '.join(sorted(MERGES))}"
        + (f"; plug-ins: {', '.join(plugins)}" if plugins else "")
        + "; or give 'package.module:function'"
    )


def check_merge_call(fn: MergeFn, parameters: Mapping[str, Any]) -> None:
    """``ValueError`` unless ``fn(updates, **merge_kwargs(fn, parameters))`` binds: one
    positional argument and every required keyword among ``parameters``."""
    try:
        inspect.signature(fn).bind(None, **merge_kwargs(fn, parameters))
    except TypeError as err:
        raise ValueError(
            f"cannot be called as merge(updates, <run-config parameters "
            f"{', '.join(sorted(parameters))}>): {err}"
        ) from None


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


def streams_delta(fn: MergeFn) -> bool:
    """Whether ``fn`` names a ``delta_out`` keyword: it then writes each weight's merged
    update into the mapping given there as soon as the weight is done (the server applies it
    and lets go of it: ``strategies.new_weights``) instead of returning Δ whole."""
    parameter = inspect.signature(fn).parameters.get("delta_out")
    return parameter is not None and parameter.kind in (
        inspect.Parameter.KEYWORD_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    )
