"""Bytes per client, server peak memory and merge seconds: dense in-memory vs compact streaming.

    python -m simulations.bench_uploads                          # every scale below
    python -m simulations.bench_uploads --scales builtin,smollm2-qv

Scales (shapes computed from the numbers, no model loaded; LoRA rank r and scaling s = α/r
from the run config's ``lora.rank`` / ``lora.alpha``, 16 and 2.0):

* ``builtin``: the built-in tofu model (``SubstrateConfig``'s default sizes), all seven
  projections of every layer;
* ``smollm2-qv`` / ``smollm2-all``: SmolLM2-135M (hidden 576, intermediate 1536, 30 layers,
  9 heads / 3 KV heads of 64), LoRA on q_proj, v_proj (the real-model default) / on all seven;
* ``7b-layer``: one decoder layer of Llama-2-7B (hidden 4096, intermediate 11008, 32 heads),
  all seven projections; 2 forget + 2 retain clients, since six dense uploads (6 × 1.6 GB)
  plus the merged layer exceed the 10 GB this benchmark may use.

Uploads (client side, seeded, one spawned process writing each client's upload to disk in both
wire forms): per weight, LoRA factors B (d_out × r) and A (r × d_in) with N(0, 10⁻⁴) entries
(forget clients add half their own factors to factors shared by the forget side) and a Fisher
diagonal F̂ = 10⁻⁶·exp(2z), z = ρ·z_shared + √(1−ρ²)·z_own, ρ = 0.7, as in
``simulations.bench_merge``. Dense form: Δθ = s·B@A and F̂ in float32; compact form: the
factors and the top-α' Fisher (``--fraction``, default the run config's
``upload.fisher-fraction``); the bf16 Fisher is counted as a third variant. Bytes are the
payload (``upload_bytes``) per client.

Server cases (FIRM base merge, ε = ∞, each in its own spawned process):

* ``dense-in-memory``: every client's dense upload read from disk into memory (plain reads,
  no memory map) as ``{weight: tensor}`` dicts, then merged;
* ``compact-streaming``: every client's compact upload read into memory, stored with
  :class:`~strategies.upload_spool.UploadSpool` (one safetensors file per client) and dropped;
  the merge reads each weight from the memory maps.

Each case runs under two server configurations of the same uploads: ``pooled`` (all forget
clients in one domain, so FIRM's top-α of the pooled mean is not recoverable from top-α'
uploads) and ``per-domain`` (one forget client per domain: exact for α' ≥ α).

Memory (``/proc/self/status``): after ``gc`` and ``malloc_trim`` the process's RSS is read
and its high-water mark reset (``5`` → ``/proc/self/clear_refs``) BEFORE the first upload is
received; ``held`` = VmRSS after receiving (and spooling) every upload − that RSS, ``file``
the part of it that is file-backed (RssFile: pages of the spool's memory maps that validation
touched, which the kernel can reclaim, and a few MB of library code run for the first time);
the mark is then reset again, and ``merge`` = VmHWM after the merge − VmRSS before it;
``peak`` = the larger VmHWM of the two windows − the first RSS. Counted: received uploads,
validation, spool writes, memory-mapped pages touched, the merge's working memory and its
output (one dense float32 tensor per weight). Not counted: the interpreter and the libraries
loaded before (Python, torch). Seconds: ``receive`` (read + validate + spool, once), the first
merge (``first``: it also pays what a process pays once, the merge kernels' compilation or
loading and the spool's pages mapped into the process) and the best of ``--repeats`` merges
(``time.perf_counter``); ``compact ÷ dense`` is the ratio of the two cases' best merge seconds
(and of their first). ``error`` = ‖Δ_compact − Δ_dense‖ / ‖Δ_dense‖ over all weights.

Prints a table and writes JSON (``--output``, default
``outputs/bench_uploads/bench_uploads-<time>.json``); the uploads and spools live in
``--work-dir`` (default ``outputs/bench_uploads/work``), removed after each scale.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import time
import tomllib
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fedunlearn.files import safetensors_layout
from fedunlearn.merging import ClientUpdate, get_merge
from fedunlearn.upload_codec import (
    DecodedTensors,
    LowRankDelta,
    encode_fisher,
    encode_task_vector,
    upload_bytes,
)
from simulations.bench_merge import _release_free_memory, _reset_peak_rss, _status_bytes
from strategies.upload_spool import UploadSpool

REPO_ROOT = Path(__file__).resolve().parents[1]
OUTPUT_DIR = REPO_ROOT / "outputs" / "bench_uploads"
_RUN_CONFIG = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"][
    "config"
]
DEFAULT_FRACTION = float(_RUN_CONFIG["upload"]["fisher-fraction"])
RANK = int(_RUN_CONFIG["lora"]["rank"])
SCALING = float(_RUN_CONFIG["lora"]["alpha"]) / RANK
FACTOR_STD = 1e-2
FISHER_SCALE = 1e-6
FISHER_SPREAD = 2.0
FISHER_CORRELATION = 0.7
MEMORY_LIMIT_GB = 10.0
CASES = ("dense-in-memory", "compact-streaming")
CONFIGS = ("pooled", "per-domain")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ALL = ATTENTION + MLP
MEMORY_METHOD = (
    "from /proc/self/status, high-water mark reset (5 -> /proc/self/clear_refs) after gc and "
    "malloc_trim: held = VmRSS after receiving every upload - VmRSS before the first (file = "
    "its RssFile part: memory-map pages and library code first run), merge = VmHWM during "
    "the merge - VmRSS before it, "
    "peak = max VmHWM - VmRSS before the first upload; counts received uploads, validation, "
    "spooling, mapped pages touched, the merge's work and its output, not the interpreter and "
    "libraries loaded before"
)


# ------------------------------------------------------------------------------------ scales
@dataclass(frozen=True)
class ModelDims:
    """A Llama decoder's sizes: hidden h, intermediate m, layers, heads, KV heads, head dim."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int

    def projection_shape(self, name: str) -> tuple[int, int]:
        """(d_out, d_in) of projection ``name`` (q, k, v, o, gate, up or down)."""
        q, kv, h, m = (
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
            self.hidden,
            self.intermediate,
        )
        return {
            "q_proj": (q, h),
            "k_proj": (kv, h),
            "v_proj": (kv, h),
            "o_proj": (h, q),
            "gate_proj": (m, h),
            "up_proj": (m, h),
            "down_proj": (h, m),
        }[name]


@dataclass(frozen=True)
class Scale:
    """A model size, its LoRA targets and the clients uploading (forget in one domain + retain)."""

    name: str
    description: str
    dims: ModelDims
    targets: tuple[str, ...]
    forget: int = 4
    retain: int = 2

    def shapes(self) -> dict[str, tuple[int, int]]:
        """``{weight key: (d_out, d_in)}`` of every adapted weight, layer by layer."""
        return {
            f"model.layers.{i}.{'self_attn' if t in ATTENTION else 'mlp'}.{t}.weight": (
                self.dims.projection_shape(t)
            )
            for i in range(self.dims.layers)
            for t in self.targets
        }

    def entries(self) -> int:
        """Adapted weight entries d per client (Σ d_out·d_in)."""
        return sum(a * b for a, b in self.shapes().values())


def _builtin_dims() -> ModelDims:
    """The built-in substrate's decoder sizes (``SubstrateConfig``'s defaults)."""
    from fedunlearn.models.substrate import SubstrateConfig  # transformers: the parent only

    s = SubstrateConfig()
    return ModelDims(
        s.hidden_size,
        s.intermediate_size,
        s.num_hidden_layers,
        s.num_attention_heads,
        s.num_key_value_heads,
        s.hidden_size // s.num_attention_heads,
    )


_SMOLLM2 = ModelDims(576, 1536, 30, 9, 3, 64)
SCALE_NAMES = ("builtin", "smollm2-qv", "smollm2-all", "7b-layer")


def named_scale(name: str) -> Scale:
    """The scale called ``name`` (one of :data:`SCALE_NAMES`)."""
    if name == "builtin":
        return Scale(name, "built-in tofu model, all seven projections", _builtin_dims(), ALL)
    if name == "smollm2-qv":
        return Scale(name, "SmolLM2-135M, q_proj+v_proj", _SMOLLM2, ("q_proj", "v_proj"))
    if name == "smollm2-all":
        return Scale(name, "SmolLM2-135M, all seven projections", _SMOLLM2, ALL)
    if name == "7b-layer":
        dims = ModelDims(4096, 11008, 1, 32, 32, 128)
        return Scale(name, "one Llama-2-7B decoder layer, all seven", dims, ALL, forget=2, retain=2)
    raise ValueError(f"unknown scale {name!r}; choose from {SCALE_NAMES}")


def dense_server_estimate(scale: Scale) -> int:
    """Bytes the dense in-memory server needs, roughly: every upload (8 bytes per entry per
    client), the merged update (4 per entry) and three float32 copies of the largest weight."""
    largest = max(a * b for a, b in scale.shapes().values())
    return 4 * scale.entries() * (2 * (scale.forget + scale.retain) + 1) + 12 * largest


# ------------------------------------------------------------------------------- client side
@dataclass(frozen=True)
class Client:
    """One uploading client: id, role, its slot among the seeds and its server-side domain."""

    node_id: str
    role: str
    slot: int

    def domain(self, config: str) -> str | None:
        """The client's forget domain under server configuration ``config``."""
        if self.role == "retain":
            return None
        return "domain-0" if config == "pooled" else f"domain-{self.slot}"


def clients_of(scale: Scale) -> list[Client]:
    forget = [Client(f"forget-{i}", "forget", i) for i in range(scale.forget)]
    return forget + [Client(f"retain-{i}", "retain", scale.forget + i) for i in range(scale.retain)]


def _randn(shape: tuple[int, ...], *stream: object) -> torch.Tensor:
    """Standard normal numbers of the stream named by ``stream`` (deterministic)."""
    seed = int.from_bytes(hashlib.sha256(repr(stream).encode()).digest()[:8], "little") >> 1
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def client_upload(
    shapes: Mapping[str, tuple[int, int]], client: Client, seed: int, rank: int, scaling: float
) -> tuple[dict[str, LowRankDelta], dict[str, torch.Tensor]]:
    """Client ``client``'s task vector (LoRA factors) and raw Fisher diagonal (module doc)."""
    own = math.sqrt(1.0 - FISHER_CORRELATION**2)
    task_vector, fisher = {}, {}
    for t, (key, (d_out, d_in)) in enumerate(shapes.items()):
        b = _randn((d_out, rank), seed, t, "B", client.slot)
        a = _randn((rank, d_in), seed, t, "A", client.slot)
        if client.role == "forget":
            b = b.mul_(0.5).add_(_randn((d_out, rank), seed, t, "B"))
            a = a.mul_(0.5).add_(_randn((rank, d_in), seed, t, "A"))
        task_vector[key] = LowRankDelta(b.mul_(FACTOR_STD), a.mul_(FACTOR_STD), scaling)
        z = _randn((d_out, d_in), seed, t, "F", client.slot).mul_(own)
        z.add_(_randn((d_out, d_in), seed, t, "F"), alpha=FISHER_CORRELATION)
        fisher[key] = z.mul_(FISHER_SPREAD).exp_().mul_(FISHER_SCALE)
    return task_vector, fisher


def _prefixed(prefix: str, parts: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"{prefix}/{name}": t for name, t in parts.items()}


@dataclass(frozen=True)
class UploadJob:
    """Write every client's dense and compact upload into ``folder`` (``dense/``, ``compact/``)."""

    shapes: dict[str, tuple[int, int]]
    clients: tuple[Client, ...]
    folder: Path
    seed: int
    rank: int
    scaling: float
    fraction: float
    threads: int


def write_uploads(job: UploadJob) -> list[dict[str, int]]:
    """Each client's payload bytes per part; its uploads go to
    ``<folder>/<form>/<node id>.safetensors``."""
    torch.set_num_threads(job.threads)
    for form in ("dense", "compact"):
        (job.folder / form).mkdir(parents=True, exist_ok=True)
    sizes = []
    for client in job.clients:
        tv, fisher = client_upload(job.shapes, client, job.seed, job.rank, job.scaling)
        dense_tv, dense_f = encode_task_vector(tv, "dense"), encode_fisher(fisher, "dense")
        row = {"dense_task_vector": upload_bytes(dense_tv), "dense_fisher": upload_bytes(dense_f)}
        save_file(
            {**_prefixed("task_vector", dense_tv), **_prefixed("fisher", dense_f)},
            str(job.folder / "dense" / f"{client.node_id}.safetensors"),
        )
        del dense_tv, dense_f
        factors, topk = (
            encode_task_vector(tv, "factors"),
            encode_fisher(fisher, "topk", job.fraction),
        )
        row |= {"factors_task_vector": upload_bytes(factors), "topk_fisher": upload_bytes(topk)}
        save_file(
            {**_prefixed("task_vector", factors), **_prefixed("fisher", topk)},
            str(job.folder / "compact" / f"{client.node_id}.safetensors"),
        )
        del factors, topk
        row["bf16_fisher"] = sum(
            upload_bytes(encode_fisher({k: f}, "bf16")) for k, f in fisher.items()
        )
        sizes.append(row)
        del tv, fisher
    return sizes


# ------------------------------------------------------------------------------- server side
def read_upload(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file read into fresh memory with plain reads: what a
    server holds once it has received the upload (a memory map's pages would count too)."""
    out = {}
    with open(path, "rb") as fh:
        for name, entry in safetensors_layout(path).items():
            tensor = torch.empty(entry.shape, dtype=entry.dtype)
            fh.seek(entry.start)
            if (
                fh.readinto(tensor.reshape(-1).view(torch.uint8).numpy())
                != entry.stop - entry.start
            ):
                raise OSError(f"{path}: tensor {name!r} is truncated")
            out[name] = tensor
    return out


def _split(parts: Mapping[str, torch.Tensor]) -> tuple[dict, dict]:
    """(task-vector parts, Fisher parts) of an upload file's tensors."""
    out: dict[str, dict[str, torch.Tensor]] = {"task_vector": {}, "fisher": {}}
    for name, t in parts.items():
        prefix, part = name.split("/", 1)
        out[prefix][part] = t
    return out["task_vector"], out["fisher"]


@dataclass(frozen=True)
class CaseJob:
    """One server case: receive the uploads of ``clients`` from ``folder`` and merge them."""

    case: str
    config: str
    clients: tuple[Client, ...]
    shapes: dict[str, tuple[int, int]]
    folder: Path
    output: Path
    threads: int
    repeats: int


def _receive(job: CaseJob, spool: UploadSpool) -> list[ClientUpdate]:
    """The server's uploads: dense dicts in memory, or compact uploads spooled to disk."""
    updates = []
    for c in job.clients:
        form = "dense" if job.case == "dense-in-memory" else "compact"
        tv, fisher = _split(read_upload(job.folder / form / f"{c.node_id}.safetensors"))
        if form == "compact":
            tv = DecodedTensors.from_parts(tv, job.shapes)
            fisher = DecodedTensors.from_parts(fisher, job.shapes)
        update = ClientUpdate(c.node_id, c.role, c.domain(job.config), 100, tv, fisher)
        updates.append(update if form == "dense" else spool.store(update, job.shapes))
        del tv, fisher, update
    return updates


def _settle() -> int:
    """VmRSS after ``gc`` and ``malloc_trim``, with the high-water mark reset to it."""
    gc.collect()
    _release_free_memory()
    rss = _status_bytes("VmRSS")
    if rss is None or not _reset_peak_rss():
        raise RuntimeError("peak RSS cannot be measured here (needs Linux /proc/self)")
    return rss


def _merge_runs(updates: list[ClientUpdate], repeats: int) -> tuple[Any, list[float]]:
    """FIRM base merged ``repeats`` times (each output freed before the next run); the last
    output and every run's seconds."""
    result, seconds = None, []
    for _ in range(repeats):
        result = None
        gc.collect()
        t0 = time.perf_counter()
        result = get_merge("firm")(updates, epsilon=math.inf)
        seconds.append(time.perf_counter() - t0)
    return result, seconds


def server_case(job: CaseJob) -> dict[str, Any]:
    """Receive, merge (FIRM base) and measure (module doc); the merged update goes to
    ``job.output``."""
    torch.set_num_threads(job.threads)
    spool = UploadSpool(job.folder / f"spool-{job.config}")
    spool.begin_round(1)
    rss0, file0 = _settle(), _status_bytes("RssFile") or 0
    t0 = time.perf_counter()
    updates = _receive(job, spool)
    receive_s = time.perf_counter() - t0
    hwm_receive = _status_bytes("VmHWM") or 0
    rss1, file1 = _settle(), _status_bytes("RssFile") or 0
    result, merge_s = _merge_runs(updates, job.repeats)
    hwm_merge = _status_bytes("VmHWM") or 0
    save_file(result.delta, str(job.output))
    spool_bytes = sum(p.stat().st_size for p in spool.folder.rglob("*.safetensors"))
    del updates, result
    spool.clear()
    return {
        "receive_seconds": receive_s,
        "merge_seconds": min(merge_s),
        "first_merge_seconds": merge_s[0],
        "all_merge_seconds": merge_s,
        "held_bytes": rss1 - rss0,
        "held_file_bytes": file1 - file0,
        "merge_extra_bytes": hwm_merge - rss1,
        "peak_extra_bytes": max(hwm_receive, hwm_merge) - rss0,
        "spool_bytes": spool_bytes,
    }


def relative_error(compact: Path, dense: Path) -> dict[str, float]:
    """‖Δ_c − Δ_d‖ / ‖Δ_d‖ over all weights (``error``) and the worst weight's."""
    diff_sq = ref_sq = worst = 0.0
    with safe_open(str(compact), "pt") as fc, safe_open(str(dense), "pt") as fd:
        for key in fd.keys():  # noqa: SIM118 — a safetensors handle, not a dict
            ref = fd.get_tensor(key).double()
            d_sq = float((fc.get_tensor(key).double() - ref).pow(2).sum())
            r_sq = float(ref.pow(2).sum())
            diff_sq, ref_sq = diff_sq + d_sq, ref_sq + r_sq
            worst = max(worst, math.sqrt(d_sq / r_sq) if r_sq > 0 else 0.0)
    return {"error": math.sqrt(diff_sq / ref_sq) if ref_sq > 0 else 0.0, "worst_error": worst}


# -------------------------------------------------------------------------------- benchmark
@dataclass(frozen=True)
class BenchConfig:
    scales: tuple[str, ...] = SCALE_NAMES
    fraction: float = DEFAULT_FRACTION
    rank: int = RANK
    scaling: float = SCALING
    seed: int = 0
    threads: int = field(default_factory=torch.get_num_threads)
    repeats: int = 3
    configs: tuple[str, ...] = CONFIGS
    memory_limit_gb: float = MEMORY_LIMIT_GB
    #: how long to wait for the machine's MemAvailable to cover a step before giving up
    memory_wait_s: float = 0.0
    work_dir: Path = OUTPUT_DIR / "work"


def _spawned(fn: Any, job: Any) -> Any:
    """``fn(job)`` in a fresh spawned process (its own peak RSS, nothing inherited)."""
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        return pool.submit(fn, job).result()


def _bytes_summary(sizes: Sequence[dict[str, int]]) -> dict[str, float]:
    """Mean payload bytes per client of each part and of the three upload forms, and ratios."""
    mean = {k: sum(s[k] for s in sizes) / len(sizes) for k in sizes[0]}
    dense = mean["dense_task_vector"] + mean["dense_fisher"]
    compact = mean["factors_task_vector"] + mean["topk_fisher"]
    bf16 = mean["factors_task_vector"] + mean["bf16_fisher"]
    return mean | {
        "dense": dense,
        "compact": compact,
        "compact_bf16": bf16,
        "dense_over_compact": dense / compact,
        "dense_over_compact_bf16": dense / bf16,
    }


def _mem_available() -> int:
    """The machine's MemAvailable (``/proc/meminfo``) in bytes."""
    with open("/proc/meminfo", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable is not in /proc/meminfo")


def await_memory(needed: int, step: str, wait_s: float) -> None:
    """Return once the machine has ``needed`` bytes available (others share it), polling for
    up to ``wait_s`` seconds; ``RuntimeError`` naming ``step`` otherwise."""
    deadline = time.monotonic() + wait_s
    while (available := _mem_available()) < needed:
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"{step} needs about {needed / 1e9:.1f} GB but the machine has "
                f"{available / 1e9:.1f} GB available"
            )
        time.sleep(10.0)


def run_scale(scale: Scale, cfg: BenchConfig) -> dict[str, Any]:
    """Bytes, server cases and errors of one scale (module doc); its files are removed."""
    estimate = dense_server_estimate(scale)
    if estimate > cfg.memory_limit_gb * 1e9:
        raise ValueError(
            f"scale {scale.name!r}: the dense server needs about {estimate / 1e9:.1f} GB "
            f"(> {cfg.memory_limit_gb} GB); use fewer clients"
        )
    folder = cfg.work_dir / scale.name
    shutil.rmtree(folder, ignore_errors=True)
    clients = tuple(clients_of(scale))
    shapes = scale.shapes()
    try:
        job = UploadJob(
            shapes, clients, folder, cfg.seed, cfg.rank, cfg.scaling, cfg.fraction, cfg.threads
        )
        client_bytes = 8 * scale.entries()
        await_memory(3 * client_bytes, f"{scale.name}: writing uploads", cfg.memory_wait_s)
        sizes = _spawned(write_uploads, job)
        configs = {}
        for config in cfg.configs:
            cases = {}
            for case in CASES:
                out = folder / f"merged-{config}-{case}.safetensors"
                job = CaseJob(case, config, clients, shapes, folder, out, cfg.threads, cfg.repeats)
                needed = estimate if case == CASES[0] else 3 * client_bytes
                await_memory(needed, f"{scale.name} {config} {case}", cfg.memory_wait_s)
                cases[case] = _spawned(server_case, job)
            configs[config] = {
                "cases": cases,
                "relative_error": relative_error(
                    folder / f"merged-{config}-compact-streaming.safetensors",
                    folder / f"merged-{config}-dense-in-memory.safetensors",
                ),
            }
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {
        "name": scale.name,
        "description": scale.description,
        "dims": asdict(scale.dims),
        "targets": list(scale.targets),
        "weights": len(shapes),
        "entries_per_client": scale.entries(),
        "clients": {"forget": scale.forget, "retain": scale.retain},
        "dense_server_estimate_bytes": estimate,
        "bytes_per_client": _bytes_summary(sizes) | {"per_client": sizes},
        "configs": configs,
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run_benchmark(cfg: BenchConfig, scales: Sequence[Scale] | None = None) -> dict[str, Any]:
    """Every scale of ``cfg`` (or ``scales``) measured; the JSON-able results."""
    chosen = list(scales) if scales is not None else [named_scale(n) for n in cfg.scales]
    return {
        "benchmark": "bench_uploads",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        "environment": {
            "cpu": _cpu_model(),
            "cpu_count": os.cpu_count(),
            "torch_threads": cfg.threads,
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "merge": "FIRM base (epsilon = inf), default gamma, alpha, eps0",
        "memory_method": MEMORY_METHOD,
        "scales": [_with_ratios(run_scale(s, cfg)) for s in chosen],
    }


def _with_ratios(scale: dict[str, Any]) -> dict[str, Any]:
    """``scale`` with ``compact_over_dense`` (best and first merge seconds) per configuration."""
    for c in scale["configs"].values():
        dense, compact = (c["cases"][case] for case in CASES)
        c["compact_over_dense"] = {
            "best": compact["merge_seconds"] / dense["merge_seconds"],
            "first": compact["first_merge_seconds"] / dense["first_merge_seconds"],
        }
    return scale


# ----------------------------------------------------------------------------------- report
def _mb(n: float) -> str:
    return f"{n / 1e6:.2f}" if n < 1e9 else f"{n / 1e6:.0f}"


def format_report(results: dict[str, Any]) -> str:
    cfg, env = results["config"], results["environment"]
    lines = [
        f"Upload benchmark: r = {cfg['rank']}, s = {cfg['scaling']}, top-k fraction "
        f"{cfg['fraction']}, {env['cpu']} ({env['cpu_count']} CPUs), {env['torch_threads']} "
        "torch thread(s)",
        "",
        "Bytes per client (payload, MB): dense = task vector + Fisher in float32; compact = "
        "LoRA factors + top-k Fisher; bf16 = factors + bf16 Fisher",
        f"{'scale':<12} {'weights':>7} {'entries':>11} {'dense':>9} {'compact':>8} "
        f"{'(factors':>9} {'+ top-k)':>9} {'bf16':>8} {'dense/compact':>13} {'dense/bf16':>10}",
    ]
    for s in results["scales"]:
        b = s["bytes_per_client"]
        lines.append(
            f"{s['name']:<12} {s['weights']:>7} {s['entries_per_client']:>11} "
            f"{_mb(b['dense']):>9} {_mb(b['compact']):>8} {_mb(b['factors_task_vector']):>9} "
            f"{_mb(b['topk_fisher']):>9} {_mb(b['compact_bf16']):>8} "
            f"{b['dense_over_compact']:>12.1f}x {b['dense_over_compact_bf16']:>9.1f}x"
        )
    lines += [
        "",
        "Server, FIRM base merge (GB: held = uploads after receiving, (file) = of it file-backed "
        "memory-map pages, merge = extra during the merge, peak = from before the first upload; "
        f"merge s: the first of the process and the best of {cfg['repeats']})",
        f"{'scale':<12} {'clients':>7} {'config':<10} {'case':<18} {'recv s':>7} {'first s':>8} "
        f"{'best s':>8} {'held GB':>8} {'(file)':>7} {'merge GB':>8} {'peak GB':>8} "
        f"{'rel. error':>10}",
    ]
    for s in results["scales"]:
        n = f"{s['clients']['forget']}F+{s['clients']['retain']}R"
        for config, c in s["configs"].items():
            for case, m in c["cases"].items():
                err = c["relative_error"]["error"] if case == CASES[1] else None
                lines.append(
                    f"{s['name']:<12} {n:>7} {config:<10} {case:<18} "
                    f"{m['receive_seconds']:>7.2f} {m['first_merge_seconds']:>8.2f} "
                    f"{m['merge_seconds']:>8.2f} "
                    f"{m['held_bytes'] / 1e9:>8.3f} {m['held_file_bytes'] / 1e9:>7.3f} "
                    f"{m['merge_extra_bytes'] / 1e9:>8.3f} "
                    f"{m['peak_extra_bytes'] / 1e9:>8.3f} {'' if err is None else f'{err:.2e}':>10}"
                )
    lines += ["", "Compact streaming ÷ dense in memory, FIRM base merge seconds (best / first)"]
    for s in results["scales"]:
        ratios = [
            f"{config} {r['best']:.2f} / {r['first']:.2f}"
            for config, r in ((k, c["compact_over_dense"]) for k, c in s["configs"].items())
        ]
        lines.append(f"{s['name']:<12} " + ", ".join(ratios))
    return "\n".join(lines)


# -------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m simulations.bench_uploads", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--scales", default=",".join(SCALE_NAMES), help=f"comma-separated: {SCALE_NAMES}"
    )
    p.add_argument("--fraction", type=float, default=DEFAULT_FRACTION, help="top-k Fisher α'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--repeats", type=int, default=3, help="merges per case (first and best reported)"
    )
    p.add_argument("--memory-limit-gb", type=float, default=MEMORY_LIMIT_GB)
    p.add_argument(
        "--memory-wait", type=float, default=0.0, help="seconds to wait for free memory per step"
    )
    p.add_argument("--work-dir", type=Path, default=OUTPUT_DIR / "work")
    p.add_argument("--output", type=Path, default=None, help="JSON path")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    names = tuple(n.strip() for n in args.scales.split(",") if n.strip())
    unknown = [n for n in names if n not in SCALE_NAMES]
    if unknown or not names:
        parser.error(f"--scales: unknown {unknown}; choose from {SCALE_NAMES}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if not 0.0 < args.fraction <= 1.0:
        parser.error(f"--fraction must be in (0, 1], got {args.fraction}")
    cfg = BenchConfig(
        scales=names,
        fraction=args.fraction,
        seed=args.seed,
        threads=args.threads or torch.get_num_threads(),
        repeats=args.repeats,
        memory_limit_gb=args.memory_limit_gb,
        memory_wait_s=args.memory_wait,
        work_dir=args.work_dir,
    )
    results = run_benchmark(cfg)
    print(format_report(results))
    output = args.output or OUTPUT_DIR / f"bench_uploads-{time.strftime('%Y%m%d-%H%M%S')}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
