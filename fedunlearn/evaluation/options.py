"""The ``eval`` option group: how the models are evaluated."""

from __future__ import annotations

from dataclasses import dataclass

from fedunlearn.options import (
    COUNT,
    COUNT_OR_SCENARIO,
    POSITIVE_INT_OR_SCENARIO,
    Number,
    option,
    option_group,
)


@option_group("eval")
@dataclass(frozen=True)
class EvalOptions:
    """Evaluation sizes (``[tool.flwr.app.config.eval]``)."""

    retain_samples: int = option(
        -1,
        "retain questions evaluated (wmdp: general questions; tofu on the published files: "
        "also caps real authors and world facts); default 200, a registry model 20",
        COUNT_OR_SCENARIO,
    )
    max_new_tokens: int = option(
        0,
        "generation length of the greedy answers; default 32, a registry model 64",
        POSITIVE_INT_OR_SCENARIO,
    )
    batch_size: int = option(
        0, "evaluation batch size; default 64, a registry model 16", POSITIVE_INT_OR_SCENARIO
    )
    mmlu_path: str = option(
        "", 'MMLU CSV folder for a real model\'s general utility; "" = mmlu beside data-path'
    )
    mmlu_subjects: int = option(10, "MMLU subjects of the seeded subset", Number(low=1, high=57))
    mmlu_per_subject: int = option(5, "MMLU questions per subject; 0 = no MMLU", COUNT)
