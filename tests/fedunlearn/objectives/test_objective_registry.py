"""Registry metadata, the objective context, the reference model helper and refusals."""

import dataclasses

import pytest
import torch
from peft import LoraConfig, get_peft_model

from fedunlearn.objectives import (
    OBJECTIVES,
    ObjectiveContext,
    ObjectiveSpec,
    get_objective,
    objective_requirements,
    reference_logits,
    reference_outputs,
)
from fedunlearn.objectives.refusal import REFUSAL_TEMPLATES, refusal_answers, refusal_examples
from fedunlearn.objectives.representation import steering_direction
from fedunlearn.qa_format import encode_qa
from fedunlearn.training.batching import collate

ALL = {"nll", "ga", "graddiff", "npo", "simnpo", "dpo", "idk", "rmu", "undial", "satimp", "kl"}


def test_every_objective_is_registered_with_its_requirements():
    assert set(OBJECTIVES) == ALL
    for name in ALL:
        assert get_objective(name) is OBJECTIVES[name]
    req = {name: objective_requirements(name) for name in ALL}
    assert req["nll"] == req["ga"] == req["simnpo"] == req["satimp"] == ObjectiveSpec()
    assert req["graddiff"] == ObjectiveSpec(needs_retain=True)
    assert req["npo"] == req["undial"] == ObjectiveSpec(needs_reference=True)
    assert req["dpo"] == ObjectiveSpec(needs_alternate=True, needs_reference=True)
    assert req["idk"] == ObjectiveSpec(needs_alternate=True)
    assert req["kl"] == ObjectiveSpec(needs_retain=True, needs_reference=True)
    assert req["rmu"].needs_retain and not req["rmu"].needs_alternate
    with pytest.raises(dataclasses.FrozenInstanceError):
        req["nll"].needs_retain = True  # type: ignore[misc]


def test_unknown_objective_is_a_key_error_listing_the_names():
    for lookup in (get_objective, objective_requirements):
        with pytest.raises(KeyError, match="unknown objective 'nope'.*graddiff.*undial"):
            lookup("nope")


def test_next_retain_batch():
    with pytest.raises(
        ValueError, match="objective 'graddiff' needs retain examples on the forget"
    ):
        ObjectiveContext().next_retain_batch("graddiff")
    batch = {"input_ids": torch.zeros(1, 2, dtype=torch.long)}
    ctx = ObjectiveContext(retain_batches=iter([batch]))
    assert ctx.next_retain_batch("kl") is batch
    with pytest.raises(ValueError, match="exhausted"):
        ctx.next_retain_batch("kl")


def test_reference_of_a_peft_model_is_the_received_model(tiny_model, tiny_tokenizer):
    batch = collate([encode_qa(tiny_tokenizer, "Who?", "Someone.")], tiny_tokenizer.pad_token_id)
    with torch.no_grad():
        received = tiny_model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).logits
    peft_model = get_peft_model(
        tiny_model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"])
    )
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    adapted = peft_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    assert not torch.allclose(adapted.logits, received, atol=1e-4)
    ref = reference_logits(peft_model, batch, ObjectiveContext())
    assert not ref.requires_grad
    assert torch.allclose(ref, received, atol=1e-5)
    out = reference_outputs(peft_model, batch, ObjectiveContext(), output_hidden_states=True)
    assert len(out.hidden_states) == tiny_model.config.num_hidden_layers + 1
    # the adapter is active again afterwards
    again = peft_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    assert torch.allclose(again.logits, adapted.logits)
    peft_model.unload()


def test_reference_needs_a_model(tiny_model, tiny_tokenizer):
    batch = collate([encode_qa(tiny_tokenizer, "Who?", "Someone.")], tiny_tokenizer.pad_token_id)
    with pytest.raises(ValueError, match="reference model"):
        reference_logits(tiny_model, batch, ObjectiveContext())
    explicit = reference_logits(torch.nn.Identity(), batch, ObjectiveContext(tiny_model))
    assert explicit.shape[:2] == batch["input_ids"].shape


def test_refusal_answers_are_varied_and_seeded(tiny_tokenizer):
    assert len(set(REFUSAL_TEMPLATES)) >= 20
    questions = [f"Question {i}?" for i in range(40)]
    a = refusal_answers(questions, seed=3)
    assert a == refusal_answers(questions, seed=3)
    assert a != refusal_answers(questions, seed=4)
    assert len(a) == 40 and set(a) <= set(REFUSAL_TEMPLATES) and len(set(a)) > 5
    examples = refusal_examples(tiny_tokenizer, questions[:3], seed=3)
    assert examples == [
        encode_qa(tiny_tokenizer, q, r) for q, r in zip(questions[:3], a[:3], strict=True)
    ]


def test_steering_direction_is_a_fixed_unit_vector():
    u = steering_direction(16, 7)
    assert torch.equal(u, steering_direction(16, 7))
    assert not torch.equal(u, steering_direction(16, 8))
    assert u.shape == (16,) and (u >= 0).all()
    assert torch.linalg.vector_norm(u).item() == pytest.approx(1.0, abs=1e-6)
