"""Answer likelihoods under a causal language model.

The score of an answer ``a`` to a question ``q`` is the mean token negative log-likelihood
(NLL) of the labelled tokens produced by :func:`fedunlearn.qa_format.encode_qa` (the answer
tokens plus the EOS), so ``P(a|q) = exp(-mean NLL)`` is a per-token, length-normalised
probability (docs/algorithms.md, "Evaluation metrics").
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fedunlearn.qa_format import encode_qa

__all__ = [
    "answer_nll",
    "answer_probability",
    "eval_mode",
    "length_sorted_batches",
    "model_device",
    "resolve_pad_id",
]


def model_device(model: torch.nn.Module) -> torch.device:
    """Device of the first parameter of ``model`` (CPU for a model without parameters)."""
    for param in model.parameters():
        return param.device
    return torch.device("cpu")


@contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Put ``model`` in eval mode for the block and restore its previous training flag."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def resolve_pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """Pad id of ``tokenizer``, falling back to the EOS id."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("tokenizer needs a pad or EOS token")
    return int(pad)


def length_sorted_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of similar length (longest first) to limit padding."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


#: the most float32 logits one forward pass of an evaluation batch may produce (bytes): a batch
#: whose logits would be larger runs as several forward passes of fewer rows (a 64 × 128-token
#: batch of a 49k-word vocabulary would otherwise hold 1.6 GB of logits, and its loss two more
#: copies)
LOGITS_BUDGET_BYTES = 128 * 2**20


def logits_in_chunks(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> Iterator[tuple[slice, torch.Tensor]]:
    """``(rows, logits of those rows)`` of a right-padded batch, in row order: one forward pass
    when the batch's logits fit :data:`LOGITS_BUDGET_BYTES`, else passes of as many rows as fit
    (at least one). The caller scores each chunk before the next is computed."""
    rows, width = input_ids.shape
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)  # None: one pass
    per_row = width * int(vocab or 0) * 4
    step = max(1, min(rows, LOGITS_BUDGET_BYTES // per_row)) if per_row else rows
    device = model_device(model)
    for start in range(0, rows, step):
        part = slice(start, min(rows, start + step))
        logits = model(
            input_ids=input_ids[part].to(device), attention_mask=attention_mask[part].to(device)
        ).logits
        yield part, logits


def answer_nll(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    questions: Sequence[str],
    answers: Sequence[str],
    *,
    batch_size: int = 32,
    max_length: int = 512,
) -> torch.Tensor:
    """Mean token NLL of each answer given its question.

    Every pair is encoded with :func:`~fedunlearn.qa_format.encode_qa` (prompt masked, answer
    tokens and EOS labelled). Pairs are grouped by length, right-padded, and scored with one
    forward pass per batch under ``torch.no_grad()``; the result is in input order and equals
    the unbatched computation.

    Args:
        model: causal LM; it is evaluated on its current device (in eval mode for the call).
        tokenizer: tokenizer with EOS (and preferably PAD) set.
        questions: question texts.
        answers: answer texts, one per question.
        batch_size: pairs per forward pass.
        max_length: truncation length of ``prompt + answer + EOS`` (from the right).

    Returns:
        Float32 CPU tensor of shape ``[len(questions)]``.

    Raises:
        ValueError: on mismatched lengths or when truncation leaves a pair without any
            labelled token (raise ``max_length``).
    """
    if len(questions) != len(answers):
        raise ValueError(f"{len(questions)} questions but {len(answers)} answers")
    n = len(questions)
    out = torch.empty(n, dtype=torch.float32)
    if n == 0:
        return out
    encoded = [
        encode_qa(tokenizer, q, a, max_length=max_length)
        for q, a in zip(questions, answers, strict=True)
    ]
    for i, (_, pair_labels) in enumerate(encoded):
        # Label at position 0 is never predicted (no preceding token), so it must not count.
        if not any(lab != -100 for lab in pair_labels[1:]):
            raise ValueError(
                f"pair {i} has no labelled answer token after truncation to {max_length} tokens"
            )
    pad_id = resolve_pad_id(tokenizer)
    device = model_device(model)
    with eval_mode(model), torch.no_grad():
        for batch in length_sorted_batches([len(ids) for ids, _ in encoded], batch_size):
            width = max(len(encoded[i][0]) for i in batch)
            input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            labels = torch.full((len(batch), width), -100, dtype=torch.long)
            attention = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                ids, labs = encoded[i]
                input_ids[row, : len(ids)] = torch.tensor(ids)
                labels[row, : len(labs)] = torch.tensor(labs)
                attention[row, : len(ids)] = 1
            for part, logits in logits_in_chunks(model, input_ids, attention):
                shift_logits = logits[:, :-1, :].float()
                shift_labels = labels[part, 1:].to(device)
                token_nll = F.cross_entropy(
                    shift_logits.reshape(-1, shift_logits.size(-1)),
                    shift_labels.reshape(-1),
                    ignore_index=-100,
                    reduction="none",
                ).view(shift_labels.shape)
                del logits, shift_logits
                mask = (shift_labels != -100).float()
                mean_nll = (token_nll * mask).sum(dim=1) / mask.sum(dim=1)
                out[torch.tensor(batch[part])] = mean_nll.cpu()
    return out


def answer_probability(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    questions: Sequence[str],
    answers: Sequence[str],
    *,
    batch_size: int = 32,
    max_length: int = 512,
) -> torch.Tensor:
    """Length-normalised ``P(a|q) = exp(-mean token NLL)`` per pair (see :func:`answer_nll`)."""
    return torch.exp(
        -answer_nll(
            model, tokenizer, questions, answers, batch_size=batch_size, max_length=max_length
        )
    )
