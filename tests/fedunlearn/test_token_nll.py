"""token_nll reads the logits in place (labels shifted onto them) and gives, bit for bit, the
values and gradients of the sliced form it replaced."""

import torch

from fedunlearn.models.llama import new_tiny_llama, tiny_llama_config
from fedunlearn.training.batching import token_nll


def sliced_nll(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    shift_logits, shift_labels = logits[:, :-1].float(), batch["labels"][:, 1:]
    nll = torch.nn.functional.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)),
        shift_labels.reshape(-1),
        ignore_index=-100,
        reduction="none",
    ).view(shift_labels.shape)
    return nll.sum(dim=1) / (shift_labels != -100).sum(dim=1).clamp(min=1)


def test_in_place_loss_equals_the_sliced_one_in_value_and_gradient():
    model = new_tiny_llama(
        tiny_llama_config(3000, hidden_size=64, num_hidden_layers=2, intermediate_size=128), seed=0
    )
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 3000, (6, 40), generator=gen)
    labels = ids.clone()
    labels[:, :15] = -100  # prompts
    labels[2, 30:] = -100  # padding
    labels[4] = -100  # no labelled token at all: counts as one, NLL 0
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    new, old = token_nll(model, batch), sliced_nll(model, batch)
    assert torch.equal(new, old) and float(new[4]) == 0.0
    params = list(model.parameters())
    for a, b in zip(
        torch.autograd.grad(new.mean(), params),
        torch.autograd.grad(old.mean(), params),
        strict=True,
    ):
        assert torch.equal(a, b)
