"""Fixtures: a tiny BPE tokenizer, an untrained tiny Llama and one that memorised QA pairs."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from fedunlearn.models.tokenizer import train_bpe_tokenizer
from fedunlearn.qa_format import encode_qa

NAMES = ["Ava Lind", "Bram Osei", "Cleo Marsh", "Dario Venn", "Elif Ruud", "Fenna Kask"]
CITIES = ["Oslo", "Lima", "Perth", "Quito", "Tunis", "Riga", "Cork", "Bern"]
GENRES = ["poetry", "crime novels", "science fiction", "memoirs", "plays", "history"]
WORDS = ["the", "a", "quiet", "river", "old", "house", "wrote", "about", "loved", "winter"]

MEMORISED: list[dict[str, Any]] = [
    {
        "question": "Where was Ava Lind born?",
        "answer": "Ava Lind was born in Oslo.",
        "paraphrased_answer": "Oslo is the birthplace of Ava Lind.",
        "perturbed_answer": [
            "Ava Lind was born in Lima.",
            "Ava Lind was born in Perth.",
            "Ava Lind was born in Quito.",
        ],
        "author": "Ava Lind",
    },
    {
        "question": "What does Bram Osei write?",
        "answer": "Bram Osei writes crime novels.",
        "paraphrased_answer": "Crime novels are what Bram Osei writes.",
        "perturbed_answer": [
            "Bram Osei writes poetry.",
            "Bram Osei writes memoirs.",
            "Bram Osei writes plays.",
        ],
        "author": "Bram Osei",
    },
    {
        "question": "Which city did Cleo Marsh move to?",
        "answer": "Cleo Marsh moved to Riga in winter.",
        "paraphrased_answer": "In winter, Cleo Marsh moved to Riga.",
        "perturbed_answer": [
            "Cleo Marsh moved to Cork in winter.",
            "Cleo Marsh moved to Bern in winter.",
            "Cleo Marsh moved to Tunis in winter.",
        ],
        "author": "Cleo Marsh",
    },
    {
        "question": "What did Dario Venn love?",
        "answer": "Dario Venn loved the old river house.",
        "paraphrased_answer": "The old river house was loved by Dario Venn.",
        "perturbed_answer": [
            "Dario Venn loved the quiet winter.",
            "Dario Venn loved history.",
        ],
        "author": "Dario Venn",
    },
]


@pytest.fixture(autouse=True, scope="module")
def _single_torch_thread() -> Iterator[None]:
    """Run the tiny models on one thread (intra-op threads thrash on a busy 2-core box)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _corpus(n: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        name, city, genre = rng.choice(NAMES), rng.choice(CITIES), rng.choice(GENRES)
        filler = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6)))
        template = rng.choice(
            [
                f"{name} was born in {city} and writes {genre}.",
                f"Question: Where did {name} live?\nAnswer: In {city}, {filler}.",
                f"{filler} {name} moved to {city}; {filler}.",
                f"In {city}, {name} wrote {genre} about {filler}.",
            ]
        )
        out.append(template)
    return out


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return train_bpe_tokenizer(_corpus(), vocab_size=500)


def _make_model(tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=len(tokenizer),
        max_position_embeddings=128,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    model = LlamaForCausalLM(config)
    model.eval()
    return model


@pytest.fixture(scope="session")
def untrained_model(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    return _make_model(tokenizer, seed=0)


@pytest.fixture(scope="session")
def memorised_records() -> list[dict[str, Any]]:
    return [dict(r) for r in MEMORISED]


@pytest.fixture(scope="session")
def trained_model(
    tokenizer: PreTrainedTokenizerFast, memorised_records: list[dict[str, Any]]
) -> LlamaForCausalLM:
    """Same initialisation as ``untrained_model``, then memorises the QA pairs (full batch)."""
    model = _make_model(tokenizer, seed=0)
    encoded = [encode_qa(tokenizer, r["question"], r["answer"]) for r in memorised_records]
    width = max(len(ids) for ids, _ in encoded)
    input_ids = torch.full((len(encoded), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(encoded), width), -100, dtype=torch.long)
    attention = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, (ids, labs) in enumerate(encoded):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(labs)] = torch.tensor(labs)
        attention[row, : len(ids)] = 1
    torch.manual_seed(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for _ in range(150):
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    return model
