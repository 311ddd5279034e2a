"""The client lets go of its dense Fisher as it encodes it, before local training."""

import pytest
import torch
from flwr.app import ConfigRecord

from clients.client_app import encoded_fisher
from fedunlearn.upload_codec import encode_fisher


@pytest.mark.parametrize(("form", "fraction"), [("topk", 0.1), ("bf16", 1.0), ("dense", 1.0)])
def test_encoded_fisher_empties_the_dense_fisher_into_the_same_parts(form, fraction):
    g = torch.Generator().manual_seed(0)
    fisher = {f"w{i}": torch.rand(32, 48, generator=g) ** 2 for i in range(3)}
    expected = encode_fisher(fisher, form, fraction)
    config = ConfigRecord({"fisher-upload": form, "fisher-upload-fraction": fraction})
    parts = encoded_fisher(dict(fisher), config)
    assert list(parts) == list(expected)
    assert all(torch.equal(parts[k], expected[k]) for k in expected)
    dense = dict(fisher)
    encoded_fisher(dense, config)
    assert dense == {}  # every dense tensor was taken out as it was encoded
