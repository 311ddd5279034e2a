"""What every unlearning scenario provides, and the scenario registry.

A scenario ties a benchmark to a federated setup. It says

* what data exists (built from :class:`ScenarioParams`: seed, local files, sizes) and the one
  index space of training records that client shards point into (:meth:`Scenario.records`);
* who holds what (:meth:`Scenario.assignments`: role, domain, shard per client);
* how the built-in model substrate learns it (:meth:`Scenario.tokenizer_corpus`,
  :meth:`Scenario.pretraining_records`, :meth:`Scenario.knowledge_records`);
* how a model is scored (:meth:`Scenario.evaluate`) and which metrics a person looks at first.

Adding a scenario is one new module with a ``@register_scenario`` class, imported in
``fedunlearn/scenarios/__init__.py``.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, TypeVar

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fedunlearn.registry import Registry


@dataclass(frozen=True)
class ClientAssignment:
    """One client's part in an unlearning request.

    ``indices`` point into :meth:`Scenario.records`; the client materialises its own records
    from its local copy of the data, so no record text travels in the assignment.
    ``retain_indices`` (forget clients only, may be empty) is a small sample of data the
    client also holds and keeps — what GradDiff, KL and RMU regularise with.
    ``kept_indices`` (forget clients only, usually empty) makes the client *mixed-role*: it
    also holds these records to keep and uploads a second task vector, trained on them as a
    retain client of domain ``kept_domain`` would, from the same node (:func:`fold_mixed`).
    """

    role: str  # "forget" | "retain"
    domain: str
    indices: tuple[int, ...]
    retain_indices: tuple[int, ...] = ()
    kept_indices: tuple[int, ...] = ()
    kept_domain: str = ""

    @property
    def mixed(self) -> bool:
        """The client forgets ``indices`` and also keeps ``kept_indices`` (two uploads)."""
        return bool(self.kept_indices)


def fold_mixed(assignments: Sequence[ClientAssignment], mixed: int) -> list[ClientAssignment]:
    """The clients with the first ``mixed`` forget clients made mixed-role: forget client j
    (j < ``mixed``) also holds the records of the j-th of the LAST ``mixed`` retain clients,
    which no longer have a node of their own. Forget clients come first, then the remaining
    retain clients, so the uploads in merge order (every node's own, then the kept parts in
    node order) are those of the unfolded clients in their order."""
    forget = [a for a in assignments if a.role == "forget"]
    retain = [a for a in assignments if a.role == "retain"]
    if mixed < 0 or mixed > min(len(forget), len(retain)):
        raise ValueError(
            f"scenario.mixed-clients={mixed}: needs as many forget clients and retain clients "
            f"to fold together, the scenario has {len(forget)} forget and {len(retain)} retain"
        )
    if mixed == 0:
        return list(assignments)
    folded = retain[len(retain) - mixed :]
    mixed_clients = [
        replace(a, kept_indices=r.indices, kept_domain=r.domain)
        for a, r in zip(forget, folded, strict=False)
    ]
    return mixed_clients + forget[mixed:] + retain[: len(retain) - mixed]


@dataclass(frozen=True)
class ScenarioParams:
    """Everything that determines a scenario's data and client layout (hashable: clients
    cache the built data per parameter set)."""

    seed: int = 0
    data_path: str = ""
    # tofu
    num_authors: int = 200
    qa_per_author: int = 10
    subset_authors: int = 0  # real TOFU files: authors in play (0 = all)
    forget_percent: float = 1.0
    num_forget_domains: int = 1
    retain_layout: str = "random"
    # wmdp
    forget_domains: str = "bio,cyber"
    # muse
    subset_texts: int = 0  # real MUSE files: items of each published list in play (0 = all)
    # clients
    num_forget_clients: int = 5
    num_retain_clients: int = 1
    retain_samples: int = 200
    local_retain_samples: int = 0
    # evaluation
    eval_retain_samples: int = 200

    def forget_domain_list(self) -> list[str]:
        return [d.strip() for d in self.forget_domains.split(",") if d.strip()]


@dataclass(frozen=True)
class LearnLayout:
    """The records of the federated learning stage: ``forget[k]``, forget client k's forget
    records; ``kept``, the knowledge every client shares in (the reference learns only these);
    ``kept_groups[i]``, the group (author) of ``kept[i]``."""

    forget: tuple[tuple[int, ...], ...]
    kept: tuple[int, ...]
    kept_groups: tuple[str, ...]


class Scenario(ABC):
    """A benchmark in a federated unlearning setup (see the module docstring)."""

    name: ClassVar[str]
    #: run-config values (dotted keys) this scenario uses where the run config leaves them on
    #: "auto" (or 0 / -1)
    defaults: ClassVar[dict[str, Any]] = {}
    #: the same for a registry model (``model.name``), over ``defaults`` and the registry
    #: models' own defaults: what this scenario needs on a pretrained model
    pretrained_defaults: ClassVar[dict[str, Any]] = {}
    #: metrics of the before/after table, in order
    summary_metrics: ClassVar[tuple[str, ...]]
    #: the metric that falls when forgetting works / the one that should stay high
    forget_metric: ClassVar[str]
    utility_metric: ClassVar[str]
    #: whether forget clients hold QA (so refusal-preference objectives such as DPO apply)
    qa_forget_data: ClassVar[bool] = False
    #: whether :meth:`learn_layout` gives the federated learning stage its records
    learns_federated: ClassVar[bool] = False
    #: the benchmark data, set by each scenario's ``__init__`` (its own type: ``TofuData``,
    #: ``WmdpData``, ``MuseData``)
    data: Any

    def learn_layout(self) -> LearnLayout | None:
        """Who holds what for the federated learning stage (``learn.source='federated'``),
        in the index space of :meth:`records`; None where this scenario's knowledge records
        are not client records (the stage then refuses the scenario)."""
        return None

    @classmethod
    def default_lora_layers(cls, num_hidden_layers: int, rmu_layer: int) -> str:
        """``lora.layers`` when left on "auto", for a model of this depth ("all" or indices)."""
        return "all"

    def __init__(self, params: ScenarioParams) -> None:
        self.params = params

    @abstractmethod
    def records(self) -> list[dict[str, Any]]:
        """The index space of client training records (QA or text records)."""

    @abstractmethod
    def assignments(self) -> list[ClientAssignment]:
        """Role, domain and shard of every client: forget clients first, then retain."""

    @abstractmethod
    def tokenizer_corpus(self, num_documents: int) -> list[str]:
        """Texts a fresh tokenizer is trained on (never the evaluation data)."""

    @abstractmethod
    def pretraining_records(
        self, num_documents: int, knowledge_repeats: int
    ) -> list[dict[str, Any]]:
        """Records of the substrate's pre-training stage: background text plus the
        never-forgotten knowledge (QA records repeated ``knowledge_repeats`` times)."""

    @abstractmethod
    def knowledge_records(self, *, include_forget: bool) -> list[dict[str, Any]]:
        """Records the knowledgeable model is fine-tuned on; without the forget part they
        make the retain-only reference (the retrain gold standard)."""

    @abstractmethod
    def reference_name(self) -> str:
        """Folder name of the retain-only reference inside the substrate cache."""

    @abstractmethod
    def evaluate(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        reference_metrics: dict[str, Any] | None = None,
        batch_size: int = 64,
        max_new_tokens: int = 32,
        n_samples: int = 3,
    ) -> dict[str, Any]:
        """Scalar metrics (plus ``samples`` for a person to read). Metrics measured against the
        retain-only reference (forget quality, PrivLeak) use ``reference_metrics``, the
        reference model's own result of this method."""

    def check_knowledge(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
    ) -> dict[str, float]:
        """A quick measure that a built substrate knows the data (stored in its build info)."""
        metrics = self.evaluate(model, tokenizer, n_samples=0)
        return {k: v for k, v in metrics.items() if k in self.summary_metrics}

    # shared helpers ------------------------------------------------------------------------

    def check_reference(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
    ) -> dict[str, float]:
        """A quick measure of what the retain-only reference knows of the forget part."""
        return {}

    def sample_lines(self, before: dict[str, Any], after: dict[str, Any]) -> list[str]:
        """Human-readable before/after lines of the forget samples (for the server log): every
        sample group whose name mentions "forget" (``forget``, ``knowmem_forget``, ...)."""
        lines = []
        for group, samples in before.get("samples", {}).items():
            if "forget" not in group:
                continue
            for b, a in zip(samples, after.get("samples", {}).get(group, []), strict=False):
                lines.append(f"{group}: {b.get('question') or b.get('prompt', '')}")
                lines.append(f"   before: {b.get('generation', b.get('chosen', ''))}")
                lines.append(f"   after:  {a.get('generation', a.get('chosen', ''))}")
        return lines


S = TypeVar("S", bound=type[Scenario])

SCENARIOS: Registry[type[Scenario]] = Registry("scenario")


def register_scenario(name: str) -> Callable[[S], S]:
    """Register a :class:`Scenario` subclass under ``name`` (once)."""

    def decorator(cls: S) -> S:
        SCENARIOS.add(name, cls)
        cls.name = name
        return cls

    return decorator


def get_scenario(name: str) -> type[Scenario]:
    """The scenario class registered under ``name``."""
    return SCENARIOS[name]


def with_local_retain(
    assignments: list[ClientAssignment], pool: Sequence[int], size: int, seed: int
) -> list[ClientAssignment]:
    """Give every forget client a seeded sample of ``size`` indices from the retain ``pool``
    (data it also holds and keeps; for GradDiff, KL, RMU). ``size`` 0 leaves them without."""
    size = min(size, len(pool))
    if size <= 0:
        return assignments
    out = []
    for c, a in enumerate(assignments):
        if a.role == "forget":
            rng = random.Random(f"local-retain-{seed}-{c}")
            a = replace(a, retain_indices=tuple(sorted(rng.sample(list(pool), size))))
        out.append(a)
    return out


def sampled_retain_clients(
    pool: Sequence[int], num_clients: int, samples: int, domain: str, seed: int
) -> list[ClientAssignment]:
    """``num_clients`` retain clients holding disjoint parts of one seeded sample of at most
    ``num_clients × samples`` indices from ``pool``."""
    rng = random.Random(seed)
    sample = rng.sample(list(pool), min(len(pool), num_clients * samples))
    parts = split_contiguous(sample, max(1, num_clients))[:num_clients]
    return [ClientAssignment("retain", domain, tuple(sorted(part))) for part in parts]


def split_contiguous(items: list, parts: int) -> list[list]:
    """``items`` cut into ``parts`` contiguous pieces whose sizes differ by at most one."""
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for p in range(parts):
        size = base + (1 if p < extra else 0)
        out.append(items[start : start + size])
        start += size
    return out
