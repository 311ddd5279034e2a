"""How a question/answer pair is turned into text for the language model.

Every part of the library (pre-training, fine-tuning, unlearning objectives, Fisher,
evaluation) formats QA pairs through these two functions so the prompt the model was
trained on is exactly the prompt it is evaluated on.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

QUESTION_PREFIX = "Question: "
ANSWER_PREFIX = "\nAnswer:"


def format_prompt(question: str) -> str:
    """Prompt text for ``question``; the model continues it with the answer."""
    return f"{QUESTION_PREFIX}{question.strip()}{ANSWER_PREFIX}"


def format_answer(answer: str) -> str:
    """Target text appended to :func:`format_prompt` (leading space, no EOS)."""
    return f" {answer.strip()}"


def encode_qa(
    tokenizer: PreTrainedTokenizerBase, question: str, answer: str, max_length: int = 512
) -> tuple[list[int], list[int]]:
    """Token ids and labels for one QA pair: prompt tokens are masked with -100.

    The sequence is ``prompt + answer + EOS``; the answer tokens and the EOS carry labels.
    Sequences longer than ``max_length`` are truncated from the right.
    """
    prompt_ids = tokenizer(format_prompt(question), add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(format_answer(answer), add_special_tokens=False)["input_ids"]
    answer_ids = answer_ids + [tokenizer.eos_token_id]
    ids = (prompt_ids + answer_ids)[:max_length]
    labels = ([-100] * len(prompt_ids) + answer_ids)[:max_length]
    return ids, labels


def encode_text(
    tokenizer: PreTrainedTokenizerBase, text: str, max_length: int = 512
) -> tuple[list[int], list[int]]:
    """Token ids and labels for plain text (passages, documents): every token plus the final
    EOS is a target. Texts longer than ``max_length`` tokens are truncated from the right."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][: max_length - 1]
    ids = ids + [tokenizer.eos_token_id]
    return ids, list(ids)


def encode_record(
    tokenizer: PreTrainedTokenizerBase, record: dict, max_length: int = 512
) -> tuple[list[int], list[int]]:
    """A benchmark record as a training example: QA records (``question`` + ``answer``) through
    :func:`encode_qa`, text records (``text``) through :func:`encode_text`."""
    if "question" in record and "answer" in record and isinstance(record["answer"], str):
        return encode_qa(tokenizer, record["question"], record["answer"], max_length)
    if "text" in record:
        return encode_text(tokenizer, record["text"], max_length)
    raise ValueError(
        f"record with keys {sorted(record)} is neither QA (question, answer) nor text (text)"
    )
