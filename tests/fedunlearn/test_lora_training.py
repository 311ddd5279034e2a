"""LoRA local training returns dense task vectors that move the loss the right way."""

import pytest
import torch

from fedunlearn.qa_format import encode_qa
from fedunlearn.training.batching import collate, token_nll
from fedunlearn.training.lora import (
    ALL_LLAMA_PROJECTIONS,
    LocalTrainSettings,
    LoraSettings,
    adapted_parameter_names,
    train_lora_task_vector,
)


def _nll(model, examples, pad):
    with torch.no_grad():
        return token_nll(model, collate(examples, pad)).mean().item()


def _apply(model, task_vector, scale=1.0):
    with torch.no_grad():
        params = dict(model.named_parameters())
        for k, v in task_vector.items():
            params[k] += scale * v


@pytest.mark.parametrize("objective,direction", [("nll", -1), ("ga", +1)])
def test_task_vector_moves_loss(tiny_model, tiny_tokenizer, tiny_data, objective, direction):
    pad = tiny_tokenizer.pad_token_id
    examples = [
        encode_qa(tiny_tokenizer, r["question"], r["answer"]) for r in tiny_data.author_qa[:6]
    ]
    before_state = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    before = _nll(tiny_model, examples, pad)
    lora = LoraSettings(rank=4, alpha=8.0)
    tv, stats = train_lora_task_vector(
        tiny_model,
        examples,
        pad_token_id=pad,
        lora=lora,
        train=LocalTrainSettings(objective=objective, steps=15, lr=5e-3, batch_size=6, seed=1),
    )
    # the adapter is gone and the received weights are untouched
    for k, v in tiny_model.state_dict().items():
        assert torch.equal(v, before_state[k]), k
    assert sorted(tv) == sorted(adapted_parameter_names(tiny_model, lora))
    assert len(tv) == 2 * 7  # 2 layers × 7 projections
    params = dict(tiny_model.named_parameters())
    for k, v in tv.items():
        assert v.shape == params[k].shape and v.dtype == torch.float32
        assert torch.linalg.matrix_rank(v) <= 4  # s·B@A has rank ≤ r
    assert any(v.abs().max() > 0 for v in tv.values())
    _apply(tiny_model, tv)
    after = _nll(tiny_model, examples, pad)
    assert direction * (after - before) > 0.05, (before, after)
    assert stats["steps"] == 15


def test_training_is_deterministic(tiny_model, tiny_tokenizer, tiny_data):
    pad = tiny_tokenizer.pad_token_id
    examples = [
        encode_qa(tiny_tokenizer, r["question"], r["answer"]) for r in tiny_data.author_qa[:4]
    ]
    settings = LocalTrainSettings(objective="ga", steps=3, lr=1e-3, batch_size=2, seed=5)
    lora = LoraSettings(rank=2, alpha=4.0)
    a, _ = train_lora_task_vector(tiny_model, examples, pad_token_id=pad, lora=lora, train=settings)
    b, _ = train_lora_task_vector(tiny_model, examples, pad_token_id=pad, lora=lora, train=settings)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_unknown_objective_is_a_clear_error(tiny_model, tiny_tokenizer, tiny_data):
    examples = [encode_qa(tiny_tokenizer, "q?", "a.")]
    with pytest.raises(KeyError, match="unknown objective 'nope'.*ga"):
        train_lora_task_vector(
            tiny_model,
            examples,
            pad_token_id=tiny_tokenizer.pad_token_id,
            lora=LoraSettings(),
            train=LocalTrainSettings(objective="nope", steps=1, lr=1e-3),
        )


@pytest.mark.parametrize(
    "targets,layers,expected",
    [
        (
            ALL_LLAMA_PROJECTIONS,
            None,
            [
                f"model.layers.{i}.{block}.{proj}.weight"
                for i in range(2)
                for block, proj in [
                    ("self_attn", p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")
                ]
                + [("mlp", p) for p in ("gate_proj", "up_proj", "down_proj")]
            ],
        ),
        (("down_proj",), (1,), ["model.layers.1.mlp.down_proj.weight"]),
        (
            ("layers.1.mlp.down_proj", "self_attn.q_proj"),
            None,
            [
                "model.layers.0.self_attn.q_proj.weight",
                "model.layers.1.self_attn.q_proj.weight",
                "model.layers.1.mlp.down_proj.weight",
            ],
        ),
    ],
)
def test_adapted_names_match_the_task_vector(tiny_model, tiny_tokenizer, targets, layers, expected):
    pad = tiny_tokenizer.pad_token_id
    lora = LoraSettings(rank=2, alpha=4.0, target_modules=targets, layers_to_transform=layers)
    names = adapted_parameter_names(tiny_model, lora)
    assert sorted(names) == sorted(expected)
    tv, _ = train_lora_task_vector(
        tiny_model,
        [encode_qa(tiny_tokenizer, "q?", "a.")],
        pad_token_id=pad,
        lora=lora,
        train=LocalTrainSettings(objective="ga", steps=1, lr=1e-3),
    )
    assert sorted(tv) == sorted(names)


def test_no_matching_target_is_a_clear_error(tiny_model):
    lora = LoraSettings(target_modules=("down_proj",), layers_to_transform=(7,))
    with pytest.raises(ValueError, match=r"no Linear module matches.*down_proj.*layers \[7\]"):
        adapted_parameter_names(tiny_model, lora)


def test_options_and_retain_data_reach_the_objective(tiny_model, tiny_tokenizer, tiny_data):
    """GradDiff with α = 0 (option) is GA; retain batches are seeded (deterministic runs)."""
    pad = tiny_tokenizer.pad_token_id
    qa = [encode_qa(tiny_tokenizer, r["question"], r["answer"]) for r in tiny_data.author_qa[:9]]
    forget, retain = qa[:3], qa[3:]
    lora = LoraSettings(rank=2, alpha=4.0)

    def run(objective, **options):
        settings = LocalTrainSettings(
            objective=objective, steps=3, lr=1e-3, batch_size=2, seed=2, options=options
        )
        return train_lora_task_vector(
            tiny_model, forget, pad_token_id=pad, lora=lora, train=settings, retain_examples=retain
        )[0]

    ga = run("ga")
    assert all(torch.equal(ga[k], v) for k, v in run("graddiff", graddiff_alpha=0.0).items())
    a, b = run("graddiff"), run("graddiff")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], ga[k]) for k in a)
    # the received model comes back untouched, trainable, in its mode
    assert all(p.requires_grad for p in tiny_model.parameters())
    assert not any("lora" in name for name, _ in tiny_model.named_modules())


@pytest.mark.parametrize("objective", ["ga", "npo"])
def test_recomputed_activations_give_the_same_task_vector(
    objective, tiny_model, tiny_tokenizer, tiny_data
):
    """Activation checkpointing runs every decoder layer again in the backward pass and keeps
    its activations only then; the task vector is the same bit for bit (NPO: its frozen
    reference pass, the adapter disabled, runs without gradients and is not recomputed)."""
    pad = tiny_tokenizer.pad_token_id
    examples = [
        encode_qa(tiny_tokenizer, r["question"], r["answer"]) for r in tiny_data.author_qa[:6]
    ]
    mlp = tiny_model.model.layers[0].mlp  # inside the layer: run again when it is recomputed
    calls = 0

    def count(*_args) -> None:
        nonlocal calls
        calls += 1

    hook = mlp.register_forward_pre_hook(count)
    results = {}
    try:
        for on in (False, True):
            calls = 0
            settings = LocalTrainSettings(
                objective=objective,
                steps=3,
                lr=5e-3,
                batch_size=3,
                seed=2,
                activation_checkpointing=on,
            )
            tv, _ = train_lora_task_vector(
                tiny_model,
                examples,
                pad_token_id=pad,
                lora=LoraSettings(rank=4, alpha=8.0),
                train=settings,
            )
            results[on] = (tv, calls)
    finally:
        hook.remove()
    (plain, plain_calls), (recomputed, recomputed_calls) = results[False], results[True]
    trained_passes = 3  # one forward pass per step with gradients
    assert recomputed_calls == plain_calls + trained_passes, (plain_calls, recomputed_calls)
    assert not tiny_model.is_activation_checkpointing  # off again afterwards
    assert sorted(plain) == sorted(recomputed)
    for key in plain:
        assert torch.equal(plain[key], recomputed[key]), key


def test_a_model_that_cannot_recompute_its_activations_is_a_clear_error(tiny_tokenizer):
    class Plain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = torch.nn.Linear(4, 4)

    with pytest.raises(ValueError, match="activation-checkpointing = 'off'"):
        from fedunlearn.training.local_loop import recomputed_activations

        with recomputed_activations(Plain(), True):
            pass
