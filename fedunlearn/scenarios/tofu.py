"""The TOFU scenario: forget clients hold the forget authors' QA, retain clients the rest."""

from __future__ import annotations

import functools
import random
from collections.abc import Collection
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fedunlearn.benchmarks.tofu import (
    TofuData,
    generate_background_corpus,
    generate_tofu,
    knowledge_texts,
)
from fedunlearn.benchmarks.tofu_files import load_tofu_files
from fedunlearn.evaluation import evaluate_tofu, exact_match, greedy_generate
from fedunlearn.evaluation.muse_metrics import membership_auc, min_k_percent_scores, privleak
from fedunlearn.evaluation.tofu_metrics import rouge_l_recall
from fedunlearn.qa_format import format_answer, format_prompt
from fedunlearn.scenarios.base import (
    ClientAssignment,
    LearnLayout,
    Scenario,
    ScenarioParams,
    register_scenario,
    split_contiguous,
    with_local_retain,
)

TOFU_FORGET_DOMAIN = "tofu-forget"
RETAIN_LAYOUTS = ("random", "heterogeneous")


def all_records(data: TofuData) -> list[dict]:
    """One index space over every record: author QA, then real authors, then world facts."""
    return data.author_qa + data.real_authors + data.world_facts


def _forget_clients(
    data: TofuData, forget_percent: float, num_clients: int, num_domains: int
) -> list[ClientAssignment]:
    authors = data.forget_authors(forget_percent)
    if num_domains < 1 or num_domains > len(authors):
        raise ValueError(
            f"num_forget_domains={num_domains} must be between 1 and the {len(authors)} "
            f"forget authors of forget-{forget_percent}%"
        )
    if num_clients < num_domains:
        raise ValueError(
            f"num_forget_clients={num_clients} is smaller than num_forget_domains={num_domains}"
        )
    index = {(r["author"], r["question"]): i for i, r in enumerate(data.author_qa)}
    out = []
    client_groups = split_contiguous(list(range(num_clients)), num_domains)
    for d, (group, clients) in enumerate(
        zip(split_contiguous(authors, num_domains), client_groups, strict=True)
    ):
        domain = TOFU_FORGET_DOMAIN if num_domains == 1 else f"{TOFU_FORGET_DOMAIN}-{d}"
        members = set(group)
        rows = [
            index[(r["author"], r["question"])] for r in data.author_qa if r["author"] in members
        ]
        if len(rows) < len(clients):
            raise ValueError(
                f"forget domain {domain} has {len(rows)} QA, fewer than its {len(clients)} "
                "clients (raise scenario.forget-percent or lower scenario.num-forget-clients)"
            )
        for shard in split_contiguous(rows, len(clients)):
            out.append(ClientAssignment("forget", domain, tuple(shard)))
    return out


def _retain_clients(
    data: TofuData,
    forget_percent: float,
    num_clients: int,
    samples: int,
    layout: str,
    seed: int,
) -> list[ClientAssignment]:
    forget = set(data.forget_authors(forget_percent))
    retain_idx = [i for i, r in enumerate(data.author_qa) if r["author"] not in forget]
    rng = random.Random(seed)
    if layout == "random":
        if num_clients * samples > len(retain_idx):
            raise ValueError(
                f"{num_clients} retain clients × {samples} samples exceed the "
                f"{len(retain_idx)} retain QA"
            )
        sample = rng.sample(retain_idx, num_clients * samples)
        return [
            ClientAssignment(
                "retain", "retain", tuple(sorted(sample[c * samples : (c + 1) * samples]))
            )
            for c in range(num_clients)
        ]
    if layout != "heterogeneous":
        raise ValueError(f"retain layout {layout!r} unknown; expected one of {RETAIN_LAYOUTS}")
    # heterogeneous: client 0 fictitious authors of the first half, client 1 the real-world
    # knowledge (real authors + world facts), client 2 authors of the second half, then repeat
    halves = split_contiguous(retain_idx, 2)
    offset = len(data.author_qa)
    world = list(range(offset, offset + len(data.real_authors) + len(data.world_facts)))
    pools = [halves[0], world, halves[1]]
    out = []
    for c in range(num_clients):
        pool = pools[c % 3]
        chosen = sorted(rng.sample(pool, min(samples, len(pool))))
        out.append(
            ClientAssignment(
                "retain", f"retain-{('authors-a', 'world', 'authors-b')[c % 3]}", tuple(chosen)
            )
        )
    return out


def tofu_assignments(
    data: TofuData,
    *,
    forget_percent: float = 1.0,
    num_forget_clients: int = 5,
    num_retain_clients: int = 1,
    retain_samples: int = 200,
    num_forget_domains: int = 1,
    retain_layout: str = "random",
    local_retain_samples: int = 0,
    seed: int = 0,
) -> list[ClientAssignment]:
    """The FIRM paper's TOFU setup and its generalisations.

    Forget: the forget authors are split into ``num_forget_domains`` contiguous author groups
    (domains ``tofu-forget`` or ``tofu-forget-<d>``); each domain's QA are split into disjoint
    contiguous shards over its clients. Retain (``retain_layout``): ``random`` — each client a
    disjoint random sample of ``retain_samples`` retain QA; ``heterogeneous`` — clients cycle
    through fictitious authors (first half), real-world knowledge (real authors + world
    facts) and fictitious authors (second half), ``retain_samples`` records each at most.
    """
    if num_forget_clients < 1:
        raise ValueError(f"num_forget_clients must be >= 1, got {num_forget_clients}")
    if num_retain_clients < 0:
        raise ValueError(f"num_retain_clients must be >= 0, got {num_retain_clients}")
    forget = data.forget_split(forget_percent)
    if len(forget) < num_forget_clients:
        raise ValueError(
            f"forget-{forget_percent}% has {len(forget)} QA, fewer than "
            f"num_forget_clients={num_forget_clients}"
        )
    clients = _forget_clients(data, forget_percent, num_forget_clients, num_forget_domains)
    clients += _retain_clients(
        data, forget_percent, num_retain_clients, retain_samples, retain_layout, seed
    )
    forget_authors = set(data.forget_authors(forget_percent))
    pool = [i for i, r in enumerate(data.author_qa) if r["author"] not in forget_authors]
    return with_local_retain(clients, pool, local_retain_samples, seed)


@functools.lru_cache(maxsize=4)
def _tofu_data(
    seed: int,
    num_authors: int,
    qa_per_author: int,
    data_path: str,
    subset_authors: int,
    forget_percent: float,
) -> TofuData:
    if data_path:
        data = load_tofu_files(data_path)
        return data.subset(subset_authors, forget_percent) if subset_authors else data
    return generate_tofu(seed, num_authors, qa_per_author)


@register_scenario("tofu")
class TofuScenario(Scenario):
    """Fictitious authors (TOFU): forget the last ``scenario.forget-percent`` % of the authors
    with GA; the tofu metrics of docs/algorithms.md, "Evaluation metrics" (forget quality
    against the retain-only reference, model utility)."""

    learns_federated = True
    defaults = {
        "objective.name": "ga",
        "lora.targets": "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        "scenario.num-forget-clients": 5,
        "training.forget-steps": 12,
        "training.forget-lr": 1e-3,
        "gamma": 8.0,
    }
    summary_metrics = (
        "forget_rouge_l",
        "forget_exact_match",
        "forget_truth_ratio",
        "forget_quality",
        "model_utility",
        "retain_rouge_l",
        "retain_exact_match",
        "privleak",
    )
    forget_metric = "forget_rouge_l"
    utility_metric = "model_utility"
    qa_forget_data = True

    def __init__(self, params: ScenarioParams) -> None:
        super().__init__(params)
        self.data = _tofu_data(
            params.seed,
            params.num_authors,
            params.qa_per_author,
            params.data_path,
            params.subset_authors,
            params.forget_percent,
        )

    def records(self) -> list[dict[str, Any]]:
        return all_records(self.data)

    def assignments(self) -> list[ClientAssignment]:
        p = self.params
        return tofu_assignments(
            self.data,
            forget_percent=p.forget_percent,
            num_forget_clients=p.num_forget_clients,
            num_retain_clients=p.num_retain_clients,
            retain_samples=p.retain_samples,
            num_forget_domains=p.num_forget_domains,
            retain_layout=p.retain_layout,
            local_retain_samples=p.local_retain_samples,
            seed=p.seed,
        )

    def tokenizer_corpus(self, num_documents: int) -> list[str]:
        return generate_background_corpus(self.params.seed, num_documents)

    def pretraining_records(
        self, num_documents: int, knowledge_repeats: int
    ) -> list[dict[str, Any]]:
        texts = self.tokenizer_corpus(num_documents) + knowledge_texts(self.data)
        knowledge = self.data.real_authors + self.data.world_facts
        return [{"text": t} for t in texts] + list(knowledge) * knowledge_repeats

    def knowledge_records(self, *, include_forget: bool) -> list[dict[str, Any]]:
        """The author QA (without the forget authors for the reference); the generated
        benchmark adds its real-author and world-fact QA, which the built-in model must learn,
        while a pretrained model on the real files is fine-tuned on the authors alone, as in
        TOFU (those two sets measure what it knew before)."""
        authors = (
            self.data.author_qa
            if include_forget
            else self.data.retain_split(self.params.forget_percent)
        )
        if self.params.data_path:
            return list(authors)
        return list(authors) + self.data.real_authors + self.data.world_facts

    def reference_name(self) -> str:
        return f"reference-forget{self.params.forget_percent:g}"

    def learn_layout(self) -> LearnLayout:
        """Forget clients' forget QA; kept: the retain authors' QA (and, on the generated
        benchmark, the real-author and world-fact QA, as in :meth:`knowledge_records`)."""
        forget = tuple(a.indices for a in self.assignments() if a.role == "forget")
        gone = {i for part in forget for i in part}
        records = self.records()
        last = len(records) if not self.params.data_path else len(self.data.author_qa)
        kept = tuple(i for i in range(last) if i not in gone)
        groups = tuple(str(records[i].get("author", "general knowledge")) for i in kept)
        return LearnLayout(forget, kept, groups)

    def evaluation_splits(
        self, forget_indices: Collection[int] | None = None
    ) -> dict[str, list[dict]]:
        """Forget split, a seeded retain sample, and the two never-forgotten sets.

        ``forget_indices`` (indices into the author QA, e.g. a named forget request) replace
        the scenario.forget-percent split: forget = those records in dataset order, retain =
        the rest.
        """
        if forget_indices is None:
            forget = self.data.forget_split(self.params.forget_percent)
            retain = self.data.retain_split(self.params.forget_percent)
        else:
            gone = set(forget_indices)
            forget = [r for i, r in enumerate(self.data.author_qa) if i in gone]
            retain = [r for i, r in enumerate(self.data.author_qa) if i not in gone]
        rng = random.Random(self.params.seed + 7)
        size = self.params.eval_retain_samples
        sample = rng.sample(retain, min(size, len(retain)))
        real_authors, world_facts = self.data.real_authors, self.data.world_facts
        if self.params.data_path:  # the published sets (100 / 117 QA) are capped alike
            real_authors = rng.sample(real_authors, min(size, len(real_authors)))
            world_facts = rng.sample(world_facts, min(size, len(world_facts)))
        return {
            "forget": forget,
            "retain": sample,
            "real_authors": real_authors,
            "world_facts": world_facts,
        }

    def evaluate(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        reference_metrics: dict[str, Any] | None = None,
        batch_size: int = 64,
        max_new_tokens: int = 32,
        n_samples: int = 3,
        splits: dict[str, list[dict]] | None = None,
    ) -> dict[str, Any]:
        """The tofu metrics of docs/algorithms.md, "Evaluation metrics". Forget quality needs the
        reference's forget truth ratios, so it is only computed on the scenario's own forget
        split (not on custom ``splits``)."""
        reference_trs = (
            reference_metrics.get("forget_truth_ratios")
            if reference_metrics and splits is None
            else None
        )
        metrics = evaluate_tofu(
            model,
            tokenizer,
            splits or self.evaluation_splits(),
            reference_truth_ratios=reference_trs,
            batch_size=batch_size,
            max_new_tokens=max_new_tokens,
            n_samples=n_samples,
        )
        if reference_metrics is None and splits is None:
            metrics.setdefault("forget_quality", None)
        if splits is None:
            metrics.update(self.privleak_metrics(model, tokenizer, reference_metrics))
        return metrics

    def holdout_records(self) -> list[dict[str, Any]]:
        """QA of as many never-trained authors as the forget split has (at least 2): a
        second generated benchmark (another seed stream) minus any name the data holds.
        Empty with real files (``scenario.data-path``), whose published splits have no holdout."""
        if self.params.data_path:
            return []
        forget = self.data.forget_authors(self.params.forget_percent)
        known = set(self.data.author_names)
        wanted = max(2, len(forget))
        other = generate_tofu(
            self.params.seed + 1_000_003, max(2 * wanted, 4), self.params.qa_per_author
        )
        names = [n for n in other.author_names if n not in known][:wanted]
        return [r for r in other.author_qa if r["author"] in set(names)]

    def privleak_metrics(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        reference_metrics: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """Min-K% (k = 0.4) membership AUC of forget vs never-trained holdout QA (prompt +
        answer text) and PrivLeak relative to the reference's AUC (docs/algorithms.md,
        "Evaluation metrics")."""
        holdout = self.holdout_records()
        if not holdout:
            return {"privleak_auc": None, "privleak": None}

        def texts(records: list[dict[str, Any]]) -> list[str]:
            return [format_prompt(r["question"]) + format_answer(r["answer"]) for r in records]

        forget = self.data.forget_split(self.params.forget_percent)
        auc = membership_auc(
            min_k_percent_scores(model, tokenizer, texts(forget)),
            min_k_percent_scores(model, tokenizer, texts(holdout)),
        )
        reference_auc = (reference_metrics or {}).get("privleak_auc")
        return {
            "privleak_auc": auc,
            "privleak": privleak(auc, reference_auc) if reference_auc else None,
        }

    def check_knowledge(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
    ) -> dict[str, float]:
        """Generated data: exact recall of every author QA. Real files (long free-form
        answers): ROUGE-L recall of the forget and retain authors' answers, TOFU's measure."""
        if self.params.data_path:
            p = self.params.forget_percent
            return {
                "forget_rouge_l": _rouge_recall(model, tokenizer, self.data.forget_split(p)),
                "retain_rouge_l": _rouge_recall(model, tokenizer, self.data.retain_split(p)),
            }
        return {"author_recall_exact_match": _recall(model, tokenizer, self.data.author_qa)}

    def check_reference(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
    ) -> dict[str, float]:
        forget = self.data.forget_split(self.params.forget_percent)
        if self.params.data_path:
            return {"reference_forget_rouge_l": _rouge_recall(model, tokenizer, forget)}
        return {"forget_recall_reference_exact_match": _recall(model, tokenizer, forget)}


def _rouge_recall(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, records: list[dict]
) -> float:
    """Mean ROUGE-L recall of greedy answers (up to 96 new tokens) against the answers."""
    generations = greedy_generate(
        model, tokenizer, [r["question"] for r in records], max_new_tokens=96
    )
    scores = rouge_l_recall(generations, [r["answer"] for r in records])
    return float(sum(scores) / max(1, len(scores)))


def _recall(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, records: list[dict]
) -> float:
    """Share of QA whose greedy answer matches the reference answer exactly."""
    generations = greedy_generate(model, tokenizer, [r["question"] for r in records])
    scores = exact_match(generations, [r["answer"] for r in records])
    return float(sum(scores) / max(1, len(scores)))
