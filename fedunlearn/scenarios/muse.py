"""The MUSE scenario: forget clients hold fictional books' passages (and the QA the model was
trained on about them), retain clients the other books; GA by default (SPEC §5.3)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from fedunlearn.benchmarks.muse import (
    MuseData,
    generate_muse,
    generate_muse_background,
    muse_training_texts,
)
from fedunlearn.benchmarks.muse_files import load_muse_files
from fedunlearn.evaluation.muse_metrics import evaluate_muse
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


#: the real MUSE-Books ``raw`` splits are whole books: cut them into passages of this size
REAL_PASSAGE_CHARS = 2000


@functools.lru_cache(maxsize=4)
def _muse_data(seed: int, data_path: str) -> MuseData:
    """Generated data, or the real files (retain1 only as trainable retain text: MUSE keeps
    retain2 away from unlearning methods)."""
    if not data_path:
        return generate_muse(seed)
    return load_muse_files(data_path, chunk_chars=REAL_PASSAGE_CHARS, retain_splits=("retain1",))


@register_scenario("muse")
class MuseScenario(Scenario):
    """Fictional books (MUSE): the forget books' knowledge (KnowMem), verbatim memory
    (VerbMem) and membership signal (PrivLeak against the retrained reference) should go,
    the retain books' knowledge (KnowMem retain, the utility) should stay."""

    defaults = {
        "objective": "ga",
        "lora_targets": "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        "num_forget_clients": 3,
        "forget_steps": 12,
        "forget_lr": 1e-3,
        "gamma": 3.0,
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
        self.data = _muse_data(params.seed, params.data_path)

    def records(self) -> list[dict[str, Any]]:
        """Forget passages, retain passages (:meth:`MuseData.text_records`), then — for
        generated data, whose QA the model was trained on — forget QA and retain QA. With the
        real files the QA are KnowMem's test questions and stay out of training."""
        if self.params.data_path:
            return self.data.text_records()
        return self.data.text_records() + self.data.forget_qa + self.data.retain_qa

    def _pools(self) -> tuple[list[int], list[int]]:
        """Forget and retain indices; forget ones ordered book by book (passages, then QA)."""
        records = self.records()
        n_forget_p = len(self.data.forget_passages)
        n_text = len(self.data.text_records())
        n_forget_qa = len(self.data.forget_qa) if len(records) > n_text else 0
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
        return [{"text": t} for t in muse_training_texts(self.data, include_forget=include_forget)]

    def reference_name(self) -> str:
        return "reference-retrain"

    def evaluate(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        *,
        reference_metrics: dict[str, Any] | None = None,
        batch_size: int = 64,
        max_new_tokens: int = 32,
        n_samples: int = 3,
    ) -> dict[str, Any]:
        """SPEC §5.3; PrivLeak against the reference's own forget-vs-holdout AUC."""
        retrain_auc = reference_metrics.get("privleak_auc") if reference_metrics else None
        return evaluate_muse(
            model,
            tokenizer,
            self.data,
            retrain_auc=retrain_auc,
            batch_size=batch_size,
            max_new_tokens=max_new_tokens,
            n_samples=n_samples,
        )
