"""DP-SGD through Opacus on a tiny Llama: accounting across rounds, calibration, clipping."""

from __future__ import annotations

import math
import random
import warnings

import pytest
import torch
from opacus import PrivacyEngine
from opacus.accountants import RDPAccountant
from torch.utils.data import DataLoader, TensorDataset
from transformers import LlamaForCausalLM

from fedunlearn.dp.dpsgd import (
    AccountantState,
    DpSgdSettings,
    calibrate_noise_multiplier,
    train_dp_sgd,
)
from fedunlearn.models.llama import new_tiny_llama, tiny_llama_config
from fedunlearn.training.batching import Example, collate, token_nll

PAD = 1
DELTA = 1e-5


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    config = tiny_llama_config(40, hidden_size=64, num_hidden_layers=2, intermediate_size=128)
    return new_tiny_llama(config, seed=seed)


def make_examples(count: int, seed: int = 0) -> list[Example]:
    """Random sequences of different lengths; the first two positions are unscored."""
    rng = random.Random(seed)
    examples = []
    for _ in range(count):
        ids = [rng.randint(2, 39) for _ in range(rng.randint(5, 12))]
        examples.append((ids, [-100, -100, *ids[2:]]))
    return examples


def settings(**overrides) -> DpSgdSettings:
    values = dict(
        epsilon=8.0,
        delta=DELTA,
        noise_multiplier=1.1,
        sample_rate=0.25,
        steps_per_round=4,
        total_rounds=3,
        lr=0.5,
        seed=0,
    )
    values.update(overrides)
    return DpSgdSettings(**values)


def mean_loss(model: torch.nn.Module, examples: list[Example]) -> float:
    model.eval()
    with torch.no_grad():
        return token_nll(model, collate(examples, PAD)).mean().item()


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


# ---------------------------------------------------------------- accounting


def test_accountant_state_survives_json_rounds_and_matches_opacus() -> None:
    examples = make_examples(8)
    config = settings()
    model = tiny_model()
    state = AccountantState()
    for _ in range(config.total_rounds):  # a fresh "process" per round: only JSON survives
        stats, state = train_dp_sgd(model, examples, pad_token_id=PAD, settings=config, state=state)
        state = AccountantState.from_json(state.to_json())
    persisted = state.epsilon(DELTA)

    single = RDPAccountant()
    single.history = [(1.1, 0.25, 12)]
    reference = single.get_epsilon(delta=DELTA)
    assert state.history == ((1.1, 0.25, 12),)
    assert state.total_steps == 12
    assert persisted == pytest.approx(reference, rel=1e-9)
    assert stats["epsilon_spent"] == pytest.approx(reference, rel=1e-9)
    assert 0 < persisted < math.inf

    # The same training without interruption: our one round of 12 steps, and a plain Opacus
    # PrivacyEngine (q = 1/len(loader) = 1/4 under its own Poisson sampling) for 12 steps.
    stats_once, _ = train_dp_sgd(
        tiny_model(),
        examples,
        pad_token_id=PAD,
        settings=settings(steps_per_round=12, total_rounds=1),
        state=AccountantState(),
    )
    assert stats_once["epsilon_spent"] == pytest.approx(reference, rel=1e-9)

    net = torch.nn.Linear(3, 1)
    data = DataLoader(TensorDataset(torch.randn(8, 3), torch.randn(8, 1)), batch_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Secure RNG turned off"
        engine = PrivacyEngine(accountant="rdp")
        net, optimizer, data = engine.make_private(
            module=net,
            optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
            data_loader=data,
            noise_multiplier=1.1,
            max_grad_norm=1.0,
            poisson_sampling=True,
        )
        for _ in range(3):
            for x, y in data:
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(net(x), y).backward()
                optimizer.step()
    assert engine.accountant.history == [(1.1, 0.25, 12)]
    assert engine.get_epsilon(DELTA) == pytest.approx(persisted, rel=1e-9)


def test_accountant_state_json_and_validation() -> None:
    state = AccountantState().record(noise_multiplier=0.7, sample_rate=0.1, steps=5)
    state = state.record(noise_multiplier=0.9, sample_rate=0.1, steps=2)
    assert state.history == ((0.7, 0.1, 5), (0.9, 0.1, 2))
    assert AccountantState.from_json(state.to_json()) == state
    accountant = RDPAccountant()
    for sigma, steps in ((0.7, 5), (0.9, 2)):
        for _ in range(steps):
            accountant.step(noise_multiplier=sigma, sample_rate=0.1)
    assert state.epsilon(DELTA) == pytest.approx(accountant.get_epsilon(DELTA), rel=1e-12)
    assert AccountantState().epsilon(DELTA) == 0.0
    for bad in ("[]", '{"mechanism": "prv", "history": []}', '{"mechanism": "rdp"}', "nope"):
        with pytest.raises(ValueError):
            AccountantState.from_json(bad)
    with pytest.raises(ValueError):
        AccountantState.from_json('{"mechanism": "rdp", "history": [[1.0, 1.5, 3]]}')


def test_calibrated_noise_meets_target_epsilon_over_all_rounds() -> None:
    target = 2.0
    sigma = calibrate_noise_multiplier(
        epsilon=target, delta=DELTA, sample_rate=0.25, total_steps=12
    )
    accountant = RDPAccountant()
    accountant.history = [(sigma, 0.25, 12)]
    eps = accountant.get_epsilon(DELTA)
    assert 0.99 * target <= eps <= target

    config = settings(epsilon=target, noise_multiplier=None)
    assert config.resolved_noise_multiplier() == sigma
    model, examples, state = tiny_model(), make_examples(8), AccountantState()
    spent = []
    for _ in range(config.total_rounds):
        stats, state = train_dp_sgd(model, examples, pad_token_id=PAD, settings=config, state=state)
        spent.append(stats["epsilon_spent"])
        assert stats["noise_multiplier"] == sigma
    assert spent[0] < spent[1] < spent[2]
    assert spent[-1] == pytest.approx(eps, rel=1e-9)
    assert 0.99 * target <= spent[-1] <= target
    with pytest.raises(ValueError, match="planned"):  # a 4th round would exceed the budget
        train_dp_sgd(model, examples, pad_token_id=PAD, settings=config, state=state)


# ---------------------------------------------------------------- training


def test_noise_free_step_is_the_mean_of_per_example_clipped_gradients() -> None:
    """q = 1 (every example every step), σ = 0, tiny C: one SGD step must move the parameters
    by lr/N · Σ_i C·g_i/‖g_i‖ with the per-example gradients g_i from plain autograd, which is
    NOT the clipped batch gradient; and ‖Δθ‖ ≤ lr·C."""
    examples = make_examples(3, seed=1)
    lr, clip = 100.0, 1e-3  # ‖Δθ‖ ≈ 0.1: well above float32 rounding of the weights
    reference = tiny_model()
    per_example = []
    for example in examples:
        reference.zero_grad()
        token_nll(reference, collate([example], PAD)).mean().backward()
        per_example.append(torch.cat([p.grad.reshape(-1) for p in reference.parameters()]))
    expected = sum(g * (clip / (g.norm() + 1e-6)) for g in per_example) * lr / len(examples)
    batch_grad = sum(per_example) / len(examples)
    clipped_batch = batch_grad * lr * clip / batch_grad.norm()

    model = tiny_model()
    before = flat_params(model)
    config = settings(
        noise_multiplier=0.0,
        sample_rate=1.0,
        max_grad_norm=clip,
        lr=lr,
        steps_per_round=1,
        total_rounds=1,
    )
    stats, _ = train_dp_sgd(
        model, examples, pad_token_id=PAD, settings=config, state=AccountantState()
    )
    step = before - flat_params(model)
    assert step.norm() <= lr * clip * (1 + 1e-5)
    assert (step - expected).norm() <= 1e-3 * expected.norm()
    assert (step - clipped_batch).norm() > 0.05 * step.norm()
    assert stats["epsilon_spent"] == math.inf  # no noise, no privacy


def test_large_epsilon_learns_tiny_epsilon_does_not() -> None:
    examples = make_examples(6, seed=2)
    start = mean_loss(tiny_model(), examples)
    results = {}
    for name, sigma in (("large", 0.0), ("tiny", None)):
        model = tiny_model()
        config = settings(
            epsilon=0.5,
            noise_multiplier=sigma,
            sample_rate=0.5,
            steps_per_round=40,
            total_rounds=1,
            lr=1.0,
            max_grad_norm=1.0,
        )
        stats, _ = train_dp_sgd(
            model, examples, pad_token_id=PAD, settings=config, state=AccountantState()
        )
        results[name] = (mean_loss(model, examples), stats)
    large, tiny = results["large"][0], results["tiny"][0]
    assert large < 0.5 * start
    assert results["tiny"][1]["noise_multiplier"] > 5  # ε = 0.5 over 40 steps at q = 0.5
    assert results["tiny"][1]["epsilon_spent"] <= 0.5
    assert not tiny < 2 * large  # heavy noise: far from the memorised state (NaN-safe)


def test_model_is_unwrapped_flags_restored_and_training_deterministic() -> None:
    examples = make_examples(6, seed=3)
    only_mlp = lambda name: ".mlp." in name  # noqa: E731
    models = []
    for _ in range(2):
        model = tiny_model()
        model.model.embed_tokens.weight.requires_grad_(False)
        model.eval()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        train_dp_sgd(
            model,
            examples,
            pad_token_id=PAD,
            settings=settings(),
            state=AccountantState(),
            trainable=only_mlp,
        )
        models.append(model)
        assert type(model) is LlamaForCausalLM
        assert not model.training
        for module in model.modules():
            assert not module._forward_hooks and not module._backward_hooks
            assert not module._forward_pre_hooks
            assert not {"activations", "max_batch_len", "autograd_grad_sample_hooks"} & set(
                vars(module)
            )
        for name, p in model.named_parameters():
            assert not {"grad_sample", "_forward_counter", "summed_grad"} & set(vars(p))
            assert p.grad is None
            assert p.requires_grad == (name != "model.embed_tokens.weight")
            changed = not torch.equal(p, before[name])
            assert changed == (".mlp." in name), name
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b), name

    other = tiny_model()
    train_dp_sgd(
        other, examples, pad_token_id=PAD, settings=settings(seed=1), state=AccountantState()
    )
    assert not torch.equal(flat_params(other), flat_params(models[0]))
    # a second round gets fresh noise: same model state, different recorded steps
    round2_a, round2_b = tiny_model(), tiny_model()
    train_dp_sgd(round2_a, examples, pad_token_id=PAD, settings=settings(), state=AccountantState())
    train_dp_sgd(
        round2_b,
        examples,
        pad_token_id=PAD,
        settings=settings(),
        state=AccountantState().record(noise_multiplier=1.1, sample_rate=0.25, steps=4),
    )
    assert not torch.equal(flat_params(round2_a), flat_params(round2_b))


def test_empty_poisson_batches_do_not_crash_and_are_counted() -> None:
    examples = make_examples(3, seed=4)
    model = tiny_model()
    before = flat_params(model)
    config = settings(sample_rate=0.01, steps_per_round=6, total_rounds=1)
    stats, state = train_dp_sgd(
        model, examples, pad_token_id=PAD, settings=config, state=AccountantState()
    )
    assert stats["empty_batches"] >= 1
    assert state.total_steps == 6
    assert state.history == ((1.1, 0.01, 6),)
    assert not torch.equal(before, flat_params(model))  # noise still applied on empty batches
    if stats["empty_batches"] == 6:
        assert math.isnan(stats["loss_first"])

    # empty batches between non-empty ones (q = 0.3 on 3 examples: P(empty) = 0.343)
    config = settings(sample_rate=0.3, steps_per_round=12, total_rounds=1)
    stats, state = train_dp_sgd(
        model, examples, pad_token_id=PAD, settings=config, state=AccountantState()
    )
    assert 1 <= stats["empty_batches"] < 12
    assert math.isfinite(stats["loss_first"]) and math.isfinite(stats["loss_last"])
    assert state.history == ((1.1, 0.3, 12),)


def test_settings_validation() -> None:
    with pytest.raises(ValueError, match="sample_rate"):
        settings(sample_rate=0.0)
    with pytest.raises(ValueError, match="delta"):
        settings(delta=1.0)
    with pytest.raises(ValueError, match="epsilon"):
        settings(epsilon=math.inf, noise_multiplier=None)
    with pytest.raises(ValueError, match="noise_multiplier"):
        settings(noise_multiplier=-1.0)
    with pytest.raises(ValueError, match="steps_per_round"):
        settings(steps_per_round=0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        settings(max_grad_norm=0.0)
    with pytest.raises(ValueError, match="lr"):
        settings(lr=-0.1)
    assert settings(epsilon=math.inf, noise_multiplier=0.0).total_steps == 12
    with pytest.raises(ValueError, match="no parameter"):
        train_dp_sgd(
            tiny_model(),
            make_examples(2),
            pad_token_id=PAD,
            settings=settings(),
            state=AccountantState(),
            trainable=lambda name: False,
        )
    with pytest.raises(ValueError, match="example"):
        train_dp_sgd(
            tiny_model(), [], pad_token_id=PAD, settings=settings(), state=AccountantState()
        )
