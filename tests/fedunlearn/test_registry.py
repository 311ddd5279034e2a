"""The one registry type behind merges, objectives, scenarios and benchmarks."""

import pytest

from fedunlearn.benchmarks import BENCHMARKS
from fedunlearn.merging import MERGES
from fedunlearn.objectives import OBJECTIVES
from fedunlearn.registry import Registry
from fedunlearn.scenarios.base import SCENARIOS


def test_registry_adds_once_and_names_what_is_available() -> None:
    things: Registry[int] = Registry("thing")

    @things.register("b")
    def b() -> int:
        return 2

    assert things.add("a", 1) == 1 and things["b"] is b and b() == 2
    with pytest.raises(ValueError, match=r"a thing named 'a' is already registered"):
        things.add("a", 3)
    with pytest.raises(ValueError, match="non-empty string"):
        things.register("")
    with pytest.raises(KeyError, match=r"unknown thing 'c'; available: 'a', 'b'"):
        things["c"]
    assert "c" not in things and sorted(things) == ["a", "b"]
    with pytest.raises(KeyError, match="available: <none>"):
        Registry("empty")["x"]


def test_every_pluggable_kind_uses_it() -> None:
    for registry, kind, known in (
        (MERGES, "merge", "firm"),
        (OBJECTIVES, "objective", "ga"),
        (SCENARIOS, "scenario", "tofu"),
        (BENCHMARKS, "benchmark", "tofu"),
    ):
        assert isinstance(registry, Registry) and registry.kind == kind and known in registry
