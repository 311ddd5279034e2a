"""The ``eval`` option group: how the models are evaluated."""

from __future__ import annotations

from dataclasses import dataclass

from fedunlearn.options import COUNT, POSITIVE_INT, Number, option, option_group


@option_group("eval")
@dataclass(frozen=True)
class EvalOptions:
    """Evaluation sizes (``[tool.flwr.app.config.eval]``)."""

    retain_samples: int = option(
        200,
        "retain questions evaluated (wmdp: general questions; tofu on the published files: "
        "also caps real authors and world facts)",
        COUNT,
    )
    max_new_tokens: int = option(32, "generation length of the greedy answers", POSITIVE_INT)
    batch_size: int = option(64, "evaluation batch size", POSITIVE_INT)
    mmlu_path: str = option(
        "", 'MMLU CSV folder for a real model\'s general utility; "" = mmlu beside data-path'
    )
    mmlu_subjects: int = option(10, "MMLU subjects of the seeded subset", Number(low=1, high=57))
    mmlu_per_subject: int = option(5, "MMLU questions per subject; 0 = no MMLU", COUNT)
