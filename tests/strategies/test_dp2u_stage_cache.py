"""The dp2u server's stage cache: keys, atomic durable saves, crash leftovers, damaged entries,
entries of earlier versions, and two real processes saving at once."""

import json
import logging
import subprocess
import sys
from pathlib import Path

import torch

from strategies.stage_cache import StageCache

ROOT = Path(__file__).resolve().parents[2]


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
    assert sorted(p.name for p in cache.folder.iterdir()) == [".stage-cache.lock", "k1"]
    assert sorted(p.name for p in (cache.folder / "k1").iterdir()) == [
        "info.json",
        "manifest.json",
        "model.safetensors",
    ]
    assert cache.load("other") is None


def test_a_half_written_stage_is_not_a_cached_stage(tmp_path):
    cache = StageCache(tmp_path / "dp2u")
    # what a crash during save leaves: the temporary folder, weights without info.json
    tmp = cache.folder / "k2.tmp-4711-0123abcd"
    tmp.mkdir(parents=True)
    (tmp / "model.safetensors").write_bytes(b"partial")
    assert cache.load("k2") is None
    cache.save("k2", {"w": torch.ones(2)}, {"rounds": 1})  # a rerun removes the leftover
    assert torch.equal(cache.load("k2")[0]["w"], torch.ones(2))
    assert not tmp.exists()


def test_saving_a_stage_that_is_there_keeps_it(tmp_path):
    cache = StageCache(tmp_path / "dp2u")
    cache.save("k", {"w": torch.ones(2)}, {"run": 1})
    (cache.folder / "k" / "eval-0123456789abcdef.json").write_text("{}")
    cache.save("k", {"w": torch.ones(2)}, {"run": 2})  # another run finished it too
    assert cache.load("k")[1] == {"run": 1}
    assert (cache.folder / "k" / "eval-0123456789abcdef.json").is_file()


def test_a_damaged_stage_is_retrained_alone(tmp_path, caplog):
    cache = StageCache(tmp_path / "dp2u")
    cache.save("a", {"w": torch.ones(4)}, {"stage": "a"})
    cache.save("b", {"w": torch.zeros(4)}, {"stage": "b"})
    weights = cache.folder / "a" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4] + b"\xff\xff\xff\xff")  # same size, NaN
    evaluation = cache.folder / "a" / "eval-0123456789abcdef.json"
    evaluation.write_text("{}")  # computed from the old weights
    with caplog.at_level(logging.WARNING):
        assert cache.load("a") is None
    assert str(weights) in caplog.text and "damaged" in caplog.text
    assert cache.load("b")[1] == {"stage": "b"}  # the other entry is kept
    cache.save("a", {"w": torch.ones(4)}, {"stage": "a", "again": True})
    state, info = cache.load("a")
    assert torch.equal(state["w"], torch.ones(4)) and info["again"]
    assert not evaluation.exists()  # the old weights' evaluation went with them


def test_an_entry_of_an_earlier_version_is_adopted_or_retrained(tmp_path, caplog):
    cache = StageCache(tmp_path / "dp2u")
    cache.save("old", {"w": torch.ones(3)}, {"stage": "old"})
    cache.save("bad", {"w": torch.ones(3)}, {"stage": "bad"})
    for key in ("old", "bad"):
        (cache.folder / key / "manifest.json").unlink()  # as the previous version wrote them
    bad = cache.folder / "bad" / "model.safetensors"
    bad.write_bytes(bad.read_bytes()[:-5])  # truncated
    stamp = (cache.folder / "old" / "model.safetensors").stat().st_mtime_ns
    with caplog.at_level(logging.INFO):
        assert cache.load("old")[1] == {"stage": "old"}
        assert cache.load("bad") is None
    manifest = json.loads((cache.folder / "old" / "manifest.json").read_text())
    assert sorted(manifest["files"]) == ["info.json", "model.safetensors"]
    assert (cache.folder / "old" / "model.safetensors").stat().st_mtime_ns == stamp
    assert "(written before manifests) does not load" in caplog.text
    assert str(cache.folder / "bad") in caplog.text


SAVER = """
import sys
from pathlib import Path
import torch
from strategies.stage_cache import StageCache
cache = StageCache(Path(sys.argv[1]))
sys.stdin.readline()  # both processes start saving together
for i in range(8):
    cache.save(f"k{i}", {"w": torch.full((256, 256), float(i))}, {"i": i, "by": sys.argv[2]})
print("saved", flush=True)
"""


def test_two_processes_saving_the_same_stages_do_not_collide(tmp_path):
    folder = tmp_path / "dp2u"
    savers = [
        subprocess.Popen(
            [sys.executable, "-c", SAVER, str(folder), name],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("first", "second")
    ]
    for saver in savers:
        saver.stdin.write("go\n")
        saver.stdin.flush()
    outputs = [saver.communicate(timeout=120) for saver in savers]
    assert [p.returncode for p in savers] == [0, 0], [err[-2000:] for _, err in outputs]
    cache = StageCache(folder)
    for i in range(8):
        state, info = cache.load(f"k{i}")
        assert torch.equal(state["w"], torch.full((256, 256), float(i))) and info["i"] == i
    assert sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name) == []
