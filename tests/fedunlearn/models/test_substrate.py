"""The substrate cache: built once per config, reused, rebuilt when missing."""

import dataclasses
import json

import torch

from fedunlearn.models.substrate import SubstrateConfig, ensure_substrate, load_substrate

SMALL = SubstrateConfig(
    num_authors=20,
    qa_per_author=4,
    forget_percent=10.0,
    vocab_size=400,
    background_documents=60,
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=64,
    pretrain_epochs=1,
    knowledge_repeats=1,
    finetune_epochs=1,
    batch_size=32,
)


def test_cache_key_follows_the_config():
    assert SMALL.cache_key() == dataclasses.replace(SMALL).cache_key()
    assert SMALL.cache_key() != dataclasses.replace(SMALL, seed=1).cache_key()
    assert SMALL.cache_key() != dataclasses.replace(SMALL, finetune_epochs=2).cache_key()
    # the forget split only selects the reference model, cached per split in the same folder
    assert SMALL.cache_key() == dataclasses.replace(SMALL, forget_percent=5.0).cache_key()


def test_built_once_reused_and_rebuilt_when_missing(tmp_path):
    folder = ensure_substrate(SMALL, tmp_path, show_progress=False)
    assert folder.name == f"tofu-substrate-{SMALL.cache_key()}"
    for part in ("tokenizer", "pretrained", "knowledgeable", "reference-forget10"):
        assert (folder / part).is_dir(), part
    info = json.loads((folder / "build_info.json").read_text())
    expected = dataclasses.asdict(SMALL)
    expected.pop("forget_percent")
    expected.pop("forget_domains")
    assert info["config"] == expected
    assert 0.0 <= info["author_recall_exact_match"] <= 1.0
    assert set(info["seconds"]) == {"tokenizer_and_data", "pretraining", "knowledge_finetune"}
    stamp = (folder / "build_info.json").stat().st_mtime_ns
    assert ensure_substrate(SMALL, tmp_path, show_progress=False) == folder
    assert (folder / "build_info.json").stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name, f"{folder.name}.lock"]
    assert sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name) == []

    first = load_substrate(SMALL, tmp_path, show_progress=False)
    (folder / "build_info.json").unlink()  # a damaged entry is rebuilt ...
    second = load_substrate(SMALL, tmp_path, show_progress=False)
    x = torch.tensor([first.tokenizer("Question: Who wrote Emma?\nAnswer:")["input_ids"]])
    with torch.no_grad():  # ... to identical weights: the build is deterministic
        assert torch.equal(first.model(x).logits, second.model(x).logits)
        assert torch.equal(first.reference_model(x).logits, second.reference_model(x).logits)
    assert not torch.equal(first.model.lm_head.weight, first.reference_model.lm_head.weight)
    assert len(first.data.author_qa) == 80
    assert set(first.info["seconds"]) >= {"pretraining", "reference_finetune"}

    # another forget split adds only its reference; the knowledgeable model is reused
    stamp = (folder / "build_info.json").stat().st_mtime_ns
    other = dataclasses.replace(SMALL, forget_percent=20.0)
    third = load_substrate(other, tmp_path, show_progress=False)
    assert (folder / "reference-forget20").is_dir()
    assert (folder / "build_info.json").stat().st_mtime_ns == stamp
    with torch.no_grad():
        assert torch.equal(third.model(x).logits, second.model(x).logits)
        assert not torch.equal(third.reference_model(x).logits, second.reference_model(x).logits)
