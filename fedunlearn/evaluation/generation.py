"""Batched greedy answer generation for QA prompts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from transformers import (
    GenerationConfig,
    GenerationMixin,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from fedunlearn.evaluation.likelihood import (
    eval_mode,
    length_sorted_batches,
    model_device,
    resolve_pad_id,
)
from fedunlearn.qa_format import prompt_text

__all__ = ["greedy_from_ids", "greedy_generate"]


def greedy_generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    questions: Sequence[str],
    *,
    max_new_tokens: int = 48,
    batch_size: int = 32,
) -> list[str]:
    """Greedy continuation of :func:`~fedunlearn.qa_format.prompt_text` for each question.

    Prompts are grouped by length and LEFT-padded by hand (the tokenizer's ``padding_side`` is
    not touched); ``model.generate`` derives position ids from the attention mask, so a padded
    prompt decodes exactly like the same prompt alone. Decoding stops at EOS or after
    ``max_new_tokens`` tokens.

    Args:
        model: causal LM, evaluated on its current device (in eval mode for the call).
        tokenizer: tokenizer with EOS set (PAD falls back to EOS).
        questions: question texts.
        max_new_tokens: generation budget per question.
        batch_size: prompts per ``generate`` call.

    Returns:
        The decoded continuations in input order, without prompt or special tokens, stripped.
    """
    prompts = [
        tokenizer(prompt_text(tokenizer, q), add_special_tokens=False)["input_ids"]
        for q in questions
    ]
    return greedy_from_ids(
        model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size
    )


def greedy_from_ids(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    batch_size: int,
) -> list[str]:
    """Greedy continuation of already tokenised prompts (shared by :func:`greedy_generate`
    and raw-text continuation): length-grouped, left-padded by hand, stops at EOS."""
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise ValueError("tokenizer needs an EOS token")
    pad_id = resolve_pad_id(tokenizer)
    outputs: list[str] = [""] * len(prompts)
    if not prompts or max_new_tokens <= 0:
        return outputs
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
    )
    device = model_device(model)
    with eval_mode(model), torch.no_grad():
        for batch in length_sorted_batches([len(p) for p in prompts], batch_size):
            width = max(len(prompts[i]) for i in batch)
            input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            attention = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                ids = prompts[i]
                input_ids[row, width - len(ids) :] = torch.tensor(list(ids), dtype=torch.long)
                attention[row, width - len(ids) :] = 1
            # every *ForCausalLM is a GenerationMixin (PreTrainedModel itself is not)
            generated = cast(GenerationMixin, model).generate(
                input_ids=input_ids.to(device),
                attention_mask=attention.to(device),
                generation_config=config,
            )
            new_tokens = generated[:, width:].cpu().tolist()
            for row, i in enumerate(batch):
                tokens = new_tokens[row]
                if eos_id in tokens:
                    tokens = tokens[: tokens.index(eos_id)]
                text = tokenizer.decode(tokens, skip_special_tokens=True)
                outputs[i] = cast(str, text).strip()  # one sequence decodes to a str
    return outputs
