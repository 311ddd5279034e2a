"""A Fisher diagonal measured on a reparameterised copy, mapped back to the server's
coordinates: exact on permuted tensors, trace-preserving on rotated ones."""

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from fedunlearn.fisher import empirical_fisher_diagonal
from fedunlearn.mpu import ReparamDims, apply_transform, draw_transforms, invert_fisher


def test_fisher_on_a_copy_maps_back():
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    names = [n for n, _ in model.named_parameters() if n.endswith("_proj.weight")]
    gen = torch.Generator().manual_seed(1)
    examples = []
    for _ in range(6):
        ids = torch.randint(2, 97, (12,), generator=gen).tolist()
        examples.append((ids, ids))
    fisher = empirical_fisher_diagonal(model, examples, names, pad_token_id=0, num_batches=6)

    transforms = draw_transforms(
        ReparamDims.from_config(config), b"test-secret", 1, 0, 2, permute_groups=True
    )
    copy = AutoModelForCausalLM.from_config(config)
    copy.load_state_dict(apply_transform(model.state_dict(), transforms))
    on_copy = empirical_fisher_diagonal(copy, examples, names, pad_token_id=0, num_batches=6)
    mapped = invert_fisher(on_copy, transforms)
    for name in names:
        assert (mapped[name] >= 0).all(), name
        # the trace of the Fisher is invariant under orthogonal reparameterisation
        assert torch.allclose(mapped[name].sum(), fisher[name].sum(), rtol=1e-3), name
        if any(k in name for k in ("gate_proj", "up_proj", "down_proj")):  # pure permutations
            assert torch.allclose(mapped[name], fisher[name], rtol=1e-3, atol=1e-12), name
