"""Refusal ("I don't know") answers: the preferred answer y_idk of the DPO and IDK objectives."""

from __future__ import annotations

import random
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from fedunlearn.qa_format import encode_qa

REFUSAL_TEMPLATES: tuple[str, ...] = (
    "I don't know.",
    "I'm not sure.",
    "I have no idea.",
    "I don't have that information.",
    "I can't answer that.",
    "I'm afraid I don't know the answer to that.",
    "That's something I don't know.",
    "I'm not able to answer that question.",
    "Sorry, I don't have an answer for that.",
    "I have no knowledge of that.",
    "Unfortunately, I can't help with that question.",
    "I'm unable to provide an answer.",
    "I don't have any information on that.",
    "That is beyond what I know.",
    "I'm not aware of the answer.",
    "I cannot say.",
    "I really don't know.",
    "I'm sorry, but I don't know that.",
    "I don't have the details to answer that.",
    "That's not something I can answer.",
)


def refusal_answers(questions: Sequence[str], seed: int) -> list[str]:
    """One refusal answer per question, drawn from :data:`REFUSAL_TEMPLATES`.

    Deterministic: the same questions and ``seed`` always give the same answers.
    """
    rng = random.Random(seed)
    return [rng.choice(REFUSAL_TEMPLATES) for _ in questions]


def refusal_examples(
    tokenizer: PreTrainedTokenizerBase, questions: Sequence[str], seed: int
) -> list[tuple[list[int], list[int]]]:
    """Encoded (prompt, refusal answer) examples aligned with ``questions`` (``encode_qa``),
    ready to pass as ``alternate_examples`` to ``train_lora_task_vector``."""
    answers = refusal_answers(questions, seed)
    return [encode_qa(tokenizer, q, a) for q, a in zip(questions, answers, strict=True)]
