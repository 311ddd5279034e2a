"""Saved client uploads reload bit-identically and re-merge to the same delta."""

import pytest
import torch

from fedunlearn.merging import ClientUpdate, firm_merge
from fedunlearn.uploads import load_uploads, save_uploads


def _update(i, role, domain):
    g = torch.Generator().manual_seed(i)
    tv = {"l.0.w": torch.randn(4, 3, generator=g), "l.1.w": torch.randn(2, 2, generator=g)}
    fisher = {k: torch.rand(v.shape, generator=g) for k, v in tv.items()}
    return ClientUpdate(
        node_id=1000 + i,
        role=role,
        domain=domain,
        num_examples=3 + i,
        task_vector=tv,
        fisher=fisher,
    )


def test_roundtrip_and_remerge(tmp_path):
    updates = [_update(0, "forget", "a"), _update(1, "forget", "a"), _update(2, "retain", "r")]
    save_uploads(updates, tmp_path / "up")
    loaded = load_uploads(tmp_path / "up")
    assert [(u.node_id, u.role, u.domain, u.num_examples) for u in loaded] == [
        (str(u.node_id), u.role, u.domain, u.num_examples) for u in updates
    ]
    for a, b in zip(updates, loaded, strict=True):
        assert all(torch.equal(a.task_vector[k], b.task_vector[k]) for k in a.task_vector)
        assert all(torch.equal(a.fisher[k], b.fisher[k]) for k in a.fisher)
    d1 = firm_merge(updates, gamma=2.0, epsilon=0.05).delta
    d2 = firm_merge(loaded, gamma=2.0, epsilon=0.05).delta
    assert all(torch.equal(d1[k], d2[k]) for k in d1)


def test_missing_manifest(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a saved-uploads folder"):
        load_uploads(tmp_path)
