"""The ``scenario`` option group: which benchmark, its size and who holds what."""

from __future__ import annotations

from dataclasses import dataclass

from fedunlearn.options import (
    COUNT,
    COUNT_OR_SCENARIO,
    POSITIVE_INT,
    POSITIVE_INT_OR_SCENARIO,
    Number,
    OneOf,
    option,
    option_group,
)


def _scenario_names() -> list[str]:
    from fedunlearn.scenarios import SCENARIOS

    return list(SCENARIOS)


def _retain_layouts() -> tuple[str, ...]:
    from fedunlearn.scenarios import RETAIN_LAYOUTS

    return RETAIN_LAYOUTS


_AUTO = ((0.0, "auto"),)


@option_group("scenario")
@dataclass(frozen=True)
class ScenarioOptions:
    """The benchmark and its federated layout (``[tool.flwr.app.config.scenario]``)."""

    name: str = option("tofu", "the benchmark: tofu, wmdp or muse", OneOf(_scenario_names))
    num_authors: int = option(200, "tofu: authors of the generated benchmark", POSITIVE_INT)
    qa_per_author: int = option(10, "tofu: QA pairs per generated author", POSITIVE_INT)
    forget_percent: float = option(
        1.0,
        "tofu: forget split, % of the authors taken from the end (1 / 5 / 10 as in TOFU)",
        Number(low=0, high=100, low_open=True, high_open=True),
    )
    forget_domains: str = option("bio,cyber", "wmdp: hazard domains to forget (bio, cyber, chem)")
    num_forget_clients: int = option(
        0,
        "forget clients, on disjoint shards of the forget data (scenario: 5 / 6 / 3)",
        POSITIVE_INT_OR_SCENARIO,
    )
    num_retain_clients: int = option(1, "retain clients", COUNT)
    retain_samples: int = option(
        -1,
        "retain records each retain client holds; default 200, a registry model 40",
        COUNT_OR_SCENARIO,
    )
    local_retain_samples: int = option(
        32, "retain records each forget client also holds, for objectives that use them", COUNT
    )
    mixed_clients: int = option(
        0,
        "forget clients that also keep data and upload a retain task vector from the same "
        "node (each takes over one retain client's records; with requests.schedule: clients "
        "0..n-1 when they are asked to forget)",
        COUNT,
    )
    num_forget_domains: int = option(
        1, "tofu: forget authors split into this many domains (tofu-forget-<d>)", POSITIVE_INT
    )
    retain_layout: str = option(
        "random",
        "tofu: random disjoint retain samples, or heterogeneous (authors A / real-world "
        "knowledge / authors B)",
        OneOf(_retain_layouts),
    )
    data_path: str = option(
        "",
        "folder of the published benchmark files (needs model.name or model.path); "
        '"" = generated data',
    )
    tofu_subset_authors: int = option(
        0,
        "tofu with data-path and a real model: authors in play (the forget authors plus the "
        "first others); 0 = auto (CPU 4, CUDA 200 = all)",
        Number(low=2, special=_AUTO),
    )
    muse_subset_texts: int = option(
        0,
        "muse with data-path and a real model: items taken from each published 100-item "
        "list; 0 = auto (CPU 16, CUDA 100 = all)",
        Number(low=2, special=_AUTO),
    )

    def forget_domain_list(self) -> list[str]:
        """``forget_domains`` as a list of names."""
        return [d.strip() for d in self.forget_domains.split(",") if d.strip()]
