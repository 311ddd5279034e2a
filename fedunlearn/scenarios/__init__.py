"""Scenarios: a benchmark plus who holds what (see :mod:`fedunlearn.scenarios.base`).

``get_scenario(name)(ScenarioParams(...))`` builds one; ``SCENARIOS`` lists them.
"""

from fedunlearn.scenarios.base import (
    SCENARIOS,
    ClientAssignment,
    Scenario,
    ScenarioParams,
    get_scenario,
    register_scenario,
)
from fedunlearn.scenarios.tofu import (
    RETAIN_LAYOUTS,
    TOFU_FORGET_DOMAIN,
    TofuScenario,
    all_records,
    tofu_assignments,
)

__all__ = [
    "RETAIN_LAYOUTS",
    "SCENARIOS",
    "TOFU_FORGET_DOMAIN",
    "ClientAssignment",
    "Scenario",
    "ScenarioParams",
    "TofuScenario",
    "all_records",
    "get_scenario",
    "register_scenario",
    "tofu_assignments",
]
