"""fedunlearn.files: unique temporary names, atomic writes, manifests, cache entries, locks."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fedunlearn.files import (
    IntegrityError,
    build_entry,
    exclusive_folder,
    read_manifest,
    temp_path,
    temp_target,
    verify_manifest,
    waiting_lock,
    write_file_atomic,
    write_manifest,
)

ROOT = Path(__file__).resolve().parents[2]


def test_temporary_names_are_unique_and_recognised(tmp_path):
    target = tmp_path / "state.json"
    names = {temp_path(target).name for _ in range(50)}
    assert len(names) == 50
    assert all(n.startswith(f".state.json.tmp-{os.getpid()}-") for n in names)
    assert {temp_target(n) for n in names} == {"state.json"}
    assert temp_target("state.json") is None and temp_target(".state.json.tmp") is None


def test_atomic_write_replaces_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "secret"
    write_file_atomic(path, b"one", mode=0o600)
    write_file_atomic(path, b"two", mode=0o600)
    assert path.read_bytes() == b"two" and (path.stat().st_mode & 0o777) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["secret"]


def test_a_manifest_names_the_missing_resized_or_altered_file(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.bin").write_bytes(b"abcdef")
    (tmp_path / "b.txt").write_text("hello")
    manifest = write_manifest(tmp_path, "test")
    assert sorted(manifest["files"]) == ["b.txt", "sub/a.bin"]
    assert read_manifest(tmp_path) == manifest
    verify_manifest(tmp_path, manifest)
    (tmp_path / "sub" / "a.bin").write_bytes(b"abcdeX")  # same size
    with pytest.raises(IntegrityError, match=r"sub/a\.bin: its sha256 differs") as caught:
        verify_manifest(tmp_path, manifest)
    assert caught.value.path == tmp_path / "sub" / "a.bin"
    (tmp_path / "sub" / "a.bin").write_bytes(b"abc")
    with pytest.raises(IntegrityError, match=r"a\.bin: 3 bytes, the manifest records 6"):
        verify_manifest(tmp_path, manifest)
    (tmp_path / "b.txt").unlink()
    with pytest.raises(IntegrityError, match=r"b\.txt: missing"):
        verify_manifest(tmp_path, manifest)
    (tmp_path / "manifest.json").write_text('{"files": ')
    with pytest.raises(IntegrityError, match=r"manifest\.json: unreadable manifest"):
        read_manifest(tmp_path)


def test_rebuilding_an_entry_keeps_its_other_items(tmp_path):
    entry = tmp_path / "entry"

    def build(content: str):
        def write(folder: Path) -> None:
            folder.mkdir()
            (folder / "model.bin").write_text(content)
            (folder / "info.json").write_text(json.dumps({"content": content}))

        return write

    build_entry(entry, "info.json", "test", build("first"))
    (entry / "sub-entry").mkdir()
    (entry / "sub-entry" / "x").write_text("kept")
    (entry / "eval-1.json").write_text("stale")
    build_entry(entry, "info.json", "test", build("second"), stale=("eval-*.json",))
    assert (entry / "model.bin").read_text() == "second"
    assert (entry / "sub-entry" / "x").read_text() == "kept"
    assert not (entry / "eval-1.json").exists()
    verify_manifest(entry, read_manifest(entry))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]


LOCKER = """
import sys, time
from pathlib import Path
from fedunlearn.files import waiting_lock
with waiting_lock(Path(sys.argv[1]), "test"):
    print("locked", flush=True)
    time.sleep(float(sys.argv[2]))
    print(f"releasing {time.time()!r}", flush=True)  # last thing before the lock is let go
"""


def test_a_waiting_lock_waits_for_the_other_process(tmp_path):
    lock = tmp_path / "x.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", LOCKER, str(lock), "1.5"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline() == "locked\n"
    started = time.perf_counter()
    with waiting_lock(lock, "test"):
        acquired = time.time()
        waited = time.perf_counter() - started
    released = float(holder.stdout.readline().split()[1])
    holder.wait()
    assert acquired >= released  # this process got the lock only after the other let it go
    assert 0.5 < waited < 30


def test_an_exclusive_folder_is_refused_while_held(tmp_path):
    with exclusive_folder(tmp_path, "output-dir"):
        pid = (tmp_path / ".fedunlearn-run.lock.pid").read_text().strip()
        assert pid == str(os.getpid())
        holder = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from pathlib import Path; from fedunlearn.files import "
                "exclusive_folder\nwith exclusive_folder(Path(sys.argv[1]), 'output-dir'): pass",
                str(tmp_path),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        assert holder.returncode == 1
        assert f"FolderInUseError: output-dir {tmp_path} is in use by PID {pid}" in holder.stderr
    with exclusive_folder(tmp_path, "output-dir"):  # released: free again
        pass


def test_streamed_safetensors_are_what_safetensors_reads(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    from fedunlearn.files import save_safetensors_streamed

    gen = torch.Generator().manual_seed(0)
    shared = torch.randn(5, 3, generator=gen)
    tensors = {
        "embed": shared,
        "head": shared,  # tied: stored under each name
        "bf16": torch.randn(4, 7, generator=gen).bfloat16(),
        "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "scalar": torch.tensor(2.5),
    }
    asked: list[str] = []

    def tensor(name: str) -> torch.Tensor:
        asked.append(name)
        return tensors[name]

    path = tmp_path / "w.safetensors"
    layout = {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}
    save_safetensors_streamed(path, layout, tensor, metadata={"round": "3"})
    assert asked == list(tensors)  # each tensor asked for once, in file order
    loaded = load_file(str(path))
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in tensors.items())
    with safe_open(str(path), "pt") as handle:
        assert handle.metadata() == {"round": "3"}

    layout["bf16"] = (torch.float32, (4, 7))
    with pytest.raises(ValueError, match=r"tensor 'bf16' is torch.bfloat16 \(4, 7\), the layout"):
        save_safetensors_streamed(tmp_path / "bad.safetensors", layout, tensor)


def test_a_subset_writer_reserves_the_header_and_writes_what_safetensors_reads(tmp_path):
    """Tensors chosen while writing (any subset of the candidates, in any order): the file is
    one safetensors reads, with every tensor bit-identical; the header's room never runs out,
    not even with every candidate at the largest offsets; a failure leaves no file."""
    from safetensors.torch import load_file

    from fedunlearn.files import SafetensorsSubsetWriter, safetensors_layout

    gen = torch.Generator().manual_seed(0)
    tensors = {
        f"model.layers.{i}.mlp.weight": torch.randn(3, 4 + i, generator=gen) for i in range(12)
    }
    tensors["bf16"] = torch.randn(2, 5, generator=gen).bfloat16()
    candidates = {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}
    for chosen in ([], ["bf16", "model.layers.3.mlp.weight"], list(reversed(tensors))):
        path = tmp_path / f"subset-{len(chosen)}.safetensors"
        with SafetensorsSubsetWriter(path, candidates) as writer:
            for name in chosen:
                writer.add(name, tensors[name])
        assert writer.nbytes == sum(tensors[n].numel() * tensors[n].element_size() for n in chosen)
        loaded = load_file(str(path))
        assert list(safetensors_layout(path)) == chosen
        assert all(
            torch.equal(loaded[n], tensors[n]) and loaded[n].dtype == tensors[n].dtype
            for n in chosen
        )
        layout = safetensors_layout(path)
        assert all(entry.start % 8 == 0 for entry in list(layout.values())[:1])  # aligned data

    path = tmp_path / "failed.safetensors"
    with pytest.raises(KeyError, match="'other' is not a candidate"):
        with SafetensorsSubsetWriter(path, candidates) as writer:
            writer.add("bf16", tensors["bf16"])
            writer.add("other", tensors["bf16"])
    assert not path.exists()
    with pytest.raises(ValueError, match="'bf16' was added already"):
        with SafetensorsSubsetWriter(path, candidates) as writer:
            writer.add("bf16", tensors["bf16"])
            writer.add("bf16", tensors["bf16"])
    assert not path.exists()
