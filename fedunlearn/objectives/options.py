"""The ``objective`` option group: the forget objective and each objective's options."""

from __future__ import annotations

from dataclasses import dataclass

from fedunlearn.options import (
    ANY_FINITE,
    NON_NEGATIVE,
    POSITIVE,
    SCENARIO_DEFAULT,
    Number,
    OneOf,
    option,
    option_group,
)


def _objective_names() -> list[str]:
    from fedunlearn.objectives import OBJECTIVES

    return list(OBJECTIVES)


_OR_SCENARIO = Number(low=0, special=SCENARIO_DEFAULT)


@option_group("objective")
@dataclass(frozen=True)
class ObjectiveOptions:
    """The forget clients' objective (``[tool.flwr.app.config.objective]``); each objective
    reads its own options."""

    name: str = option(
        "auto",
        "forget objective; auto = the scenario's (ga / rmu / ga; muse on a registry model npo)",
        OneOf(_objective_names),
    )
    graddiff_alpha: float = option(1.0, "GradDiff: weight of the retain NLL", NON_NEGATIVE)
    npo_beta: float = option(0.1, "NPO: β", POSITIVE)
    simnpo_beta: float = option(4.5, "SimNPO: β", POSITIVE)
    simnpo_delta: float = option(0.0, "SimNPO: margin δ", ANY_FINITE)
    dpo_beta: float = option(0.1, "DPO (refusal preference): β", POSITIVE)
    undial_beta: float = option(10.0, "UNDIAL: logit-adjustment strength β", NON_NEGATIVE)
    satimp_beta1: float = option(5.0, "SatImp: β₁", NON_NEGATIVE)
    satimp_beta2: float = option(1.0, "SatImp: β₂", NON_NEGATIVE)
    kl_alpha: float = option(1.0, "KL retain term weight", NON_NEGATIVE)
    rmu_layer: int = option(-1, "RMU: steered layer; -1 = the middle layer", _OR_SCENARIO)
    rmu_steering: float = option(
        -1.0, "RMU: steering coefficient c; -1 = the scenario's", _OR_SCENARIO
    )
    rmu_alpha: float = option(-1.0, "RMU: retain weight α; -1 = the scenario's", _OR_SCENARIO)

    def client_options(self, seed: int) -> dict[str, float]:
        """The objective options as floats for the client; those left on "scenario default"
        without a scenario value are left out (the objective's own default applies)."""
        names = (
            "graddiff_alpha npo_beta simnpo_beta simnpo_delta dpo_beta undial_beta "
            "satimp_beta1 satimp_beta2 kl_alpha rmu_layer rmu_steering rmu_alpha"
        ).split()
        options = {name: float(getattr(self, name)) for name in names}
        for name in ("rmu_layer", "rmu_steering", "rmu_alpha"):
            if options[name] == -1.0:
                del options[name]
        options["rmu_seed"] = float(seed)
        return options
