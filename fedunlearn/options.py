"""Typed option groups: the run configuration, one frozen dataclass per component.

Each component (a merge, MPU, DP2Unlearning, LoRA, the scenario, ...) defines its options next
to its code as a frozen dataclass whose fields are declared with :func:`option` — the default,
a rule the value must satisfy and one line of help — and registers it under its group name
with :func:`option_group`.  The run configuration holds one table per group
(``[tool.flwr.app.config.firm]``), which Flower flattens to dotted keys (``firm.alpha``);
:func:`check_options` checks a group's values against their rules, and the configuration
reference in the docs is generated from the same fields (``simulations.config_reference``).

Field names are the keys with ``_`` for ``-`` (``permute_groups`` ↔ ``permute-groups``).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Collection
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, TypeVar

from fedunlearn.registry import Registry

T = TypeVar("T")

#: Option groups by name (``"firm"`` → :class:`~fedunlearn.merging.firm.FirmOptions`, ...).
OPTION_GROUPS: Registry[type] = Registry("option group")


class OptionError(ValueError):
    """A run-config value the run cannot use; the message names the key, the value and what
    is allowed."""


def key_name(name: str) -> str:
    """The run-config spelling of a field name (``num_rounds`` → ``num-rounds``)."""
    return name.replace("_", "-")


def close_matches(value: str, names: Collection[str]) -> str:
    """``"; did you mean 'a' or 'b'?"`` for the names close to ``value`` (difflib), or ``""``."""
    close = difflib.get_close_matches(value, list(names), n=3)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


@dataclass(frozen=True)
class OneOf:
    """A name from ``options()`` (a registry, read when the check runs)."""

    options: Callable[[], Collection[str]]

    def problem(self, value: Any, kind: type) -> str | None:
        names = sorted(self.options())
        if value in names:
            return None
        return f"must be one of {', '.join(names)}{close_matches(str(value), names)}"

    def describe(self, kind: type) -> str:
        return "one of " + ", ".join(f"`{n}`" for n in sorted(self.options()))


@dataclass(frozen=True)
class Number:
    """A number in ``[low, high]`` (an end excluded when ``*_open``), finite unless ``inf_ok``;
    ``special`` names values accepted outside the range, as ``(value, meaning)`` pairs;
    ``unset`` is the value that stands for "the default of the scenario and model", replaced by
    that value before the check (so it is described, but not accepted): a key set to any other
    value, even the one the default would give, keeps it."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    inf_ok: bool = False
    special: tuple[tuple[float, str], ...] = ()
    unset: float | None = None

    def problem(self, value: Any, kind: type) -> str | None:
        return None if self.accepts(value) else f"must be {self.describe(kind)}"

    def accepts(self, value: float) -> bool:
        if any(value == v for v, _ in self.special):
            return True
        if math.isnan(value) or (math.isinf(value) and not self.inf_ok):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def describe(self, kind: type) -> str:
        """E.g. ``"a finite number in (0, 1]"``, ``"an integer >= 0, or -1 (scenario default)"``."""
        what = "an integer" if kind is int else "a number" if self.inf_ok else "a finite number"
        low, high = f"{self.low:g}", f"{self.high:g}"
        if math.isfinite(self.low) and math.isfinite(self.high):
            span = (
                f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
            )
        elif math.isfinite(self.low):
            span = f"{'>' if self.low_open else '>='} {low}"
        elif math.isfinite(self.high):
            span = f"{'<' if self.high_open else '<='} {high}"
        else:
            span = ""
        text = f"{what} {span}".strip() + (" (inf allowed)" if self.inf_ok else "")
        extra = "".join(f", or {v:g} ({meaning})" for v, meaning in self.special)
        if self.unset is not None:
            extra += f"; {self.unset:g} = the default of the scenario and model"
        return text + extra


@dataclass(frozen=True)
class Parsed:
    """A value ``check`` accepts; it raises ``ValueError`` saying what is wrong otherwise."""

    check: Callable[[Any], object]
    description: str = "see the help"

    def problem(self, value: Any, kind: type) -> str | None:
        try:
            self.check(value)
        except ValueError as err:
            return str(err)
        return None

    def describe(self, kind: type) -> str:
        return self.description


Rule = OneOf | Number | Parsed

POSITIVE_INT = Number(low=1)
COUNT = Number(low=0)
POSITIVE = Number(low=0, low_open=True)
NON_NEGATIVE = Number(low=0)
FRACTION = Number(low=0, high=1, low_open=True)
ANY_FINITE = Number()
SCENARIO_DEFAULT = ((-1.0, "the scenario's default"),)
OFF_OR_AT_LEAST_ONE = Number(low=1, special=((0.0, "off"),))
#: ``0`` stands for the scenario's default (filled in before the check)
POSITIVE_INT_OR_SCENARIO = Number(low=1, unset=0)
POSITIVE_OR_SCENARIO = Number(low=0, low_open=True, unset=0)
#: ``-1`` stands for the default (0 is a value of its own)
COUNT_OR_SCENARIO = Number(low=0, unset=-1)


def option(default: T, help: str, rule: Rule | None = None) -> T:
    """A dataclass field with its ``default``, one line of ``help`` and the ``rule`` its value
    must satisfy (a float without a rule must be finite; a string or bool without one is
    free)."""
    return field(default=default, metadata={"help": help, "rule": rule})


def option_group(name: str) -> Callable[[type[T]], type[T]]:
    """Class decorator: register an options dataclass as the run-config group ``name``."""

    def register(cls: type[T]) -> type[T]:
        OPTION_GROUPS.add(name, cls)
        return cls

    return register


def rule_of(f: Field) -> Rule | None:
    """The field's rule (a float without one: any finite number)."""
    rule = f.metadata.get("rule")
    if rule is None and type(f.default) is float:
        return ANY_FINITE
    return rule


def describe(f: Field) -> str:
    """What a field accepts, in words (for the configuration reference)."""
    kind = type(f.default)
    rule = rule_of(f)
    if rule is not None:
        return rule.describe(kind)
    return {bool: "true or false", str: "a string"}.get(kind, kind.__name__)


def check_value(key: str, value: Any, f: Field) -> None:
    """Raise :class:`OptionError` unless ``value`` satisfies the rule of field ``f``."""
    rule = rule_of(f)
    problem = rule.problem(value, type(f.default)) if rule is not None else None
    if problem:
        raise OptionError(f"run-config key {key!r} = {value!r}: {problem}")


def check_options(prefix: str, options: object) -> None:
    """Check every field of the options dataclass ``options``; keys are ``prefix`` + name."""
    for f in fields(options):  # type: ignore[arg-type]
        check_value(prefix + key_name(f.name), getattr(options, f.name), f)


def typed_value(key: str, raw: Any, kind: type) -> Any:
    """``raw`` as a ``kind`` value: ints widen to float, "inf" is infinity for a float key."""
    if kind is float and isinstance(raw, str) and raw.strip().lower() in ("inf", "infinity"):
        return math.inf
    if kind is float and isinstance(raw, int | float) and not isinstance(raw, bool):
        return float(raw)
    if isinstance(raw, kind) and not (kind is int and isinstance(raw, bool)):
        return raw
    raise OptionError(f"run-config key {key!r} must be {kind.__name__}, got {raw!r}")


def field_default(f: Field) -> Any:
    """The default of an :func:`option` field."""
    if f.default is MISSING:
        raise TypeError(f"option {f.name!r} has no default")
    return f.default
