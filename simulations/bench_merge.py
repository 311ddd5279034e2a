"""Benchmark the server-side merges on synthetic task vectors and Fisher diagonals
(docs/algorithms.md, "What the server does").

    python -m simulations.bench_merge                 # a quarter of the paper's WMDP scale
    python -m simulations.bench_merge --paper-scale   # 3 tensors of 14336×4096 (run once only)

Inputs (seeded by ``--seed``): ``--forget-clients`` forget clients spread over ``--domains``
forget domains plus ``--retain-clients`` retain clients, each sending a task vector and a raw
Fisher diagonal for ``--tensors`` tensors of shape ``--rows × --cols`` in ``--dtype``.  Task
vectors are low rank plus noise (``s·(B_g@A_g + ½·B_i@A_i)/√r + noise``, ``r = 16``; forget
clients of one domain share ``B_g@A_g``, so FULM's clusters are the domains plus the retain
clients); Fisher diagonals are ``1e-6·exp(2·z)`` with ``z`` standard normal, correlated across
clients (``--fisher-correlation``), spanning about five orders of magnitude.  A second input
adds retain clients up to ``--multi-retain`` (default 3) for the multi-constraint projection.

Cases, each timed with ``time.perf_counter`` (the best of ``--repeats``, and the first run
beside it: the first call of a merge in the process also compiles or loads its kernels):

* ``read-pass``: one plain read of every input tensor (converted to float32 slice by slice into
  one reused buffer, and summed), the
  yardstick all ratios refer to.  It runs ``--repeats`` times at the start and once more before
  every timed repetition of every other case; the baseline is the fastest of all these passes
  (so one read pass slowed by a busy machine does not move every ratio).  If AVG comes out
  faster than that baseline, the JSON's ``baseline_check`` says so and a warning is printed;
* every registered merge with its defaults (``firm`` as ``firm-base``, i.e. ``epsilon = inf``);
* ``firm-streaming``: the FIRM-base merge on the same uploads received as the streaming server
  receives them: stored with :class:`~strategies.upload_spool.UploadSpool` (one safetensors
  file per client, validated from the file as it is written) and merged from its memory maps,
  one weight per client at a time.  Cold: before every repetition the previous round's files
  are removed and the uploads spooled afresh (untimed), so no repetition finds pages that an
  earlier merge mapped; its peak extra RSS stands next to ``firm-base``'s, whose uploads stay
  resident;
* ``projection-m1``: :func:`project_retention` alone, per tensor, on the FIRM-base result, with
  ``epsilon = --epsilon-factor × mean no-projection damage`` (so that the budget is active);
* ``projection-m3-exact`` (and ``projection-m3-increase-only``, the paper's routine, for
  context): the same on the input with ``--multi-retain`` retain clients;
* ``firm-projected-m1``: FIRM with the projection, end to end.

``--cases`` (comma-separated names) times only the named cases; ``read-pass`` always runs, and the
inputs the projection cases need (the FIRM-base result, the budget) are still computed, untimed.

Peak memory: before each run the process's RSS high-water mark is reset (``5`` written to
``/proc/self/clear_refs``) and ``VmHWM − VmRSS`` (from ``/proc/self/status``) after the run is
reported as the case's extra peak RSS (after ``gc.collect()`` and glibc's ``malloc_trim(0)``,
so that memory freed by earlier cases is not silently reused): the memory the case needed on
top of the inputs (which stay resident), including its output.

Targets (issue 15, ratios within the run): FIRM base ≤ 3× the read pass, TIES and FULM ≤ 8×,
the exact projection with ``--multi-retain`` constraints ≤ 2× FIRM base; and (earlier) the
single-constraint projection ≤ 1× FIRM base.

Prints a table, the baseline check and the targets, and writes the same as JSON (``--output``,
default ``outputs/bench/bench_merge-<time>.json``).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import inspect
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from fedunlearn.merging import (
    MERGES,
    ClientUpdate,
    MergeResult,
    firm_merge,
    fisher_damage,
    get_merge,
    kernels,
    normalize_and_sparsify,
    project_retention,
)
from fedunlearn.merging._chunks import CHUNK, spans
from fedunlearn.merging.projection import DEFAULT_SOLVER, SOLVERS
from strategies.results import json_safe
from strategies.upload_spool import UploadSpool

REPO_ROOT = Path(__file__).resolve().parents[1]

#: Shape of one adapted weight at the paper's WMDP scale (MLP up/gate projection of an 8B model).
PAPER_ROWS, PAPER_COLS = 14336, 4096
#: Default: a quarter of the paper's scale.
DEFAULT_ROWS, DEFAULT_COLS = 14336, 1024
#: The paper's server-side merge times (seconds), for context only.
PAPER_REFERENCE = {
    "firm_seconds": 217.0,
    "fulm_seconds": 547.0,
    "setting": "server merge at the paper's WMDP scale on a GPU server (FIRM paper)",
}
#: Issue 15's targets: each case's time over the fastest interleaved read pass.
TARGETS_VS_READ = {"firm-base": 3.0, "ties": 8.0, "fulm": 8.0}
#: The exact multi-constraint projection (m = ``multi_retain``) over FIRM base.
TARGET_EXACT_MULTI_VS_FIRM_BASE = 2.0
#: The single-constraint projection over FIRM base (an earlier target, still reported).
TARGET_PROJECTION_VS_FIRM_BASE = 1.0
#: The FIRM-base merge on uploads spooled to disk and read back one tensor at a time.
STREAMING_CASE = "firm-streaming"

#: Merges in the order they are reported (any other registered merge follows).
MERGE_ORDER = ("avg", "sum", "ties", "fulm", "fulm-mean", "firm")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

RANK = 16
TV_SCALE = 1e-3
TV_NOISE = 0.1
FISHER_SCALE = 1e-6
FISHER_SPREAD = 2.0

MEMORY_METHOD = (
    "extra peak RSS = VmHWM - VmRSS from /proc/self/status, with the high-water mark reset "
    "(5 written to /proc/self/clear_refs) right before each run, after gc and malloc_trim; "
    "inputs stay resident and are not counted, the case's output is"
)

BASELINE_METHOD = (
    "read pass = every task-vector and Fisher tensor of the main input converted to float32 "
    "slice by slice into one reused buffer and summed; one before every timed repetition of "
    "every case (and repeats of its own at the start); the baseline is the fastest of them"
)

_FIRM_DEFAULTS = {
    name: p.default
    for name, p in inspect.signature(firm_merge).parameters.items()
    if p.default is not inspect.Parameter.empty
}
ALPHA = float(_FIRM_DEFAULTS["alpha"])
EPS0 = float(_FIRM_DEFAULTS["eps0"])
#: Relative tolerance on the retention budget when checking feasibility (the τ of
#: docs/algorithms.md, "FIRM retention-constrained projection").
BUDGET_RTOL = 1e-4


@dataclass(frozen=True)
class BenchConfig:
    forget_clients: int = 6
    domains: int = 2
    retain_clients: int = 1
    multi_retain: int = 3
    tensors: int = 3
    rows: int = DEFAULT_ROWS
    cols: int = DEFAULT_COLS
    dtype: str = "bf16"
    seed: int = 0
    repeats: int = 3
    threads: int = 1
    epsilon_factor: float = 0.3
    fisher_correlation: float = 0.7
    paper_scale: bool = False
    #: Cases to time (``None``: all); ``read-pass`` always runs.
    cases: tuple[str, ...] | None = None


# ----------------------------------------------------------------------------------- memory
def _status_bytes(field: str) -> int | None:
    """``field`` (e.g. ``VmRSS``) of ``/proc/self/status`` in bytes, or ``None`` if unavailable."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _release_free_memory() -> None:
    """Return memory freed to glibc's allocator to the OS (``malloc_trim``), if available.

    Without it, a case could reuse pages a previous case freed but the allocator kept, and its
    peak would be under-reported.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_peak_rss() -> bool:
    """Reset the process's RSS high-water mark (Linux ≥ 4.0); ``False`` if not possible."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
    except OSError:
        return False
    return True


@dataclass
class Measurement:
    seconds: float
    all_seconds: list[float]
    peak_extra_bytes: int | None
    peak_rss_bytes: int | None
    output: Any


def measure(
    fn: Callable[[], Any], repeats: int, before: Callable[[], None] | None = None
) -> Measurement:
    """Run ``fn`` ``repeats`` times; best wall time, extra peak RSS and the last output.

    ``before`` (untimed here) runs before every repetition: the interleaved read pass.
    """
    times: list[float] = []
    peak_extra: int | None = None
    peak_abs: int | None = None
    out: Any = None
    for _ in range(repeats):
        out = None  # free the previous output before the next run
        if before is not None:
            before()
        gc.collect()
        _release_free_memory()
        rss0 = _status_bytes("VmRSS")
        reset = _reset_peak_rss()
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        hwm = _status_bytes("VmHWM")
        if hwm is not None:
            peak_abs = max(peak_abs or 0, hwm)
            if reset and rss0 is not None:
                peak_extra = max(peak_extra or 0, hwm - rss0)
    return Measurement(min(times), times, peak_extra, peak_abs, out)


# ----------------------------------------------------------------------------------- inputs
def tensor_keys(n: int) -> list[str]:
    return [f"model.layers.{i}.mlp.up_proj.weight" for i in range(n)]


def input_bytes(updates: Sequence[ClientUpdate]) -> int:
    total = 0
    for u in updates:
        for t in (*u.task_vector.values(), *(u.fisher or {}).values()):
            total += t.numel() * t.element_size()
    return total


def estimated_input_bytes(cfg: BenchConfig) -> int:
    clients = cfg.forget_clients + max(cfg.retain_clients, cfg.multi_retain)
    return 2 * clients * cfg.tensors * cfg.rows * cfg.cols * DTYPES[cfg.dtype].itemsize


def make_inputs(
    cfg: BenchConfig, *, progress: bool = False
) -> tuple[list[ClientUpdate], list[ClientUpdate]]:
    """``(updates, extra_retain)``: the main input and the retain clients the multi-m input adds.

    Forget client ``i`` belongs to domain ``i mod domains``.  See the module docstring for the
    distributions.  Deterministic for a given configuration.
    """
    gen = torch.Generator().manual_seed(cfg.seed)
    dtype = DTYPES[cfg.dtype]
    n_retain = max(cfg.retain_clients, cfg.multi_retain)
    roles = ["forget"] * cfg.forget_clients + ["retain"] * n_retain
    domains = [f"domain-{i % cfg.domains}" for i in range(cfg.forget_clients)] + [None] * n_retain
    ids = [f"forget-{i}" for i in range(cfg.forget_clients)] + [
        f"retain-{i}" for i in range(n_retain)
    ]
    tvs: list[dict[str, torch.Tensor]] = [{} for _ in roles]
    fishers: list[dict[str, torch.Tensor]] = [{} for _ in roles]
    rows, cols, rank = cfg.rows, cfg.cols, min(RANK, cfg.rows, cfg.cols)
    rho = cfg.fisher_correlation
    own = math.sqrt(1.0 - rho * rho)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    for key in tqdm(tensor_keys(cfg.tensors), desc="inputs", unit="tensor", disable=not progress):
        shared_log_fisher = randn(rows, cols)
        domain_factors = [(randn(rows, rank), randn(rank, cols)) for _ in range(cfg.domains)]
        for i, role in enumerate(roles):
            b_own, a_own = randn(rows, rank), randn(rank, cols)
            if role == "forget":
                b_dom, a_dom = domain_factors[i % cfg.domains]
                tv = torch.cat([b_dom, 0.5 * b_own], dim=1) @ torch.cat([a_dom, a_own], dim=0)
            else:
                tv = b_own @ a_own
            tv.mul_(TV_SCALE / math.sqrt(rank)).add_(randn(rows, cols), alpha=TV_SCALE * TV_NOISE)
            fisher = randn(rows, cols).mul_(own).add_(shared_log_fisher, alpha=rho)
            fisher.mul_(FISHER_SPREAD).exp_().mul_(FISHER_SCALE)
            tvs[i][key] = tv.to(dtype)
            fishers[i][key] = fisher.to(dtype)
            del tv, fisher
        del shared_log_fisher, domain_factors
    clients = [
        ClientUpdate(
            node_id=ids[i],
            role=roles[i],
            domain=domains[i],
            num_examples=100,
            task_vector=tvs[i],
            fisher=fishers[i],
        )
        for i in range(len(roles))
    ]
    n_main = cfg.forget_clients + cfg.retain_clients
    return clients[:n_main], clients[n_main:]


def read_pass(updates: Sequence[ClientUpdate]) -> float:
    """The baseline: every task-vector and Fisher tensor converted to float32 and summed once.

    Slice by slice into one reused float32 buffer: converting a whole tensor allocates a fresh
    buffer of its size, whose page faults cost ~3x the read itself, and whether glibc hands
    out fresh pages or reuses freed ones depends on what ran before (the fastest of such
    passes was 0.15 s after some cases and 0.6 s after others on the same input).
    """
    buffer = torch.empty(CHUNK, dtype=torch.float32)
    total = 0.0
    for u in updates:
        for key, tv in u.task_vector.items():
            for tensor in (tv, u.fisher[key]):  # type: ignore[index]
                flat = tensor.reshape(-1)
                for span in spans(flat.numel()):
                    part = buffer[: span.stop - span.start]
                    total += float(part.copy_(flat[span]).sum())
    return total


@dataclass
class ReadPasses:
    """The yardstick: a read pass of the main input before every timed repetition of a case.

    The baseline is the fastest of all of them, so a read pass that happened to run while the
    machine was busy (or while the allocator still had to fault in fresh pages) does not
    inflate every ratio.
    """

    updates: Sequence[ClientUpdate]
    seconds: list[float] = field(default_factory=list)
    checksum: float = 0.0

    def __call__(self) -> None:
        gc.collect()
        t0 = time.perf_counter()
        self.checksum = read_pass(self.updates)
        self.seconds.append(time.perf_counter() - t0)


# ------------------------------------------------------------------------------- projection
@dataclass
class ProjectionInput:
    base: dict[str, torch.Tensor]  # FIRM-base result per tensor, in float32
    fishers: dict[str, list[torch.Tensor]]  # sparsified F̃_k per tensor
    damage_before: dict[str, list[float]]
    epsilon: float


def projection_input(
    base: MergeResult, retain: Sequence[ClientUpdate], keys: Sequence[str], factor: float
) -> ProjectionInput:
    """FIRM-base result, the retain clients' ``F̃_k`` and ``epsilon = factor × mean damage``."""
    base32 = {k: base.delta[k].to(torch.float32) for k in keys}
    fts = {
        k: [normalize_and_sparsify(u.fisher[k], ALPHA, EPS0) for u in retain]  # type: ignore[index]
        for k in keys
    }
    damages = {k: [fisher_damage(base32[k], f) for f in fts[k]] for k in keys}
    flat = [d for k in keys for d in damages[k]]
    mean = sum(flat) / len(flat)
    if not mean > 0.0:
        raise RuntimeError("the FIRM-base result does no retention damage; nothing to project")
    return ProjectionInput(base32, fts, damages, factor * mean)


def projection_details(per_tensor: dict[str, dict], epsilon: float) -> dict[str, Any]:
    """Summary of per-tensor projection reports (solver fields and KKT certificate if present)."""
    reports = list(per_tensor.values())

    def worst(field: str) -> float | None:
        vals = [abs(float(r[field])) for r in reports if r.get(field) is not None]
        return max(vals) if vals else None

    after = [d for r in reports for d in r["damage_after"]]
    before = [d for r in reports for d in r["damage_before"]]
    summary = {
        "epsilon": epsilon,
        "active_tensors": sum(bool(r.get("active")) for r in reports),
        "tensors": len(reports),
        "iterations_total": sum(int(r.get("iterations", 0)) for r in reports),
        "sweeps_max": max(int(r.get("sweeps", 0)) for r in reports),
        "converged_all": all(bool(r.get("converged", True)) for r in reports),
        "feasibility_pass_any": any(bool(r.get("feasibility_pass")) for r in reports),
        "damage_before_max": max(before),
        "damage_after_max": max(after),
        "max_violation": worst("max_violation"),
        "max_primal_violation": worst("max_primal_violation"),
        "max_complementary_slackness": worst("max_complementary_slackness"),
        "max_abs_duality_gap": worst("duality_gap"),
    }
    return {"summary": summary, "per_tensor": per_tensor}


def _tensor_projection_report(report: dict) -> dict:
    return {
        k: report.get(k)
        for k in (
            "active",
            "multipliers",
            "damage_before",
            "damage_after",
            "iterations",
            "sweeps",
            "converged",
            "feasibility_pass",
            "max_violation",
            "max_primal_violation",
            "max_complementary_slackness",
            "duality_gap",
        )
        if k in report
    }


def firm_projection_reports(result: MergeResult) -> dict[str, dict]:
    """Per-tensor projection fields of a FIRM report, damages as lists over retain clients."""
    out = {}
    for key, t in result.report["tensors"].items():
        rep = dict(t.get("projection", {}))
        rep["damage_before"] = list(t["damage_before"].values())
        rep["damage_after"] = list(t["damage_after"].values())
        rep["multipliers"] = list(t["multipliers"].values())
        out[key] = _tensor_projection_report(rep)
    return out


# -------------------------------------------------------------------------------- benchmark
def merge_names() -> list[str]:
    ordered = [n for n in MERGE_ORDER if n in MERGES]
    return ordered + sorted(n for n in MERGES if n not in ordered)


def case_name(merge: str) -> str:
    return "firm-base" if merge == "firm" else merge


def _merge_details(result: MergeResult) -> dict[str, Any]:
    rep = result.report
    details: dict[str, Any] = {"norm_final": rep.get("norm_final")}
    for name in ("num_clusters", "clusters"):
        if name in rep:
            details[name] = rep[name]
    return details


def run_benchmark(cfg: BenchConfig, *, progress: bool = True) -> dict[str, Any]:
    """Build the inputs, time every case and return the JSON-able results (see module doc)."""
    old_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        return _run(cfg, progress=progress)
    finally:
        torch.set_num_threads(old_threads)


def _multi_solvers(cfg: BenchConfig) -> list[str]:
    return [s for s in ("exact", "increase-only") if cfg.multi_retain and s in SOLVERS]


def case_plan(cfg: BenchConfig) -> list[str]:
    """Every case name a run with ``cfg`` knows, in report order (ignores ``cfg.cases``)."""
    m1, mm = cfg.retain_clients, cfg.multi_retain
    plan = ["read-pass", *(case_name(n) for n in merge_names())]
    if "firm" in MERGES:
        plan.append(STREAMING_CASE)
    plan.append(f"projection-m{m1}")
    if mm:
        plan += [f"projection-m{mm}-{s}" for s in ("exact", "increase-only")]
    if "firm" in MERGES:
        plan.append(f"firm-projected-m{m1}")
    return plan


@dataclass
class _Bench:
    """State of one benchmark run: inputs, the interleaved read passes and the timed cases."""

    cfg: BenchConfig
    updates: list[ClientUpdate]
    extra_retain: list[ClientUpdate]
    reads: ReadPasses
    bar: Any
    cases: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def keys(self) -> list[str]:
        return tensor_keys(self.cfg.tensors)

    def wanted(self, name: str) -> bool:
        return name == "read-pass" or self.cfg.cases is None or name in self.cfg.cases

    def record(
        self,
        name: str,
        fn: Callable[[], Any],
        details: Callable[[Any], dict],
        prepare: Callable[[], None] | None = None,
    ) -> Any:
        """Time ``name`` (``prepare``, then a read pass, before every repetition, untimed) and
        store its case entry."""
        self.bar.set_postfix_str(name)

        def before() -> None:
            if prepare is not None:
                prepare()
            self.reads()

        m = measure(fn, self.cfg.repeats, before=before)
        self.cases[name] = {
            "seconds": m.seconds,
            "first_seconds": m.all_seconds[0],
            "all_seconds": m.all_seconds,
            "peak_extra_rss_bytes": m.peak_extra_bytes,
            "peak_rss_bytes": m.peak_rss_bytes,
            "details": details(m.output),
        }
        self.bar.update(1)
        return m.output


def _time_merges(bench: _Bench, need_base: bool) -> MergeResult | None:
    """Every registered merge with its defaults; returns the FIRM-base result if needed."""
    firm_base: MergeResult | None = None
    for merge in merge_names():
        fn = get_merge(merge)
        kwargs: dict[str, Any] = {"epsilon": math.inf} if merge == "firm" else {}
        if bench.wanted(case_name(merge)):
            result = bench.record(
                case_name(merge), lambda fn=fn, kw=kwargs: fn(bench.updates, **kw), _merge_details
            )
        elif merge == "firm" and need_base:
            result = fn(bench.updates, **kwargs)  # untimed: the projection cases need it
        else:
            continue
        if merge == "firm" and need_base:
            firm_base = result
        del result
    return firm_base


@dataclass
class SpooledRounds:
    """The uploads as the streaming server holds them, spooled afresh for every repetition.

    Each call starts a new round of ``spool`` (removing the previous round's files) and stores
    every update with :meth:`UploadSpool.store`, as the server stores a validated reply;
    ``updates`` are then the clients read back from the new files' memory maps.
    """

    spool: UploadSpool
    sources: Sequence[ClientUpdate]
    updates: list[ClientUpdate] = field(default_factory=list)
    write_seconds: list[float] = field(default_factory=list)
    spool_bytes: int = 0

    def __call__(self) -> None:
        self.updates = []
        gc.collect()
        self.spool.begin_round(len(self.write_seconds) + 1)
        t0 = time.perf_counter()
        for u in self.sources:
            shapes = {k: tuple(t.shape) for k, t in u.task_vector.items()}
            self.updates.append(self.spool.store(u, shapes))
        self.write_seconds.append(time.perf_counter() - t0)
        self.spool_bytes = sum(p.stat().st_size for p in self.spool.folder.rglob("*.safetensors"))


def _time_streaming(bench: _Bench) -> None:
    """FIRM base on uploads spooled by the server's spool, cold (spooled afresh per run)."""
    if "firm" not in MERGES or not bench.wanted(STREAMING_CASE):
        return
    root = REPO_ROOT / "outputs" / "bench"
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="spool-", dir=root) as folder:
        rounds = SpooledRounds(UploadSpool(Path(folder) / "uploads-spool"), bench.updates)
        try:
            bench.record(
                STREAMING_CASE,
                lambda: firm_merge(rounds.updates, epsilon=math.inf),
                lambda r: {
                    **_merge_details(r),
                    "spool_bytes": rounds.spool_bytes,
                    "spool_write_seconds": min(rounds.write_seconds),
                    "all_spool_write_seconds": rounds.write_seconds,
                    "inputs_in_memory": False,
                    "cold": "spooled afresh before every run (UploadSpool.store)",
                },
                prepare=rounds,
            )
        finally:
            rounds.updates = []
            rounds.spool.clear()


def _time_projections(
    bench: _Bench, firm_base: MergeResult | None
) -> tuple[float | None, float | None]:
    """Projection alone (m = 1, and m = ``multi_retain`` per solver) and FIRM projected."""
    cfg, keys, updates = bench.cfg, bench.keys, bench.updates
    dtype = DTYPES[cfg.dtype]
    retain = [u for u in updates if u.role == "retain"]
    m1, mm = len(retain), cfg.multi_retain
    p1 = None
    if firm_base is not None:
        p1 = projection_input(firm_base, retain, keys, cfg.epsilon_factor)

    def project(p: ProjectionInput, solver: str) -> dict[str, dict]:
        return {
            k: project_retention(
                p.base[k], p.fishers[k], p.epsilon, solver=solver, out_dtype=dtype
            )[1]
            for k in keys
        }

    def proj_details(p: ProjectionInput) -> Callable[[dict[str, dict]], dict]:
        def details(reports: dict[str, dict]) -> dict:
            per = {k: _tensor_projection_report(r) for k, r in reports.items()}
            return projection_details(per, p.epsilon)

        return details

    if p1 is not None and bench.wanted(f"projection-m{m1}"):
        bench.record(f"projection-m{m1}", lambda: project(p1, DEFAULT_SOLVER), proj_details(p1))
    epsilon_multi = None
    solvers = [s for s in _multi_solvers(cfg) if bench.wanted(f"projection-m{mm}-{s}")]
    if solvers:
        variant = [*updates, *bench.extra_retain]
        base_multi = get_merge("firm")(variant, epsilon=math.inf)
        pm = projection_input(base_multi, variant[cfg.forget_clients :], keys, cfg.epsilon_factor)
        del base_multi
        epsilon_multi = pm.epsilon
        for solver in solvers:
            bench.record(
                f"projection-m{mm}-{solver}", lambda s=solver: project(pm, s), proj_details(pm)
            )
        del pm
    if p1 is not None and bench.wanted(f"firm-projected-m{m1}"):
        eps1 = p1.epsilon
        bench.record(
            f"firm-projected-m{m1}",
            lambda: get_merge("firm")(updates, epsilon=eps1),
            lambda r: {
                **_merge_details(r),
                **projection_details(firm_projection_reports(r), eps1),
            },
        )
    return (None if p1 is None else p1.epsilon), epsilon_multi


def _plan(bench: _Bench) -> list[str]:
    cfg = bench.cfg
    mm = cfg.multi_retain
    if mm and "exact" not in SOLVERS and bench.wanted(f"projection-m{mm}-exact"):
        bench.notes.append(
            f"solver 'exact' is not available (available: {list(SOLVERS)}); "
            f"projection-m{mm}-exact was skipped"
        )
    return [name for name in case_plan(cfg) if bench.wanted(name)]


def _finish_baseline(bench: _Bench) -> dict[str, Any]:
    """The read-pass case (fastest of all interleaved passes), ratios and the AVG check."""
    seconds = bench.reads.seconds
    bench.cases["read-pass"] = {
        "seconds": min(seconds),
        "all_seconds": seconds,
        "peak_extra_rss_bytes": None,
        "peak_rss_bytes": None,
        "details": {"checksum": bench.reads.checksum, "passes": len(seconds)},
    }
    read_s = min(seconds)
    for c in bench.cases.values():
        c["ratio_to_read_pass"] = c["seconds"] / read_s if read_s > 0 else math.inf
    avg = bench.cases.get("avg")
    check = {
        "read_pass_seconds": read_s,
        "read_pass_passes": len(seconds),
        "avg_seconds": None if avg is None else avg["seconds"],
        "avg_below_read_pass": avg is not None and avg["seconds"] < read_s,
    }
    if check["avg_below_read_pass"]:
        bench.notes.append(
            "WARNING: AVG ran faster than the fastest read pass; the baseline is not a floor "
            "on this run and the ratios are not trustworthy"
        )
    return check


def _run(cfg: BenchConfig, *, progress: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    updates, extra_retain = make_inputs(cfg, progress=progress)
    generation_s = time.perf_counter() - t0
    bench = _Bench(cfg, updates, extra_retain, ReadPasses(updates), None)
    plan = _plan(bench)
    bench.bar = tqdm(total=len(plan), desc="bench", unit="case", disable=not progress)
    for _ in range(cfg.repeats):
        bench.reads()
    bench.bar.update(1)
    m1, mm = cfg.retain_clients, cfg.multi_retain
    need_base = bench.wanted(f"projection-m{m1}") or bench.wanted(f"firm-projected-m{m1}")
    firm_base = _time_merges(bench, need_base)
    if need_base and firm_base is None:
        raise RuntimeError("the 'firm' merge is not registered; cannot benchmark the projection")
    _time_streaming(bench)
    eps1, eps_multi = _time_projections(bench, firm_base)
    del firm_base
    bench.bar.close()
    check = _finish_baseline(bench)
    mm_target = mm if bench.wanted(f"projection-m{mm}-exact") else 0
    return {
        "benchmark": "bench_merge",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": asdict(cfg),
        "environment": _environment(cfg),
        "input": _input_summary(cfg, updates, extra_retain, generation_s),
        "memory_method": MEMORY_METHOD,
        "baseline_method": BASELINE_METHOD,
        "baseline_check": check,
        "solvers_available": list(SOLVERS),
        "default_solver": DEFAULT_SOLVER,
        "epsilon": {
            "factor": cfg.epsilon_factor,
            f"m{m1}": eps1,
            f"m{mm}": eps_multi,
            "rule": "factor × mean over tensors and retain clients of the FIRM-base damage",
        },
        "case_order": plan,
        "cases": bench.cases,
        "targets": targets(bench.cases, m1, mm_target),
        "paper_reference": PAPER_REFERENCE,
        "notes": bench.notes,
    }


def _environment(cfg: BenchConfig) -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": cfg.threads,
        "merge_kernels": kernels.mode(),
        "compiler_available": kernels.compiler_available(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def _input_summary(
    cfg: BenchConfig,
    updates: Sequence[ClientUpdate],
    extra_retain: Sequence[ClientUpdate],
    generation_s: float,
) -> dict[str, Any]:
    main_bytes = input_bytes(updates)
    return {
        "tensor_shape": [cfg.rows, cfg.cols],
        "entries_per_tensor": cfg.rows * cfg.cols,
        "fraction_of_paper_entries": cfg.rows * cfg.cols / (PAPER_ROWS * PAPER_COLS),
        "clients": [str(u.node_id) for u in updates],
        "main_bytes": main_bytes,
        "main_gb": main_bytes / 1e9,
        "multi_retain_extra_bytes": input_bytes(extra_retain) if cfg.multi_retain else 0,
        "generation_seconds": generation_s,
    }


def _target(name: str, value: float | None, limit: float) -> dict[str, Any]:
    return {
        "name": name,
        "value": value,
        "limit": limit,
        "met": value is not None and value <= limit,
    }


def targets(cases: dict[str, dict], m1: int, mm: int) -> list[dict[str, Any]]:
    """Issue 15's targets (ratios in this run), and the earlier projection (m = 1) target."""
    out: list[dict[str, Any]] = []
    for case, limit in TARGETS_VS_READ.items():
        if case in cases:
            label = "FIRM base" if case == "firm-base" else case.upper()
            name = f"{label} <= {limit:g}x read pass"
            out.append(_target(name, cases[case]["ratio_to_read_pass"], limit))
    firm = cases.get("firm-base")
    proj = cases.get(f"projection-m{m1}")
    if firm is not None and proj is not None:
        name = f"projection (m={m1}) <= {TARGET_PROJECTION_VS_FIRM_BASE:g}x FIRM base"
        ratio = proj["seconds"] / firm["seconds"]
        out.append(_target(name, ratio, TARGET_PROJECTION_VS_FIRM_BASE))
    exact = cases.get(f"projection-m{mm}-exact")
    if mm and firm is not None:
        name = f"exact projection (m={mm}) <= {TARGET_EXACT_MULTI_VS_FIRM_BASE:g}x FIRM base"
        ratio = None if exact is None else exact["seconds"] / firm["seconds"]
        out.append(_target(name, ratio, TARGET_EXACT_MULTI_VS_FIRM_BASE))
    return out


# ----------------------------------------------------------------------------------- report
def _gb(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 1e9:.2f}"


def _sci(x: Any) -> str:
    return "-" if x is None else f"{x:.1e}"


def _case_note(case: dict[str, Any]) -> str:
    d = case["details"]
    if "summary" in d:
        s = d["summary"]
        return (
            f"active {s['active_tensors']}/{s['tensors']}, it {s['iterations_total']}, "
            f"sweeps<={s['sweeps_max']}, conv {s['converged_all']}, "
            f"viol {_sci(s['max_primal_violation'])}, slack "
            f"{_sci(s['max_complementary_slackness'])}, gap {_sci(s['max_abs_duality_gap'])}"
        )
    if "num_clusters" in d:
        return f"{d['num_clusters']} clusters"
    return ""


def _baseline_lines(results: dict[str, Any]) -> list[str]:
    check = results["baseline_check"]
    reads = results["cases"]["read-pass"]["all_seconds"]
    lines = [
        f"Baseline: fastest of {check['read_pass_passes']} interleaved read passes = "
        f"{check['read_pass_seconds']:.3f} s (slowest {max(reads):.3f} s, median "
        f"{sorted(reads)[len(reads) // 2]:.3f} s)"
    ]
    if check["avg_seconds"] is not None:
        verdict = "BELOW THE BASELINE (warning)" if check["avg_below_read_pass"] else "ok"
        lines.append(f"AVG {check['avg_seconds']:.3f} s vs baseline: {verdict}")
    return lines


def _streaming_lines(cases: dict[str, dict]) -> list[str]:
    stream, base = cases.get(STREAMING_CASE), cases.get("firm-base")
    if stream is None:
        return []
    line = (
        f"{STREAMING_CASE}: peak extra RSS {_gb(stream['peak_extra_rss_bytes'])} GB, uploads "
        f"on disk {stream['details']['spool_bytes'] / 1e9:.2f} GB (not in memory), spooled "
        f"afresh before every run in {stream['details']['spool_write_seconds']:.2f} s"
    )
    if base is not None:
        line += (
            f"; in-memory firm-base: peak extra {_gb(base['peak_extra_rss_bytes'])} GB on top of "
            "the resident uploads"
        )
    return [line]


def format_report(results: dict[str, Any]) -> str:
    cfg = results["config"]
    inp = results["input"]
    cases = results["cases"]
    lines = [
        f"Merge benchmark: {len(inp['clients'])} clients ({cfg['forget_clients']} forget in "
        f"{cfg['domains']} domains + {cfg['retain_clients']} retain), {cfg['tensors']} tensors "
        f"of {cfg['rows']}x{cfg['cols']} ({inp['fraction_of_paper_entries']:.3g}x the paper's "
        f"entries per tensor), {cfg['dtype']}, {cfg['threads']} thread(s), best of "
        f"{cfg['repeats']}",
        f"Merge kernels: ${kernels.MODE_ENV}={results['environment']['merge_kernels']} "
        f"(C++ compiler for inductor: {results['environment']['compiler_available']})",
        f"Input size: {inp['main_gb']:.3f} GB (task vectors + Fisher diagonals; the "
        f"m={cfg['multi_retain']} input adds {inp['multi_retain_extra_bytes'] / 1e9:.3f} GB); "
        f"generated in {inp['generation_seconds']:.1f} s",
        f"Memory: {results['memory_method']}",
        "",
        f"{'case':<30} {'seconds':>9} {'first s':>9} {'x read':>8} {'+peak GB':>9}  notes",
        "-" * 110,
    ]
    for name in results["case_order"]:
        c = cases.get(name)
        if c is None:
            lines.append(f"{name:<30} {'skipped':>9}")
            continue
        first = c.get("first_seconds")
        lines.append(
            f"{name:<30} {c['seconds']:>9.3f} {'' if first is None else f'{first:.3f}':>9} "
            f"{c['ratio_to_read_pass']:>8.2f} "
            f"{_gb(c['peak_extra_rss_bytes']):>9}  {_case_note(c)}"
        )
    eps = results["epsilon"]
    lines += ["", "epsilon: " + ", ".join(f"{k}={v}" for k, v in eps.items() if k != "rule")]
    lines += ["", *_baseline_lines(results), *_streaming_lines(cases), "", "Targets:"]
    for t in results["targets"]:
        value = "-" if t["value"] is None else f"{t['value']:.2f}"
        verdict = "MET" if t["met"] else "NOT MET"
        lines.append(f"  {t['name']:<44} {value:>8}  {verdict}")
    ref = results["paper_reference"]
    paper_ratio = ref["fulm_seconds"] / ref["firm_seconds"]
    firm, fulm = cases.get("firm-base"), cases.get("fulm")
    lines += [
        "",
        f"Paper reference ({ref['setting']}): FIRM {ref['firm_seconds']:.0f} s, FULM "
        f"{ref['fulm_seconds']:.0f} s (FULM/FIRM = {paper_ratio:.2f})",
    ]
    if firm is not None and fulm is not None:
        lines.append(
            f"This run: FIRM base {firm['seconds']:.2f} s, FULM {fulm['seconds']:.2f} s "
            f"(FULM/FIRM = {fulm['seconds'] / firm['seconds']:.2f})"
        )
    lines += [f"Note: {n}" for n in results["notes"]]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- CLI
def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m simulations.bench_merge",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("--forget-clients", type=_positive_int, default=6)
    p.add_argument("--domains", type=_positive_int, default=2, help="forget domains")
    p.add_argument("--retain-clients", type=_positive_int, default=1)
    p.add_argument(
        "--multi-retain",
        type=_non_negative_int,
        default=3,
        help="retain clients of the multi-constraint projection input (0 skips it)",
    )
    p.add_argument("--tensors", type=_positive_int, default=3)
    p.add_argument("--rows", type=_positive_int, default=None, help=f"default {DEFAULT_ROWS}")
    p.add_argument("--cols", type=_positive_int, default=None, help=f"default {DEFAULT_COLS}")
    p.add_argument(
        "--paper-scale",
        action="store_true",
        help=f"tensors of {PAPER_ROWS}x{PAPER_COLS} (4x the default), 1 repeat unless given",
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--repeats", type=_positive_int, default=None, help="default 3 (1 at paper scale)"
    )
    p.add_argument("--threads", type=_positive_int, default=None, help="default: all CPUs")
    p.add_argument(
        "--epsilon-factor",
        type=float,
        default=0.3,
        help="budget = factor x mean FIRM-base damage; in (0, 1) so the projection is active",
    )
    p.add_argument("--fisher-correlation", type=float, default=0.7, help="in [0, 1)")
    p.add_argument(
        "--cases",
        default=None,
        help="comma-separated case names to time (default: all; read-pass always runs)",
    )
    p.add_argument("--output", type=Path, default=None, help="JSON path (default outputs/bench/)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> BenchConfig:
    if args.paper_scale and (args.rows is not None or args.cols is not None):
        parser.error("--paper-scale fixes the shape; do not combine it with --rows/--cols")
    if args.domains > args.forget_clients:
        parser.error(
            f"--domains ({args.domains}) must not exceed --forget-clients ({args.forget_clients}): "
            "every forget domain needs a client"
        )
    if args.multi_retain and args.multi_retain <= args.retain_clients:
        parser.error(
            f"--multi-retain ({args.multi_retain}) must exceed --retain-clients "
            f"({args.retain_clients}), or be 0 to skip the multi-constraint projection"
        )
    if not 0.0 < args.epsilon_factor < 1.0:
        parser.error(f"--epsilon-factor must be in (0, 1), got {args.epsilon_factor}")
    if not 0.0 <= args.fisher_correlation < 1.0:
        parser.error(f"--fisher-correlation must be in [0, 1), got {args.fisher_correlation}")
    rows = PAPER_ROWS if args.paper_scale else (args.rows or DEFAULT_ROWS)
    cols = PAPER_COLS if args.paper_scale else (args.cols or DEFAULT_COLS)
    repeats = args.repeats or (1 if args.paper_scale else 3)
    cfg = BenchConfig(
        forget_clients=args.forget_clients,
        domains=args.domains,
        retain_clients=args.retain_clients,
        multi_retain=args.multi_retain,
        tensors=args.tensors,
        rows=rows,
        cols=cols,
        dtype=args.dtype,
        seed=args.seed,
        repeats=repeats,
        threads=args.threads or os.cpu_count() or 1,
        epsilon_factor=args.epsilon_factor,
        fisher_correlation=args.fisher_correlation,
        paper_scale=args.paper_scale,
    )
    if args.cases is not None:
        names = tuple(dict.fromkeys(n.strip() for n in args.cases.split(",") if n.strip()))
        known = case_plan(cfg)
        unknown = [n for n in names if n not in known]
        if not names or unknown:
            parser.error(
                f"--cases: unknown case name(s) {unknown or [args.cases]}; known: "
                + ", ".join(known)
            )
        cfg = replace(cfg, cases=names)
    need = estimated_input_bytes(cfg)
    avail = _meminfo_bytes("MemAvailable")
    if avail is not None and need > avail:
        parser.error(
            f"the inputs alone need about {need / 1e9:.1f} GB but only {avail / 1e9:.1f} GB of "
            "memory is available; use fewer/smaller tensors or --dtype bf16"
        )
    if avail is not None and 2 * need > avail:
        print(
            f"warning: the inputs need about {need / 1e9:.1f} GB of the {avail / 1e9:.1f} GB "
            "available; the merges need more on top",
            file=sys.stderr,
        )
    return cfg


def _meminfo_bytes(field: str) -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg = config_from_args(args, parser)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    output = args.output or REPO_ROOT / "outputs" / "bench" / f"bench_merge-{stamp}.json"
    results = run_benchmark(cfg, progress=not args.no_progress)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(
        json.dumps(json_safe(results, non_finite_as_null=True), indent=2) + "\n", encoding="utf-8"
    )
    print(format_report(results))
    print(f"\nJSON written to {output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
