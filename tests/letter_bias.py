"""A model made to answer one letter to every multiple-choice question (for scoring tests)."""

import torch

from fedunlearn.evaluation.harness_mc import encode_pair


def always_answer(model: torch.nn.Module, tokenizer, letter: str) -> torch.nn.Module:
    """``model`` with an output bias of 100 on the token of ``" " + letter`` after "Answer:"."""
    (token,) = encode_pair(tokenizer, "Answer:", f" {letter}")[1]
    old = model.lm_head
    model.lm_head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        model.lm_head.weight.copy_(old.weight)
        model.lm_head.bias.zero_()
        model.lm_head.bias[token] = 100.0
    return model
