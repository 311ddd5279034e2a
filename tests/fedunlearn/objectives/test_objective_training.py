"""A few LoRA steps of every forget objective move the forget metric the right way."""

import copy

import pytest
import torch

from fedunlearn.models.llama import new_tiny_llama, tiny_llama_config
from fedunlearn.objectives.refusal import refusal_examples
from fedunlearn.objectives.representation import steering_direction
from fedunlearn.qa_format import encode_qa
from fedunlearn.training.batching import collate, token_nll
from fedunlearn.training.full import train_full
from fedunlearn.training.lora import LocalTrainSettings, LoraSettings, train_lora_task_vector

LORA = LoraSettings(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def setup(tiny_tokenizer, tiny_data):
    """A tiny Llama that has learnt 6 forget and 12 retain QA pairs a little."""
    tok = tiny_tokenizer
    config = tiny_llama_config(
        len(tok),
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = new_tiny_llama(config, seed=0)
    forget_records = tiny_data.author_qa[:6]
    retain_records = tiny_data.author_qa[20:32]
    forget = [encode_qa(tok, r["question"], r["answer"]) for r in forget_records]
    retain = [encode_qa(tok, r["question"], r["answer"]) for r in retain_records]
    refusals = refusal_examples(tok, [r["question"] for r in forget_records], seed=0)
    torch.manual_seed(0)
    train_full(
        model,
        forget + retain,
        pad_token_id=tok.pad_token_id,
        epochs=30,
        lr=3e-3,
        batch_size=6,
        show_progress=False,
    )
    model.eval()
    return model, forget, retain, refusals, tok.pad_token_id


def _nll(model, examples, pad):
    with torch.no_grad():
        return token_nll(model, collate(examples, pad)).mean().item()


def _train_and_apply(setup, objective, steps=10, lr=5e-3, options=None, **data):
    model, forget, _, _, pad = setup
    received = copy.deepcopy(model)
    tv, _ = train_lora_task_vector(
        received,
        forget,
        pad_token_id=pad,
        lora=LORA,
        train=LocalTrainSettings(
            objective=objective, steps=steps, lr=lr, batch_size=6, seed=0, options=options or {}
        ),
        **data,
    )
    updated = copy.deepcopy(model)
    with torch.no_grad():
        params = dict(updated.named_parameters())
        for k, v in tv.items():
            params[k] += v
    return updated


@pytest.mark.parametrize(
    "objective", ["ga", "graddiff", "npo", "simnpo", "undial", "satimp", "kl", "dpo", "idk"]
)
def test_forget_objectives_move_the_right_way(setup, objective):
    model, forget, retain, refusals, pad = setup
    # DPO first raises the refusal likelihood, then (many more steps) pushes both answers
    # down ("likelihood displacement"): check its early phase
    steps, lr = (5, 3e-3) if objective == "dpo" else (10, 5e-3)
    updated = _train_and_apply(
        setup, objective, steps=steps, lr=lr, retain_examples=retain, alternate_examples=refusals
    )
    forget_before, forget_after = _nll(model, forget, pad), _nll(updated, forget, pad)
    idk_before, idk_after = _nll(model, refusals, pad), _nll(updated, refusals, pad)
    if objective != "idk":
        assert forget_after > forget_before + 0.05, (forget_before, forget_after)
    if objective in ("idk", "dpo"):
        assert idk_after < idk_before - 0.05, (idk_before, idk_after)


def test_retain_terms_protect_the_retain_data(setup):
    model, _, retain, _, pad = setup
    ga = _nll(_train_and_apply(setup, "ga"), retain, pad)
    for objective in ("graddiff", "kl"):
        updated = _train_and_apply(setup, objective, retain_examples=retain)
        assert _nll(updated, retain, pad) < 0.5 * ga, objective


def _layer_states(model, examples, pad, layer):
    batch = collate(examples, pad)
    with torch.no_grad():
        out = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            output_hidden_states=True,
        )
    return out.hidden_states[layer + 1], batch["attention_mask"].bool()


def _mean_sq(a, b, mask):
    return ((a - b) ** 2).mean(dim=-1)[mask].mean().item()


def test_rmu_steers_forget_activations(setup):
    model, forget, retain, _, pad = setup
    layer, c = 0, 6.5
    updated = _train_and_apply(
        setup, "rmu", options={"rmu_layer": layer, "rmu_steering": c}, retain_examples=retain
    )
    h_before, fmask = _layer_states(model, forget, pad, layer)
    h_after, _ = _layer_states(updated, forget, pad, layer)
    target = c * steering_direction(h_before.size(-1), 0)
    assert _mean_sq(h_after, target, fmask) < 0.9 * _mean_sq(h_before, target, fmask)
    r_before, rmask = _layer_states(model, retain, pad, layer)
    r_after, _ = _layer_states(updated, retain, pad, layer)
    assert _mean_sq(r_after, r_before, rmask) < 0.5 * _mean_sq(h_after, h_before, fmask)


@pytest.mark.parametrize(
    "objective,missing",
    [
        ("graddiff", "retain"),
        ("kl", "retain"),
        ("rmu", "retain"),
        ("dpo", "alternate"),
        ("idk", "alternate"),
    ],
)
def test_missing_data_is_an_error_before_training(tiny_model, tiny_tokenizer, objective, missing):
    examples = [encode_qa(tiny_tokenizer, "q?", "a.")]
    state = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    with pytest.raises(ValueError, match=f"objective '{objective}' needs {missing}"):
        train_lora_task_vector(
            tiny_model,
            examples,
            pad_token_id=tiny_tokenizer.pad_token_id,
            lora=LORA,
            train=LocalTrainSettings(objective=objective, steps=1, lr=1e-3),
        )
    # nothing was wrapped or changed
    assert all(torch.equal(v, state[k]) for k, v in tiny_model.state_dict().items())
    assert not any("lora" in name for name, _ in tiny_model.named_modules())


def test_misaligned_alternates_are_an_error(tiny_model, tiny_tokenizer):
    examples = [encode_qa(tiny_tokenizer, "q?", "a.")] * 2
    with pytest.raises(ValueError, match="alternate_examples has 1 entries for 2"):
        train_lora_task_vector(
            tiny_model,
            examples,
            pad_token_id=tiny_tokenizer.pad_token_id,
            lora=LORA,
            train=LocalTrainSettings(objective="dpo", steps=1, lr=1e-3),
            alternate_examples=examples[:1],
        )


def test_unknown_objective_is_a_key_error(tiny_model, tiny_tokenizer):
    with pytest.raises(KeyError, match="unknown objective 'nope'.*npo"):
        train_lora_task_vector(
            tiny_model,
            [encode_qa(tiny_tokenizer, "q?", "a.")],
            pad_token_id=tiny_tokenizer.pad_token_id,
            lora=LORA,
            train=LocalTrainSettings(objective="nope", steps=1, lr=1e-3),
        )
