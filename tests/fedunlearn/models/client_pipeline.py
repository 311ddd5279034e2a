"""The client's pipeline on a model, as both model-family tests check it: the weights rebuilt
from the wire give the same logits, and the Fisher and a LoRA task vector cover every
adapted weight."""

import torch

from fedunlearn.fisher import empirical_fisher_diagonal
from fedunlearn.training.lora import LocalTrainSettings, train_lora_task_vector
from wire.messages import rebuild_model, wire_state


def check_client_pipeline(model, tokenizer, examples, lora, names, config, batch_size) -> None:
    rebuilt = rebuild_model(config, wire_state(model))  # as a client rebuilds it
    x = torch.tensor([examples[0][0]])
    with torch.no_grad():
        assert torch.equal(rebuilt(x).logits, model(x).logits)
    fisher = empirical_fisher_diagonal(model, examples, names, pad_token_id=tokenizer.pad_token_id)
    task_vector, _ = train_lora_task_vector(
        model,
        examples,
        pad_token_id=tokenizer.pad_token_id,
        lora=lora,
        train=LocalTrainSettings(objective="ga", steps=2, lr=1e-3, batch_size=batch_size),
    )
    assert sorted(fisher) == sorted(task_vector) == sorted(names)
    for name in names:
        assert task_vector[name].shape == fisher[name].shape == model.get_parameter(name).shape
        assert torch.isfinite(task_vector[name]).all() and task_vector[name].abs().sum() > 0
        assert (fisher[name] >= 0).all() and fisher[name].sum() > 0
