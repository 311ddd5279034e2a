"""Empirical Fisher diagonal against an analytic gradient on a tiny softmax LM."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedunlearn.fisher import empirical_fisher_diagonal
from tests.proc_memory import peak_added_since, restart_peak


class SoftmaxLM(torch.nn.Module):
    """logits_t = W · E[x_t]: a bigram LM whose gradient has a closed form."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.embed = torch.nn.Embedding(vocab, dim)
        self.embed.weight.data = torch.randn(vocab, dim, generator=gen)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight.data = torch.randn(vocab, dim, generator=gen) * 0.5

    def forward(self, input_ids, attention_mask=None):
        return SimpleNamespace(logits=self.head(self.embed(input_ids)))


def analytic_head_grad(model: SoftmaxLM, ids: list[int], labels: list[int]) -> np.ndarray:
    """d/dW of the mean NLL over labelled next tokens: mean_t (softmax_t − e_y) h_tᵀ."""
    emb = model.embed.weight.detach().double().numpy()
    w = model.head.weight.detach().double().numpy()
    grads = []
    for t in range(len(ids) - 1):
        target = labels[t + 1]
        if target == -100:
            continue
        h = emb[ids[t]]
        z = w @ h
        p = np.exp(z - z.max())
        p /= p.sum()
        p[target] -= 1.0
        grads.append(np.outer(p, h))
    return np.mean(grads, axis=0)


def test_fisher_matches_hand_computed_squared_gradients():
    model = SoftmaxLM(vocab=7, dim=4)
    examples = [
        ([1, 2, 3, 4], [-100, -100, 3, 4]),
        ([5, 1, 6], [-100, 1, 6]),
        ([2, 2, 0, 5, 3], [-100, 2, 0, 5, 3]),
    ]
    fisher = empirical_fisher_diagonal(
        model, examples, ["head.weight"], pad_token_id=0, num_batches=20
    )
    # 20 batches cycle through 3 examples in order: 7, 7 and 6 visits.
    visits = [7, 7, 6]
    expected = (
        sum(
            v * analytic_head_grad(model, ids, lab) ** 2
            for v, (ids, lab) in zip(visits, examples, strict=True)
        )
        / 20
    )
    assert fisher["head.weight"].dtype == torch.float32
    np.testing.assert_allclose(fisher["head.weight"].numpy(), expected, rtol=1e-4, atol=1e-9)


def test_fisher_averages_tokens_before_squaring():
    model = SoftmaxLM(vocab=7, dim=4)
    ids, labels = [1, 2, 3, 4], [-100, 2, 3, 4]
    fisher = empirical_fisher_diagonal(
        model, [(ids, labels)], ["head.weight"], pad_token_id=0, num_batches=1
    )
    mean_then_square = analytic_head_grad(model, ids, labels) ** 2
    per_token = [
        analytic_head_grad(
            model, ids, [-100] * (t + 1) + [labels[t + 1]] + [-100] * (len(ids) - t - 2)
        )
        for t in range(3)
    ]
    square_then_mean = np.mean([g**2 for g in per_token], axis=0)
    np.testing.assert_allclose(fisher["head.weight"].numpy(), mean_then_square, rtol=1e-4)
    assert not np.allclose(fisher["head.weight"].numpy(), square_then_mean, rtol=1e-2)


def test_fisher_only_requested_params_and_flags_restored():
    model = SoftmaxLM(vocab=7, dim=4)
    model.embed.weight.requires_grad_(False)
    fisher = empirical_fisher_diagonal(
        model, [([1, 2, 3], [-100, 2, 3])], ["head.weight"], pad_token_id=0, num_batches=2
    )
    assert set(fisher) == {"head.weight"}
    assert fisher["head.weight"].shape == model.head.weight.shape
    assert (fisher["head.weight"] >= 0).all()
    assert model.head.weight.requires_grad and not model.embed.weight.requires_grad
    assert model.head.weight.grad is None


def test_fisher_errors():
    model = SoftmaxLM(vocab=7, dim=4)
    with pytest.raises(KeyError, match="nope.weight"):
        empirical_fisher_diagonal(model, [([1, 2], [-100, 2])], ["nope.weight"], pad_token_id=0)
    with pytest.raises(ValueError, match="at least one example"):
        empirical_fisher_diagonal(model, [], ["head.weight"], pad_token_id=0)


def test_a_bfloat16_model_sums_in_its_own_dtype_within_the_stated_rounding():
    examples = [([1, 2, 3, 4], [-100, -100, 3, 4]), ([5, 1, 6], [-100, 1, 6])]
    model = SoftmaxLM(vocab=7, dim=4)
    exact = empirical_fisher_diagonal(
        model, examples, ["head.weight"], pad_token_id=0, num_batches=20
    )["head.weight"]
    half = SoftmaxLM(vocab=7, dim=4).to(torch.bfloat16)
    # the same bf16 weights in float32: only the sums' rounding differs from `reference`
    reference_model = SoftmaxLM(vocab=7, dim=4)
    reference_model.load_state_dict({k: v.float() for k, v in half.state_dict().items()})
    reference = empirical_fisher_diagonal(
        reference_model, examples, ["head.weight"], pad_token_id=0, num_batches=20
    )["head.weight"]
    fisher = empirical_fisher_diagonal(
        half, examples, ["head.weight"], pad_token_id=0, num_batches=20
    )["head.weight"]
    assert fisher.dtype == torch.bfloat16 and exact.dtype == torch.float32
    assert half.head.weight.grad is None and half.head.weight.requires_grad
    # bf16 forward/backward and bf16 sums: within a few per cent of the float32 Fisher, and
    # the sums alone within N·2⁻⁹ (plus the bf16 gradients' own rounding) of `reference`
    relative = ((fisher.float() - reference) / reference.clamp_min(1e-30)).abs()
    assert float(relative.max()) < 20 * 2**-9 + 0.05
    assert float(relative.median()) < 0.02


def test_the_fisher_of_a_16_bit_model_takes_about_the_weights_bytes_at_its_peak():
    """The memory the Fisher adds at its peak (VmHWM reset right before it) is the sums, each
    as large as its weight in the weight's dtype, plus one weight's gradient and its float32
    square at a time: within 1.4 × the sums' bytes here (32 tensors of 2 MB). Returning the
    averages as new tensors beside the sums, and squaring through three float32 temporaries,
    took 2.5 ×."""
    weights = [torch.nn.Parameter(torch.randn(1024, 1024).bfloat16()) for _ in range(32)]

    class Chain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weights = torch.nn.ParameterList(weights)

        def forward(self, input_ids, attention_mask=None):
            h = torch.nn.functional.one_hot(input_ids % 1024, 1024).to(torch.bfloat16)
            for w in self.weights:
                h = torch.tanh(h @ w / 32)
            return SimpleNamespace(logits=h[..., :16].float())

    model = Chain()
    names = [f"weights.{i}" for i in range(32)]
    examples = [([1, 2, 3, 4], [-100, 2, 3, 4])]
    sums_bytes = sum(w.numel() * w.element_size() for w in weights)
    # once on one weight first: what a process pays once (code paged in, allocator pools)
    empirical_fisher_diagonal(model, examples, names[:1], pad_token_id=0, num_batches=1)
    start = restart_peak()
    fisher = empirical_fisher_diagonal(model, examples, names, pad_token_id=0, num_batches=2)
    extra = peak_added_since(start)
    assert sum(f.numel() * f.element_size() for f in fisher.values()) == sums_bytes
    assert extra < 1.4 * sums_bytes, extra / sums_bytes
