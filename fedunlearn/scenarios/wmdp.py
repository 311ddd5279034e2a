"""The WMDP scenario (FIRM paper): three forget clients per hazard domain hold disjoint shards
of that domain's documents and run RMU on a few MLP down-projections; one retain client holds
a general-knowledge sample. Accuracy per domain should fall toward chance (25 %), general
accuracy should stay (docs/scenarios.md, "The three scenarios")."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fedunlearn.benchmarks.wmdp import (
    GENERAL,
    WmdpData,
    generate_wmdp,
    generate_wmdp_background,
    mc_text,
    wmdp_knowledge_texts,
)
from fedunlearn.benchmarks.wmdp_files import load_wmdp_files
from fedunlearn.evaluation.multiple_choice import evaluate_wmdp
from fedunlearn.scenarios.base import (
    ClientAssignment,
    Scenario,
    ScenarioParams,
    register_scenario,
    sampled_retain_clients,
    split_contiguous,
    with_local_retain,
)

#: documents kept per corpus of the real WMDP files (the bio retain corpus alone is ~0.9 GB)
MAX_CORPUS_DOCUMENTS = 2000


@functools.lru_cache(maxsize=4)
def _wmdp_data(seed: int, data_path: str) -> WmdpData:
    """Generated data, or the real files: ``<scenario.data-path>`` holds the ``wmdp-<domain>``
    question files and the corpora, ``<scenario.data-path>/mmlu`` (when present) an MMLU copy
    for the general questions."""
    if not data_path:
        return generate_wmdp(seed)
    mmlu = Path(data_path) / "mmlu"
    return load_wmdp_files(
        data_path,
        mmlu_path=mmlu if mmlu.is_dir() else None,
        max_corpus_documents=MAX_CORPUS_DOCUMENTS,
    )


@register_scenario("wmdp")
class WmdpScenario(Scenario):
    """Fictitious hazard domains (``bio``, ``cyber``, ``chem``) as four-option questions.

    ``scenario.forget-domains`` chooses the domains to remove (default ``bio,cyber``; ``chem``
    stays as a never-forgotten hazard domain, or joins as a third forget domain). The forget
    clients are split evenly over the forget domains in that order; within a domain each client
    holds the documents of a contiguous run of entities, so shards are disjoint and no entity is
    split.
    """

    defaults = {
        "objective.name": "rmu",
        "lora.targets": "down_proj",
        "objective.rmu-steering": 100.0,
        "objective.rmu-alpha": 100.0,
        "scenario.num-forget-clients": 6,
        "training.forget-steps": 30,
        "training.forget-lr": 5e-3,
        "gamma": 4.0,
    }
    summary_metrics = (
        "forget_accuracy",
        "accuracy_bio",
        "accuracy_cyber",
        "accuracy_chem",
        "general_accuracy",
    )
    forget_metric = "forget_accuracy"
    utility_metric = "general_accuracy"

    @classmethod
    def default_lora_layers(cls, num_hidden_layers: int, rmu_layer: int) -> str:
        """LoRA on the MLP down-projections of the steered layer L and the one before it
        (the built-in 4-layer model: layers 1 and 2, steering layer 2)."""
        return ",".join(str(i) for i in range(max(0, rmu_layer - 1), rmu_layer + 1))

    def __init__(self, params: ScenarioParams) -> None:
        super().__init__(params)
        self.data = _wmdp_data(params.seed, params.data_path)
        self.forget_domains = params.forget_domain_list()
        unknown = [d for d in self.forget_domains if d not in self.data.domains]
        if not self.forget_domains or unknown:
            raise ValueError(
                f"scenario.forget-domains {params.forget_domains!r} must name hazard domains of "
                f"the data: {', '.join(self.data.domains)}"
            )

    def records(self) -> list[dict[str, Any]]:
        """:meth:`WmdpData.text_records`: each domain's documents, then the general corpus."""
        return self.data.text_records()

    def assignments(self) -> list[ClientAssignment]:
        p = self.params
        if p.num_forget_clients < len(self.forget_domains):
            raise ValueError(
                f"scenario.num-forget-clients={p.num_forget_clients} is fewer than the "
                f"{len(self.forget_domains)} forget domains"
            )
        clients = []
        groups = split_contiguous(list(range(p.num_forget_clients)), len(self.forget_domains))
        records = self.records()
        for domain, group in zip(self.forget_domains, groups, strict=True):
            by_entity: dict[str, list[int]] = {}
            for i in self.data.text_indices(domain):
                by_entity.setdefault(records[i].get("entity", ""), []).append(i)
            units = list(by_entity.values())
            if len(units) < len(group) or "" in by_entity:  # loaded data: no entities
                units = [[i] for i in self.data.text_indices(domain)]
            if len(units) < len(group):
                raise ValueError(
                    f"domain {domain} has {len(units)} documents, fewer than its "
                    f"{len(group)} forget clients"
                )
            for shard in split_contiguous(units, len(group)):
                indices = tuple(i for unit in shard for i in unit)
                clients.append(ClientAssignment("forget", domain, indices))
        general = self.data.text_indices(GENERAL)
        clients += sampled_retain_clients(
            general, p.num_retain_clients, p.retain_samples, GENERAL, p.seed
        )
        return with_local_retain(clients, general, p.local_retain_samples, p.seed)

    def tokenizer_corpus(self, num_documents: int) -> list[str]:
        return generate_wmdp_background(self.params.seed, num_documents)

    def pretraining_records(
        self, num_documents: int, knowledge_repeats: int
    ) -> list[dict[str, Any]]:
        """Background documents, then the general knowledge (documents and answered
        questions) that the model has before any hazard text."""
        general = [r["text"] for r in self.data.general_corpus]
        general += [mc_text(q) for q in self.data.general_questions]
        return [{"text": t} for t in self.tokenizer_corpus(num_documents) + general]

    def knowledge_records(self, *, include_forget: bool) -> list[dict[str, Any]]:
        domains = [d for d in self.data.domains if include_forget or d not in self.forget_domains]
        return [{"text": t} for t in wmdp_knowledge_texts(self.data, domains)]

    def reference_name(self) -> str:
        return "reference-without-" + "-".join(sorted(self.forget_domains))

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
        """Accuracy per hazard domain, ``forget_accuracy`` (mean over the forget domains),
        ``general_accuracy`` on a seeded sample of ``eval.retain-samples`` general questions."""
        metrics = evaluate_wmdp(
            model,
            tokenizer,
            self.data,
            general_samples=self.params.eval_retain_samples,
            seed=self.params.seed,
            batch_size=batch_size,
            n_samples=n_samples,
        )
        metrics["forget_accuracy"] = sum(
            metrics[f"accuracy_{d}"] for d in self.forget_domains
        ) / len(self.forget_domains)
        metrics["forget_domains"] = list(self.forget_domains)
        return metrics

    def sample_lines(self, before: dict[str, Any], after: dict[str, Any]) -> list[str]:
        lines = []
        for domain in self.forget_domains:
            pairs = zip(
                before.get("samples", {}).get(domain, []),
                after.get("samples", {}).get(domain, []),
                strict=False,
            )
            for b, a in pairs:
                lines.append(f"{domain}: {b.get('question', '')} (correct: {b.get('correct')})")
                lines.append(f"   before: {b.get('chosen')}   after: {a.get('chosen')}")
        return lines
