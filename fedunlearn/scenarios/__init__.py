"""Scenarios: a benchmark plus who holds what (see :mod:`fedunlearn.scenarios.base`).

``get_scenario(name)(ScenarioParams(...))`` builds one; ``SCENARIOS`` lists them.
"""

from fedunlearn.scenarios.base import (
    SCENARIOS,
    ClientAssignment,
    Scenario,
    ScenarioParams,
    fold_mixed,
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
    "fold_mixed",
    "get_scenario",
    "register_scenario",
    "tofu_assignments",
]

from fedunlearn.scenarios import muse as muse  # noqa: E402  (registers "muse")
from fedunlearn.scenarios import wmdp as wmdp  # noqa: E402  (registers "wmdp")
