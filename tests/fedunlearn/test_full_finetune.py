"""Full fine-tuning of the targeted weights: dense task vectors, the received weights kept."""

import math

import pytest
import torch

from fedunlearn.qa_format import encode_qa
from fedunlearn.training.batching import collate, token_nll
from fedunlearn.training.full_finetune import train_full_task_vector
from fedunlearn.training.lora import LocalTrainSettings

TARGETS = ["model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.q_proj.weight"]


def _examples(tokenizer, data, n=6):
    return [encode_qa(tokenizer, r["question"], r["answer"]) for r in data.author_qa[:n]]


def _nll(model, examples, pad):
    with torch.no_grad():
        return token_nll(model, collate(examples, pad)).mean().item()


@pytest.mark.parametrize("objective,direction", [("nll", -1), ("ga", +1)])
def test_full_task_vector_moves_only_the_targets(
    tiny_model, tiny_tokenizer, tiny_data, objective, direction
):
    pad = tiny_tokenizer.pad_token_id
    examples = _examples(tiny_tokenizer, tiny_data)
    before_state = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    flags = {k: p.requires_grad for k, p in tiny_model.named_parameters()}
    before = _nll(tiny_model, examples, pad)
    tv, stats = train_full_task_vector(
        tiny_model,
        examples,
        pad_token_id=pad,
        target_names=TARGETS,
        train=LocalTrainSettings(objective=objective, steps=10, lr=2e-3, batch_size=6, seed=1),
    )
    for k, v in tiny_model.state_dict().items():  # handed back with the received weights
        assert torch.equal(v, before_state[k]), k
    assert {k: p.requires_grad for k, p in tiny_model.named_parameters()} == flags
    assert sorted(tv) == sorted(TARGETS)
    for name in TARGETS:
        assert tv[name].shape == before_state[name].shape and tv[name].dtype == torch.float32
        # a dense update, not a low-rank one
        assert torch.linalg.matrix_rank(tv[name]) > 16
    with torch.no_grad():
        params = dict(tiny_model.named_parameters())
        for k, v in tv.items():
            params[k] += v
    after = _nll(tiny_model, examples, pad)
    assert direction * (after - before) > 0.05, (before, after)
    assert stats["steps"] == 10


def test_reference_is_the_received_copy(tiny_model, tiny_tokenizer, tiny_data):
    """NPO's first loss is (2/β)·ln 2 exactly when π_ref equals the model at step 0."""
    pad = tiny_tokenizer.pad_token_id
    beta = 0.1
    _, stats = train_full_task_vector(
        tiny_model,
        _examples(tiny_tokenizer, tiny_data),
        pad_token_id=pad,
        target_names=TARGETS,
        train=LocalTrainSettings(
            objective="npo", steps=3, lr=2e-3, batch_size=6, seed=0, options={"npo_beta": beta}
        ),
    )
    assert stats["loss_first"] == pytest.approx(2 / beta * math.log(2), rel=1e-5)
    assert stats["loss_last"] < stats["loss_first"]


def test_unknown_target_is_a_clear_error(tiny_model, tiny_tokenizer, tiny_data):
    with pytest.raises(ValueError, match="not in the model"):
        train_full_task_vector(
            tiny_model,
            _examples(tiny_tokenizer, tiny_data),
            pad_token_id=tiny_tokenizer.pad_token_id,
            target_names=["model.layers.9.mlp.down_proj.weight"],
            train=LocalTrainSettings(objective="ga", steps=1, lr=1e-3),
        )
