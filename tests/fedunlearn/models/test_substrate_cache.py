"""The substrate cache on disk: damaged files rebuild only their entry, caches of earlier
versions are adopted or rebuilt, and two real processes building at once build once."""

import dataclasses
import json
import logging
import subprocess
import sys
from pathlib import Path

import torch

from fedunlearn.models.substrate import SubstrateConfig, ensure_substrate, load_substrate

ROOT = Path(__file__).resolve().parents[3]
TINY = SubstrateConfig(  # builds in seconds
    num_authors=10,
    qa_per_author=2,
    forget_percent=10.0,
    vocab_size=300,
    background_documents=20,
    hidden_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=32,
    pretrain_epochs=1,
    knowledge_repeats=1,
    finetune_epochs=1,
)


def _stamps(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*.safetensors")}


def _logits(substrate) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.tensor([substrate.tokenizer("Question: Who wrote Emma?\nAnswer:")["input_ids"]])
    with torch.no_grad():
        return substrate.model(x).logits, substrate.reference_model(x).logits


def test_a_damaged_file_rebuilds_only_its_entry(tmp_path, caplog):
    first = load_substrate(TINY, tmp_path, show_progress=False)
    want = _logits(first)  # now: the loaded models may map the files that get damaged
    folder = first.folder
    reference = folder / "reference-forget10"
    stamps = _stamps(folder)

    weights = folder / "knowledgeable" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated
    with caplog.at_level(logging.WARNING):
        second = load_substrate(TINY, tmp_path, show_progress=False)
    assert f"{weights}: " in caplog.text and "rebuilding this entry" in caplog.text
    after = _stamps(folder)
    assert after["knowledgeable/model.safetensors"] != stamps["knowledgeable/model.safetensors"]
    assert (
        after["reference-forget10/model.safetensors"]
        == stamps["reference-forget10/model.safetensors"]
    )  # the reference is kept
    assert all(torch.equal(a, b) for a, b in zip(want, _logits(second), strict=True))

    caplog.clear()
    reference_weights = reference / "model.safetensors"
    data = reference_weights.read_bytes()
    reference_weights.write_bytes(data[:-4] + b"\xff\xff\xff\xff")  # same size, a NaN
    stamps = _stamps(folder)
    with caplog.at_level(logging.WARNING):
        third = load_substrate(TINY, tmp_path, show_progress=False)
    assert f"{reference_weights}: its sha256 differs" in caplog.text
    after = _stamps(folder)
    assert after["knowledgeable/model.safetensors"] == stamps["knowledgeable/model.safetensors"]
    assert (
        after["reference-forget10/model.safetensors"]
        != stamps["reference-forget10/model.safetensors"]
    )
    assert all(torch.isfinite(p).all() for p in third.reference_model.parameters())
    assert torch.equal(_logits(third)[1], want[1])
    assert json.loads((folder / "manifest.json").read_text())["files"]
    assert json.loads((reference / "manifest.json").read_text())["files"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name, f"{folder.name}.lock"]


def test_a_cache_of_an_earlier_version_is_adopted_or_rebuilt(tmp_path, caplog):
    folder = ensure_substrate(TINY, tmp_path, show_progress=False)
    reference = folder / "reference-forget10"
    for entry in (folder, reference):
        (entry / "manifest.json").unlink()  # as the previous version wrote them
    stamps = _stamps(folder)
    with caplog.at_level(logging.INFO):
        ensure_substrate(TINY, tmp_path, show_progress=False)
    assert _stamps(folder) == stamps  # adopted, not rebuilt
    manifest = json.loads((folder / "manifest.json").read_text())
    assert "knowledgeable/model.safetensors" in manifest["files"]
    assert not any(name.startswith("reference-") for name in manifest["files"])
    assert "(written before manifests) loads: manifest written" in caplog.text

    caplog.clear()
    (folder / "manifest.json").unlink()
    pretrained = folder / "pretrained" / "model.safetensors"
    pretrained.write_bytes(pretrained.read_bytes()[:-100])
    with caplog.at_level(logging.WARNING):
        ensure_substrate(TINY, tmp_path, show_progress=False)
    assert f"cached substrate in {folder} (written before manifests) does not load" in caplog.text
    assert (
        _stamps(folder)["reference-forget10/model.safetensors"]
        == stamps["reference-forget10/model.safetensors"]
    )
    assert json.loads((folder / "manifest.json").read_text())["files"]


BUILDER = """
import json, logging, os, sys
from pathlib import Path
from fedunlearn.models.substrate import SubstrateConfig, ensure_substrate
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s: %(message)s")
config = SubstrateConfig(**json.loads(sys.argv[2]))
sys.stdin.readline()  # both processes start building together
folder = ensure_substrate(config, Path(sys.argv[1]), show_progress=False)
print("ready:", folder, flush=True)
print("inode:", os.stat(folder / "knowledgeable" / "model.safetensors").st_ino, flush=True)
"""


def test_two_processes_building_the_same_substrate_build_it_once(tmp_path):
    config = json.dumps(dataclasses.asdict(TINY))
    builders = [
        subprocess.Popen(
            [sys.executable, "-c", BUILDER, str(tmp_path), config],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for builder in builders:
        builder.stdin.write("go\n")
        builder.stdin.flush()
    outputs = [builder.communicate(timeout=300) for builder in builders]
    assert [b.returncode for b in builders] == [0, 0], [err[-3000:] for _, err in outputs]
    text = "".join(out for out, _ in outputs)
    folder = tmp_path / f"tofu-substrate-{TINY.cache_key()}"
    assert text.count(f"ready: {folder}") == 2
    inodes = {line for line in text.splitlines() if line.startswith("inode:")}
    final = (folder / "knowledgeable" / "model.safetensors").stat().st_ino
    assert inodes == {f"inode: {final}"}  # both use the one model built, none was replaced
    assert text.count("building the substrate") == 1
    assert text.count("building the reference model") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name, f"{folder.name}.lock"]
