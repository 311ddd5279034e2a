"""The streaming server: uploads go to disk as they are read, compact uploads merge exactly."""

from __future__ import annotations

import gc
import json
import math
import struct
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, Message
from safetensors import safe_open
from safetensors.torch import save_file

from fedunlearn import upload_slices
from fedunlearn.merging import ClientUpdate, firm_merge, native
from fedunlearn.merging import kernels as merge_kernels
from fedunlearn.merging._chunks import CHUNK
from fedunlearn.merging.kernels import MODE_ENV
from fedunlearn.scenarios import ClientAssignment
from fedunlearn.upload_codec import (
    DecodedTensors,
    LowRankDelta,
    deflate_mask,
    encode_fisher,
    encode_task_vector,
    inflate_mask,
)
from strategies.merge_strategy import MergeStrategy
from strategies.upload_spool import SpooledFile, UploadSpool
from tests.strategies.replies import reply_metadata
from wire.messages import encode_client_reply

Q = "model.layers.0.self_attn.q_proj.weight"
DOWN = "model.layers.0.mlp.down_proj.weight"
SHAPES = {Q: (64, 64), DOWN: (64, 96), "model.norm.weight": (64,)}
NODES = (11, 12, 13, 14)
# one forget client per domain and two retain clients: a top-α' Fisher (α' ≥ α) is exact
ASSIGNMENTS = [
    ClientAssignment("forget", "a", (0,)),
    ClientAssignment("forget", "b", (1,)),
    ClientAssignment("retain", "retain", (2,)),
    ClientAssignment("retain", "retain", (3,)),
]


def _strategy(**kwargs) -> MergeStrategy:
    strategy = MergeStrategy(
        merge="firm",
        merge_parameters={"gamma": 1.0, "alpha": 0.1, "epsilon": 1e-9},
        assignments=ASSIGNMENTS,
        **kwargs,
    )
    strategy.node_assignment = dict(zip(NODES, ASSIGNMENTS, strict=True))
    strategy.global_arrays = ArrayRecord({k: torch.zeros(s) for k, s in SHAPES.items()})
    return strategy


def _upload(node: int) -> tuple[dict[str, LowRankDelta], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(node)
    tv, fisher = {}, {}
    for name in (Q, DOWN):
        rows, cols = SHAPES[name]
        tv[name] = LowRankDelta(
            0.1 * torch.randn(rows, 4, generator=g), 0.1 * torch.randn(4, cols, generator=g), 2.0
        )
        fisher[name] = 1e-6 * torch.exp(2 * torch.randn(rows, cols, generator=g))
    return tv, fisher


def _replies(tv_form: str, fisher_form: str) -> list[Message]:
    out = []
    for node, assignment in zip(NODES, ASSIGNMENTS, strict=True):
        tv, fisher = _upload(node)
        content = encode_client_reply(
            role=assignment.role,
            domain=assignment.domain,
            objective="ga",
            num_examples=4,
            task_vector=encode_task_vector(tv, tv_form),
            fisher=encode_fisher(fisher, fisher_form, 0.15),
            metrics={},
        )
        out.append(Message(content, metadata=reply_metadata(node)))
    return out


def test_compact_uploads_merge_bit_for_bit_like_dense_ones_and_are_smaller(tmp_path):
    dense_replies = _replies("dense", "dense")
    compact_replies = _replies("factors", "topk")
    sizes = [
        sum(len(a.data) for r in m.content.array_records.values() for a in r.values())
        for m in (dense_replies[0], compact_replies[0])
    ]
    assert sizes[1] * 4 < sizes[0]
    dense, _ = _strategy().aggregate_train(1, dense_replies)
    strategy = _strategy(spool=UploadSpool(tmp_path / "spool"))
    compact, _ = strategy.aggregate_train(1, compact_replies)
    assert strategy.last_merge.report["tensors"][Q]["projection"]["active"]  # ε binds
    for key, value in dense.to_torch_state_dict().items():
        assert torch.equal(compact.to_torch_state_dict()[key], value), key


def test_streaming_writes_each_upload_to_disk_and_frees_the_message(tmp_path):
    spool = UploadSpool(tmp_path / "spool")
    replies = _replies("dense", "dense")
    strategy = _strategy(spool=spool)
    streamed, _ = strategy.aggregate_train(1, replies)
    files = sorted(p.name for p in (tmp_path / "spool" / "round-1").iterdir())
    assert files == [f"node-{n}.safetensors" for n in NODES]
    assert all(not m.content.array_records for m in replies)  # arrays dropped once stored
    assert strategy.client_reports and "excluded" not in str(strategy.client_reports)
    in_memory, _ = _strategy().aggregate_train(1, _replies("dense", "dense"))
    for key, value in in_memory.to_torch_state_dict().items():
        assert torch.equal(streamed.to_torch_state_dict()[key], value), key
    # the uploads stay readable until the next round (save-uploads reads them after the run)
    assert torch.equal(strategy.last_updates[0].task_vector[Q], _upload(11)[0][Q].dense())
    assert strategy.round_record()["merge"]["streamed"] is True
    assert strategy.round_record()["merge"]["round_peak_rss_bytes"] > 0


def test_spool_removes_only_its_own_files(tmp_path):
    spool = UploadSpool(tmp_path / "spool")
    strategy = _strategy(spool=spool)
    strategy.aggregate_train(1, _replies("factors", "topk"))
    foreign = tmp_path / "spool" / "round-1" / "notes.txt"
    foreign.write_text("not the spool's")
    strategy.aggregate_train(2, _replies("factors", "topk"))  # a new round drops round 1's
    assert sorted(p.name for p in (tmp_path / "spool" / "round-1").iterdir()) == ["notes.txt"]
    assert len(list((tmp_path / "spool" / "round-2").iterdir())) == len(NODES)
    spool.clear()
    assert not (tmp_path / "spool" / "round-2").exists()
    assert foreign.read_text() == "not the spool's"


def _excluded(strategy: MergeStrategy) -> dict[int, str]:
    return {r["node_id"]: r["excluded"] for r in strategy.client_reports if "excluded" in r}


def test_a_bad_compact_upload_excludes_only_that_client_and_names_the_tensor(tmp_path):
    replies = _replies("factors", "topk")
    # node 13 (retain): a top-k mask one byte short; node 14 (retain): factors of rank 64
    fisher = replies[2].content["fisher"]
    deflated = torch.from_numpy(fisher[f"{DOWN}::topk_mask"].numpy().copy())
    short = deflate_mask(inflate_mask(DOWN, deflated, 768)[:-1])
    fisher[f"{DOWN}::topk_mask"] = ArrayRecord({"m": short})["m"]
    tv, _ = _upload(14)
    tv[Q] = LowRankDelta(torch.zeros(64, 64), torch.zeros(64, 64), 1.0)
    replies[3].content["task_vector"] = ArrayRecord(encode_task_vector(tv, "factors"))
    strategy = _strategy(spool=UploadSpool(tmp_path / "spool"), client_config={"lora-rank": 16})
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert arrays is not None and metrics["num-updates"] == 2
    excluded = _excluded(strategy)
    assert set(excluded) == {13, 14}
    assert f"Fisher tensor {DOWN!r} top-k mask inflates to 767 bytes, expected 768" in excluded[13]
    assert f"task-vector tensor {Q!r} is uploaded as LoRA factors of rank 64" in excluded[14]
    assert "above the run's lora.rank 16" in excluded[14]


@pytest.mark.parametrize("fraction", [0.1, 0.04])
@pytest.mark.parametrize("kernels", ["eager", "compiled", "compiled-no-c-loops"])
def test_spooled_compact_uploads_merge_bit_for_bit_like_dense_ones_in_memory(
    tmp_path, monkeypatch, kernels, fraction
):
    """Weights above the selections' direct size (a pooled Fisher's threshold counted in one
    pass, by numpy eagerly, by the C loop compiled; a lone top-k Fisher's taken from its kept
    values): FIRM base from the spool's compact files, decoded slice by slice inside the merge,
    equals FIRM base from the same uploads decoded, dense in memory, bit for bit, with α' = α
    and α' < α (a lone Fisher's k-th largest is then a zero). The spool keeps each top-k mask
    inflated."""
    if kernels == "compiled-no-c-loops":  # where no C compiler is found: no pooling at the
        # union of the top-k masks, the pooled Fisher counted from decoded slices by inductor
        monkeypatch.setattr(native, "library", lambda: None)
    monkeypatch.setenv(MODE_ENV, kernels.removesuffix("-no-c-loops"))
    # compiled, slices of one chunk: "down" takes several compiled calls, writing in place
    monkeypatch.setattr(merge_kernels, "DECODE_SLICE", CHUNK)
    # the scaling s = 0.25 applied to A once, as for a large weight (same bits)
    monkeypatch.setattr(upload_slices, "PRESCALE_MIN_ENTRIES", 0)
    # "down": several slices of the merge's loop, whose bounds fall inside rows
    shapes = {"q": (512, 384), "up": (640, 384), "down": (700, 1000)}
    spool = UploadSpool(tmp_path / "spool")
    spool.begin_round(1)
    dense, streamed = [], []
    clients = ((1, "forget", "a"), (2, "forget", "b"), (3, "forget", "b"), (4, "retain", None))
    for node, role, domain in clients:
        g = torch.Generator().manual_seed(node)
        tv = {
            k: LowRankDelta(torch.randn(r, 8, generator=g), torch.randn(8, c, generator=g), 0.25)
            for k, (r, c) in shapes.items()
        }
        fisher = {k: torch.randn(s, generator=g).mul_(2).exp_() for k, s in shapes.items()}
        kept = encode_fisher(fisher, "topk", fraction)
        exact = {k: DecodedTensors.from_parts(kept, shapes)[k].clone() for k in shapes}
        dense.append(
            ClientUpdate(node, role, domain, 1, {k: v.dense() for k, v in tv.items()}, exact)
        )
        compact = ClientUpdate(
            node,
            role,
            domain,
            1,
            DecodedTensors.from_parts(encode_task_vector(tv, "factors"), shapes),
            DecodedTensors.from_parts(kept, shapes),
        )
        streamed.append(spool.store(compact, shapes))
    with safe_open(str(tmp_path / "spool" / "round-1" / "node-1.safetensors"), "pt") as f:
        assert "fisher/q::topk_bits" in f.keys() and "fisher/q::topk_mask" not in f.keys()  # noqa: SIM118
    want = firm_merge(dense, epsilon=math.inf).delta
    got = firm_merge(streamed, epsilon=math.inf).delta
    assert sorted(got) == sorted(want)  # the spool's files hold the weights in name order
    for key in want:
        assert torch.equal(got[key], want[key])
    spool.clear()


def _mapped(path) -> bool:
    return str(path) in Path("/proc/self/maps").read_text()


def test_a_spooled_upload_stays_mapped_only_while_a_tensor_read_from_it_lives(tmp_path):
    """The server's memory does not grow by every upload it merged: a read maps the file only
    for the tensor it returns (an open handle would keep every page read resident)."""
    spool = UploadSpool(tmp_path / "spool")
    spool.begin_round(1)
    g = torch.Generator().manual_seed(0)
    tv = {Q: torch.randn(64, 64, generator=g), DOWN: torch.randn(64, 96, generator=g)}
    update = ClientUpdate(11, "forget", "a", 4, tv, {k: v.abs() for k, v in tv.items()})
    stored = spool.store(update, {k: tuple(v.shape) for k, v in tv.items()})
    path = next((tmp_path / "spool" / "round-1").glob("node-11.safetensors"))
    kept = stored.fisher[Q]
    assert _mapped(path) and torch.equal(kept, tv[Q].abs())
    total = sum(float(stored.task_vector[k].sum()) for k in tv)
    assert total == pytest.approx(sum(float(v.sum()) for v in tv.values()), rel=1e-6)
    del kept, stored  # the merge is done with this client's tensors
    gc.collect()
    assert not _mapped(path)
    assert path.exists()  # the spool keeps the file for the round (save-uploads reads it)


def test_spooled_tensors_read_back_as_written_in_every_dtype(tmp_path):
    """The spool's reader parses the safetensors header once and maps each tensor's bytes:
    every dtype the uploads use comes back equal, an empty tensor too."""
    g = torch.Generator().manual_seed(1)
    written = {
        "f32": torch.randn(5, 7, generator=g),
        "f64": torch.randn(3, generator=g).double(),
        "bf16": torch.randn(4, 4, generator=g).bfloat16(),
        "f16": torch.randn(6, generator=g).half(),
        "bits": torch.randint(0, 255, (13,), generator=g, dtype=torch.uint8),
        "i16": torch.randint(-300, 300, (9,), generator=g, dtype=torch.int16),
        "i64": torch.arange(4),
        "empty": torch.empty(0, 3),
    }
    path = tmp_path / "node-1.safetensors"
    save_file(written, str(path))
    spooled = SpooledFile(path)
    assert sorted(spooled.keys()) == sorted(written)
    for name, tensor in written.items():
        read = spooled.get_tensor(name)
        assert read.dtype == tensor.dtype and read.shape == tensor.shape, name
        assert torch.equal(read, tensor), name
    read = spooled.get_tensor("f32")
    read.add_(1.0)  # a private map: the file keeps its values
    assert torch.equal(SpooledFile(path).get_tensor("f32"), written["f32"])


def test_a_tensor_not_aligned_for_its_dtype_is_read_into_aligned_memory(tmp_path):
    """A file whose float32 data starts at an odd byte (a hand-written header; the spool's own
    files are aligned) still reads correctly, as an aligned copy."""
    values = torch.tensor([1.5, -2.25, 3.0])
    header = {
        "bits": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "x": {"dtype": "F32", "shape": [3], "data_offsets": [3, 15]},
    }
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path = tmp_path / "odd.safetensors"
    path.write_bytes(
        struct.pack("<Q", len(text)) + text + bytes([1, 2, 3]) + values.numpy().tobytes()
    )
    read = SpooledFile(path).get_tensor("x")
    assert torch.equal(read, values) and read.data_ptr() % 4 == 0
    assert torch.equal(
        SpooledFile(path).get_tensor("bits"), torch.tensor([1, 2, 3], dtype=torch.uint8)
    )
