"""How a question/answer pair is turned into text for the language model.

Every part of the library (pre-training, fine-tuning, unlearning objectives, Fisher,
evaluation) formats QA pairs through :func:`prompt_text` and :func:`answer_text`, so the
prompt a model was trained on is exactly the prompt it is evaluated on. A tokenizer with a
chat template (a pretrained instruction model such as SmolLM2) gets the question as one user
turn of its own template and the answer as the assistant turn (ended by its EOS, e.g.
``<|im_end|>``); a tokenizer without one (the built-in model) gets the plain
``Question: ...\nAnswer: ...`` format of :func:`format_prompt` / :func:`format_answer`.
"""

from __future__ import annotations

from typing import cast

from transformers import PreTrainedTokenizerBase

QUESTION_PREFIX = "Question: "
ANSWER_PREFIX = "\nAnswer:"


def format_prompt(question: str) -> str:
    """Prompt text for ``question``; the model continues it with the answer."""
    return f"{QUESTION_PREFIX}{question.strip()}{ANSWER_PREFIX}"


def format_answer(answer: str) -> str:
    """Target text appended to :func:`format_prompt` (leading space, no EOS)."""
    return f" {answer.strip()}"


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether ``tokenizer`` carries a chat template (QA is then formatted as a chat turn)."""
    return bool(getattr(tokenizer, "chat_template", None))


def prompt_text(tokenizer: PreTrainedTokenizerBase, question: str) -> str:
    """The prompt for ``question``: one user turn of the tokenizer's chat template followed by
    the assistant header, or :func:`format_prompt` without a template."""
    if not has_chat_template(tokenizer):
        return format_prompt(question)
    messages = [{"role": "user", "content": question.strip()}]
    # one conversation, tokenize=False: the rendered text (transformers types every form)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return cast(str, text)


def answer_text(tokenizer: PreTrainedTokenizerBase, answer: str) -> str:
    """The target text after :func:`prompt_text` (the EOS token is added by the encoders)."""
    return answer.strip() if has_chat_template(tokenizer) else format_answer(answer)


def encode_qa(
    tokenizer: PreTrainedTokenizerBase, question: str, answer: str, max_length: int = 512
) -> tuple[list[int], list[int]]:
    """Token ids and labels for one QA pair (:func:`prompt_text` + :func:`answer_text`):
    prompt tokens are masked with -100.

    The sequence is ``prompt + answer + EOS``; the answer tokens and the EOS carry labels.
    Sequences longer than ``max_length`` are truncated from the right.
    """
    prompt_ids = tokenizer(prompt_text(tokenizer, question), add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(answer_text(tokenizer, answer), add_special_tokens=False)["input_ids"]
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
