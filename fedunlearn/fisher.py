"""Empirical Fisher diagonal of a client (SPEC §1.1)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from fedunlearn.training.batching import Example, collate, token_nll


def empirical_fisher_diagonal(
    model: torch.nn.Module,
    examples: Sequence[Example],
    param_names: Iterable[str],
    *,
    pad_token_id: int,
    num_batches: int = 20,
    max_length: int = 512,
) -> dict[str, torch.Tensor]:
    """Raw empirical Fisher diagonal F̂_c(j) = (1/N) Σ_b (∂L_LM(x_b; θ_F)/∂θ_j)².

    Evaluated at the model's current weights θ_F (the weights the client received, no
    adapter), over ``num_batches`` (N) batches of ONE sequence each, taken in data order and
    cycling when there are fewer examples than batches. L_LM is the mean NLL over the
    labelled tokens of that sequence, so token averaging comes before squaring and sequence
    averaging after. Sequences are truncated to ``max_length`` tokens; squared gradients are
    accumulated in float32. Only the parameters named in ``param_names`` are returned.
    """
    if not examples:
        raise ValueError("empirical Fisher needs at least one example")
    if num_batches < 1:
        raise ValueError(f"num_batches must be >= 1, got {num_batches}")
    params = dict(model.named_parameters())
    names = list(param_names)
    missing = [n for n in names if n not in params]
    if missing:
        raise KeyError(f"Fisher requested for parameters the model does not have: {missing[:5]}")
    saved_flags = {n: p.requires_grad for n, p in params.items()}
    was_training = model.training
    for n, p in params.items():
        p.requires_grad_(n in names)
    model.eval()
    sums = {n: torch.zeros(params[n].shape, dtype=torch.float32) for n in names}
    try:
        for b in range(num_batches):
            ids, labels = examples[b % len(examples)]
            batch = collate([(ids[:max_length], labels[:max_length])], pad_token_id)
            batch = {k: v.to(params[names[0]].device) for k, v in batch.items()}
            for n in names:
                params[n].grad = None
            loss = token_nll(model, batch).mean()
            loss.backward()
            for n in names:
                grad = params[n].grad
                if grad is not None:
                    sums[n] += grad.detach().float().cpu() ** 2
    finally:
        for n, p in params.items():
            p.grad = None
            p.requires_grad_(saved_flags[n])
        model.train(was_training)
    return {n: s / num_batches for n, s in sums.items()}
