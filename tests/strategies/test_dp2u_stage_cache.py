"""The dp2u server's stage cache: keys, atomic durable saves, crash leftovers."""

import torch

from strategies.dp2u_pipeline import StageCache


def test_key_is_order_free_and_sensitive_to_every_field():
    a = StageCache.key(stage="unlearn", rounds=3, clients=[[1, 2]])
    assert a == StageCache.key(clients=[[1, 2]], rounds=3, stage="unlearn")
    assert a != StageCache.key(stage="unlearn", rounds=3, clients=[[1, 3]])
    assert len(a) == 16


def test_save_then_load_round_trips_and_leaves_no_temporary(tmp_path):
    cache = StageCache(tmp_path / "dp2u")
    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(3)}
    cache.save("k1", state, {"rounds": 2, "seconds": 1.5})
    loaded, info = cache.load("k1")
    assert set(loaded) == {"w", "b"} and torch.equal(loaded["w"], state["w"])
    assert info == {"rounds": 2, "seconds": 1.5}
    assert sorted(p.name for p in cache.folder.iterdir()) == ["k1"]
    assert cache.load("other") is None


def test_a_half_written_stage_is_not_a_cached_stage(tmp_path):
    cache = StageCache(tmp_path / "dp2u")
    # what a crash during save leaves: the temporary folder, weights without info.json
    tmp = cache.folder / ".k2.tmp"
    tmp.mkdir(parents=True)
    (tmp / "model.safetensors").write_bytes(b"partial")
    assert cache.load("k2") is None
    cache.save("k2", {"w": torch.ones(2)}, {"rounds": 1})  # a rerun overwrites the leftover
    assert torch.equal(cache.load("k2")[0]["w"], torch.ones(2))
