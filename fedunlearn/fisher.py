"""Empirical Fisher diagonal of a client (docs/algorithms.md, "What a client uploads")."""

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
    averaging after. Sequences are truncated to ``max_length`` tokens. Only the parameters
    named in ``param_names`` are returned.

    Memory: each gradient is squared into its sum the moment backward has computed it and
    then freed, so at most one parameter's gradient (and one float32 square of it) is alive,
    and the sums are averaged in place. Sums are float32 for float32
    parameters; for 16-bit parameters they are kept in the parameter's dtype (each batch is
    added in float32 and the sum rounded back: a relative rounding of at most N·2⁻⁹ in
    bfloat16, far below the sampling noise of N single-sequence batches), so the Fisher of a
    16-bit model takes no more memory than the weights it covers.
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
    sums = {n: torch.zeros(params[n].shape, dtype=_sum_dtype(params[n].dtype)) for n in names}

    def square_into_sum(name: str):
        def hook(param: torch.Tensor) -> None:
            grad, param.grad = param.grad, None
            if grad is None:
                return
            total = sums[name]
            # one float32 temporary (the gradient itself where it is float32 on the CPU)
            square = grad.detach().to(device="cpu", dtype=torch.float32).square_()
            del grad
            if total.dtype == torch.float32:
                total.add_(square)
            else:
                total.copy_(square.add_(total))

        return hook

    hooks = [params[n].register_post_accumulate_grad_hook(square_into_sum(n)) for n in names]
    try:
        for b in range(num_batches):
            ids, labels = examples[b % len(examples)]
            batch = collate([(ids[:max_length], labels[:max_length])], pad_token_id)
            batch = {k: v.to(params[names[0]].device) for k, v in batch.items()}
            token_nll(model, batch).mean().backward()
    finally:
        for handle in hooks:
            handle.remove()
        for n, p in params.items():
            p.grad = None
            p.requires_grad_(saved_flags[n])
        model.train(was_training)
    for total in sums.values():  # in place: a second set of sums would double the peak
        total.div_(num_batches)
    return sums


def _sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Float32 sums, except for 16-bit parameters (their own dtype: see above)."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32
