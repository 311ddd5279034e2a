"""MPU's server memory per node: publishing its copies and mapping its reply back, before / after.

    python -m simulations.mpu_server_memory [--layers 10] [--targets q,k,v,o,gate,up,down]

A random model of SmolLM2-135M's widths (hidden 576, MLP 1536, 9 heads, 3 KV heads, vocabulary
49152, tied embeddings) with ``--layers`` decoder layers, m = 2, κ = 0.01. Each step runs in a
fresh process (so that memory one path freed cannot hide the other's) and reports the peak
resident memory above the step's start (``VmHWM`` reset, ``strategies.memory``):

* ``publish``: one node's m copies. ``before``: θ as a state dict, every copy at once
  (:func:`fedunlearn.mpu.perturbed_copies`), then their records, as the strategy built them
  before; ``after``: :meth:`MpuStrategy.node_content`;
* ``map back``: one node's reply (LoRA factors r = 16 on ``--targets``, top-10 % Fishers) mapped
  back and every weight read once. ``before``: every copy's whole update mapped back and summed
  in float64 over all weights; ``after``: :meth:`MpuStrategy.decode_reply` with the spool, the
  reply's arrays dropped, the update read one weight at a time.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from transformers import AutoModelForCausalLM, LlamaConfig

from fedunlearn.mpu import (
    HarmonicAggregator,
    derive_seed,
    invert_delta,
    invert_fisher,
    layer_groups,
    layer_sigmas,
    perturbed_copies,
    sigma_per_tensor,
)
from fedunlearn.scenarios import ClientAssignment
from fedunlearn.upload_codec import LowRankDelta, encode_fisher, encode_task_vector
from strategies.memory import phase_peak_bytes, reset_phase_peak
from strategies.mpu_strategy import MpuStrategy
from strategies.upload_spool import UploadSpool
from wire.messages import decoded_arrays

SECRET = b"mpu-server-memory"
PATHS = ("before", "after")


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _peak_above_start(fn: Any) -> tuple[Any, int]:
    gc.collect()
    start = _rss()
    reset_phase_peak()
    out = fn()
    return out, phase_peak_bytes() - start


def _old_publish(strategy: MpuStrategy, arrays: ArrayRecord, layers: int) -> Any:
    state = arrays.to_torch_state_dict()
    groups = layer_groups(state.keys(), layers)
    rms = sigma_per_tensor(groups, layer_sigmas(state, groups, 1.0))
    gen = torch.Generator().manual_seed(derive_seed(SECRET, 1, 0, "noise"))
    transforms = [strategy.copy_transforms(1, 0, k) for k in range(strategy.copies)]
    sigmas = {n: strategy.kappa * v for n, v in rms.items()}
    copies = perturbed_copies(state, sigmas, strategy.alphas, gen, transforms)
    records = []
    for k in range(len(copies)):
        copy, copies[k] = copies[k], {}
        records.append(ArrayRecord({n: t.contiguous() for n, t in copy.items()}))
    return records, state  # the strategy kept θ's state dict for the round


def _reply(content: RecordDict, names: list[str], copies: int) -> RecordDict:
    gen = torch.Generator().manual_seed(1)
    info = ConfigRecord({"role": "forget", "domain": "d", "objective": "ga"})
    reply = RecordDict({"metrics": MetricRecord({"num-examples": 2}), "info": info})
    for k in range(copies):
        sent = content[f"arrays-{k}"]
        factors, fisher = {}, {}
        for n in names:
            w = torch.from_numpy(sent[n].numpy())
            b, a = torch.randn(w.shape[0], 16, generator=gen), torch.randn(16, w.shape[1])
            factors[n], fisher[n] = LowRankDelta(b, a, 2.0), w.pow(2)
        reply[f"task_vector-{k}"] = ArrayRecord(encode_task_vector(factors, "factors"))
        reply[f"fisher-{k}"] = ArrayRecord(encode_fisher(fisher, "topk", 0.1))
    return reply


def _old_map_back(strategy: MpuStrategy, reply: RecordDict, shapes: Any) -> float:
    aggregator, fisher_sum = HarmonicAggregator(out_dtype=torch.float32), None
    for k, alpha in enumerate(strategy.alphas):
        tf = strategy.copy_transforms(1, 0, k)
        delta = invert_delta(decoded_arrays(reply[f"task_vector-{k}"], shapes), tf)
        fisher = invert_fisher(decoded_arrays(reply[f"fisher-{k}"], shapes), tf)
        aggregator.add(delta, alpha)
        if fisher_sum is None:
            fisher_sum = {n: f.double() for n, f in fisher.items()}
        else:
            for n, f in fisher.items():
                fisher_sum[n].add_(f)
        del delta, fisher
    assert fisher_sum is not None
    tv = aggregator.result()
    return sum(float(tv[n].sum()) + float((f / 2).float().sum()) for n, f in fisher_sum.items())


def measure(layers: int, targets: list[str], path: str) -> dict[str, Any]:
    """One path's two steps in this process (see the module docstring)."""
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    arrays = ArrayRecord(
        {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    )
    del model
    folder = Path(tempfile.mkdtemp(prefix="mpu-memory-"))
    strategy = MpuStrategy(
        merge="firm",
        model_config=config,
        secret=SECRET,
        copies=2,
        kappa=0.01,
        assignments=[ClientAssignment("forget", "d", (0,))],
        spool=UploadSpool(folder / "spool") if path == "after" else None,
    )
    strategy.node_assignment = {1: strategy.assignments[0]}
    strategy.global_arrays = arrays
    if path == "before":
        _, publish = _peak_above_start(lambda: _old_publish(strategy, arrays, layers))
        content = strategy.node_content(1, 0, arrays, ConfigRecord())
    else:
        content, publish = _peak_above_start(
            lambda: strategy.node_content(1, 0, arrays, ConfigRecord())
        )
    names = [n for n in arrays if any(f".{t}_proj." in n for t in targets)]
    reply = _reply(content, names, strategy.copies)
    del content
    shapes = strategy.reply_spec(1).shapes

    def after() -> float:
        update, _ = strategy.decode_reply(1, 1, reply)
        assert strategy.spool is not None
        strategy.spool.store(update, shapes)
        for name in list(reply.array_records):
            del reply[name]
        assert update.fisher is not None
        return sum(
            float(update.task_vector[n].sum()) + float(update.fisher[n].sum()) for n in names
        )

    if path == "before":
        _, map_back = _peak_above_start(lambda: _old_map_back(strategy, reply, shapes))
    else:
        _, map_back = _peak_above_start(after)
    if strategy.spool is not None:
        strategy.spool.clear()
    shutil.rmtree(folder, ignore_errors=True)
    model_bytes = sum(len(a.data) for a in arrays.values())
    adapted = sum(4 * torch.Size(shapes[n]).numel() for n in names) if shapes else 0
    return {
        "path": path,
        "model_bytes": model_bytes,
        "adapted_bytes": adapted,
        "publish_bytes": publish,
        "map_back_bytes": map_back,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--targets", default="q,k,v,o,gate,up,down")
    parser.add_argument("--path", choices=PATHS, help="measure one path in this process")
    args = parser.parse_args(argv)
    targets = args.targets.split(",")
    if args.path:
        print(json.dumps(measure(args.layers, targets, args.path)))
        return 0
    rows = []
    for path in PATHS:
        command = [sys.executable, "-m", "simulations.mpu_server_memory", "--path", path]
        command += ["--layers", str(args.layers), "--targets", args.targets]
        done = subprocess.run(command, check=True, capture_output=True, text=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    model, adapted = rows[0]["model_bytes"], rows[0]["adapted_bytes"]
    print(
        f"model {model / 1e6:.0f} MB ({args.layers} layers), adapted {adapted / 1e6:.0f} MB; "
        "peak above the step's start:"
    )
    for row in rows:
        print(
            f"{row['path']}: publish one node {row['publish_bytes'] / model:.2f} x the model; "
            f"map back one node {row['map_back_bytes'] / 1e6:.0f} MB "
            f"({row['map_back_bytes'] / adapted:.2f} x the adapted weights)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
