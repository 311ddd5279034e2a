"""The MUSE scenario: forget clients hold the forget texts (and the QA the model was trained
on about them), retain clients the retain texts and QA; GA by default (docs/scenarios.md, "The
three scenarios").

Generated data: fictional books. Real files (``scenario.data-path``, a pretrained model): the
CPU-sized :func:`~fedunlearn.benchmarks.muse_files.muse_subset` of the published lists
(``subset_texts`` items of each: VerbMem excerpts, PrivLeak texts, KnowMem QA).
"""

from __future__ import annotations

import functools
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fedunlearn.benchmarks.muse import (
    MuseData,
    generate_muse,
    generate_muse_background,
    muse_training_texts,
)
from fedunlearn.benchmarks.muse_files import load_muse_files, muse_subset
from fedunlearn.evaluation.muse_metrics import evaluate_muse, knowmem, verbmem
from fedunlearn.scenarios.base import (
    ClientAssignment,
    Scenario,
    ScenarioParams,
    register_scenario,
    sampled_retain_clients,
    split_contiguous,
    with_local_retain,
)

MUSE_FORGET_DOMAIN = "muse-forget"

#: VerbMem generation budget (tokens): the generated books' passages, and the subset's
#: 40-word continuations of the real files (about 56 SmolLM2 tokens)
GENERATED_VERBMEM_TOKENS = 128
REAL_VERBMEM_TOKENS = 64


@functools.lru_cache(maxsize=4)
def _muse_data(seed: int, data_path: str, subset_texts: int) -> MuseData:
    """Generated data, or the subset of the real files (``subset_texts`` 0 = every item)."""
    if not data_path:
        return generate_muse(seed)
    return muse_subset(load_muse_files(data_path), subset_texts or None)


@register_scenario("muse")
class MuseScenario(Scenario):
    """MUSE (fictional books, or the real files' subset): the forget texts' knowledge
    (KnowMem), verbatim memory (VerbMem) and membership signal (PrivLeak against the
    retrained reference) should go, the retain knowledge (KnowMem retain, the utility) stay."""

    defaults = {
        "objective.name": "ga",
        "lora.targets": "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        "scenario.num-forget-clients": 3,
        "training.forget-steps": 12,
        "training.forget-lr": 1e-3,
        "gamma": 3.0,
        # a pretrained model memorises the subset's texts verbatim (SmolLM2-135M: VerbMem
        # 0.99 after 10 epochs at 5e-4, 0.19 after 8 at TOFU's 1e-4)
        "model.finetune-epochs": 8,
        "model.finetune-lr": 5e-4,
    }
    # on a registry model (SmolLM2-135M, the real files' subset): GA at the registry models'
    # 2e-4 barely moved VerbMem (0.99 -> 0.96); NPO with stronger client steps at gamma 0.5
    # took it to 0.30 (reference 0.12) with KnowMem retain at 0.98 (docs/real-models.md, the
    # sweep table). KnowMem forget does not move before KnowMem retain falls in that sweep.
    pretrained_defaults = {
        "objective.name": "npo",
        "training.forget-lr": 1e-3,
        "training.forget-steps": 24,
        "training.retain-lr": 1e-3,
        "training.retain-steps": 24,
        "gamma": 0.5,
    }
    summary_metrics = (
        "knowmem_forget",
        "verbmem_forget",
        "privleak_auc",
        "privleak",
        "knowmem_retain",
    )
    forget_metric = "knowmem_forget"
    utility_metric = "knowmem_retain"
    qa_forget_data = False  # shards mix passages and QA: refusal preference does not apply

    def __init__(self, params: ScenarioParams) -> None:
        super().__init__(params)
        self.data = _muse_data(params.seed, params.data_path, params.subset_texts)

    def records(self) -> list[dict[str, Any]]:
        """Forget passages, retain passages (:meth:`MuseData.text_records`), forget QA, retain
        QA: everything the model was fine-tuned on (see :meth:`knowledge_records`)."""
        return self.data.text_records() + self.data.forget_qa + self.data.retain_qa

    def _pools(self) -> tuple[list[int], list[int]]:
        """Forget and retain indices; forget ones ordered book by book (passages, then QA)."""
        records = self.records()
        n_forget_p = len(self.data.forget_passages)
        n_text = len(self.data.text_records())
        n_forget_qa = len(self.data.forget_qa)
        forget = list(range(n_forget_p)) + list(range(n_text, n_text + n_forget_qa))
        books = list(dict.fromkeys(records[i].get("book", "") for i in forget))
        forget.sort(key=lambda i: (books.index(records[i].get("book", "")), i))
        retain = list(range(n_forget_p, n_text)) + list(range(n_text + n_forget_qa, len(records)))
        return forget, retain

    def assignments(self) -> list[ClientAssignment]:
        p = self.params
        if p.num_forget_clients < 1 or p.num_retain_clients < 0:
            raise ValueError("muse needs >= 1 forget client and >= 0 retain clients")
        forget, retain = self._pools()
        if len(forget) < p.num_forget_clients:
            raise ValueError(
                f"{len(forget)} forget records cannot be shared by {p.num_forget_clients} clients"
            )
        clients = [
            ClientAssignment("forget", MUSE_FORGET_DOMAIN, tuple(shard))
            for shard in split_contiguous(forget, p.num_forget_clients)
        ]
        clients += sampled_retain_clients(
            retain, p.num_retain_clients, p.retain_samples, "retain", p.seed
        )
        return with_local_retain(clients, retain, p.local_retain_samples, p.seed)

    def tokenizer_corpus(self, num_documents: int) -> list[str]:
        return generate_muse_background(self.params.seed, num_documents)

    def pretraining_records(
        self, num_documents: int, knowledge_repeats: int
    ) -> list[dict[str, Any]]:
        return [{"text": t} for t in self.tokenizer_corpus(num_documents)]

    def knowledge_records(self, *, include_forget: bool) -> list[dict[str, Any]]:
        """The passages and QA (without the forget ones for the reference). Generated data:
        QA as plain ``Question: ... Answer: ...`` text (:func:`muse_training_texts`); real
        files: QA records, so a pretrained model learns them in its chat template, the format
        KnowMem asks in."""
        if not self.params.data_path:
            texts = muse_training_texts(self.data, include_forget=include_forget)
            return [{"text": t} for t in texts]
        if include_forget:
            return self.records()
        return list(self.data.retain_passages) + list(self.data.retain_qa)

    def reference_name(self) -> str:
        return "reference-retrain"

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
        """The muse metrics of docs/algorithms.md, "Evaluation metrics"; PrivLeak against the
        reference's own forget-vs-holdout AUC."""
        retrain_auc = reference_metrics.get("privleak_auc") if reference_metrics else None
        return evaluate_muse(
            model,
            tokenizer,
            self.data,
            retrain_auc=retrain_auc,
            batch_size=batch_size,
            max_new_tokens=max_new_tokens,
            verbmem_max_new_tokens=self.verbmem_tokens(),
            n_samples=n_samples,
        )

    def verbmem_tokens(self) -> int:
        """VerbMem's generation budget for this scenario's data."""
        return REAL_VERBMEM_TOKENS if self.params.data_path else GENERATED_VERBMEM_TOKENS

    def check_knowledge(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
    ) -> dict[str, float]:
        """Real files: VerbMem and KnowMem forget alone (cheap; run when the model is built).
        Generated data: the summary metrics."""
        if not self.params.data_path:
            return super().check_knowledge(model, tokenizer)
        return self._forget_memory(model, tokenizer, "")

    def check_reference(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
    ) -> dict[str, float]:
        """Real files: the reference's VerbMem and KnowMem forget (what it knows unseen)."""
        if not self.params.data_path:
            return {}
        return self._forget_memory(model, tokenizer, "reference_")

    def _forget_memory(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prefix: str
    ) -> dict[str, float]:
        out = {}
        if self.data.verbmem:
            score, _ = verbmem(
                model, tokenizer, self.data.verbmem, max_new_tokens=self.verbmem_tokens()
            )
            out[f"{prefix}verbmem_forget"] = score
        if self.data.forget_qa:
            score, _ = knowmem(model, tokenizer, self.data.forget_qa)
            out[f"{prefix}knowmem_forget"] = score
        return out
