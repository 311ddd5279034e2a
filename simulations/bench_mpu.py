"""MPU's server-side overhead at SmolLM2-135M size against one client's local round.

    OMP_WAIT_POLICY=PASSIVE python -m simulations.bench_mpu [--copies 2] [--clients 3]
        [--threads 2] [--repeats 2]

What is timed, all in one process with ``--threads`` torch threads, on two clocks: wall time
(``time.perf_counter``) and the process's CPU time (``time.process_time``, every thread);
every figure is the fastest of ``--repeats`` runs. On a machine others share, wall times swing
with their load from one phase to the next; CPU times much less, provided idle OpenMP threads
sleep instead of spinning (``OMP_WAIT_POLICY=PASSIVE``, read when torch starts, so set it in
the environment: spinning threads count as busy). Under contention the CPU ratio is the one to
trust (the load average is printed); on an idle machine the wall ratio is what a run sees.

* **publish**: :meth:`MpuStrategy.node_content` for every client of a round, i.e. per client the
  m copies θ_pub,k = T_k(θ + α_k ε⁰_k) — noise, reparameterisation and the Flower arrays they
  travel in — once per round in ``--repeats`` rounds; one client's share is the fastest round's
  total over its clients (the round's σ_ℓ included). With ``mpu.publish=per-round`` the first
  client's call builds the copies and the others reuse them;
* **one client's local round**: what ``clients.client_app`` does with one copy (rebuild the
  model from the copy's arrays, the Fisher diagonal over ``--fisher-batches`` batches, LoRA on
  ``--lora-targets`` with the NLL objective, the upload encoded as the run defaults encode it:
  factors and a top-k Fisher). The LoRA steps are measured at two probe lengths
  (``--probe-steps``, e.g. 2 and 4) and extrapolated linearly to ``--steps`` (the time of one
  step is the difference; setup, Fisher and encoding are the shorter probe's), then × m copies;
* **map back**: :meth:`MpuStrategy.decode_reply` on a reply of m copies (validation, decoding,
  T_k⁻¹ of the task vector and Fisher, harmonic aggregation), built from the probe's upload
  (the same upload stands for every copy: the cost does not depend on the values); apart, the
  part of it that validates the copies (``validate_reply_content``, m times), and, for
  comparison, T_k⁻¹ of the task vector alone, dense against on the LoRA factors
  (:func:`fedunlearn.mpu.map_back`).

Ratios: per client, (publish + map back) / local round, the publish of a per-round run shared
by the round's clients; per round, (every client's publish + map back) / local round, i.e.
the server's sequential work against clients that train in parallel. Defaults are the run
defaults of a registry model (``strategies.settings.PRETRAINED_DEFAULTS`` over the run
config's: LoRA r = 16 on ``q_proj,v_proj``, 4 Fisher batches, 10 retain steps at lr 2e-4,
batch 8, 2 forget clients + 1 retain client, factor and top-k Fisher uploads, m = 2, κ = 0.01)
on the first TOFU author's 20 QA. Writes JSON to ``--output`` (default
``outputs/bench/bench_mpu-<time>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from clients.client_app import local_update
from fedunlearn.models.llama import load_local_causal_lm
from fedunlearn.models.options import ModelOptions
from fedunlearn.models.pretrained import pretrained_checkpoint
from fedunlearn.mpu import invert_delta, map_back
from fedunlearn.qa_format import encode_record
from fedunlearn.scenarios import ClientAssignment
from fedunlearn.training.lora import LocalTrainSettings
from fedunlearn.upload_codec import DecodedTensors
from strategies.mpu_options import MPU_PUBLISH
from strategies.mpu_strategy import MpuStrategy
from strategies.reply_validation import validate_reply_content
from strategies.settings import RunSettings
from wire.messages import describe_model, rebuild_model, wire_state

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
TARGET_PERCENT = 10.0
CLOCKS = ("wall", "cpu")
SECRET = b"bench-mpu-fixed-secret"
#: the run defaults of a registry model (LoRA targets, clients, Fisher batches, steps, uploads)
RUN = RunSettings(model=ModelOptions(name=MODEL)).resolved()


@dataclass(frozen=True)
class BenchConfig:
    """The benchmark's settings (defaults: the real-model run defaults, m = 2)."""

    model_path: str = ""  # "" = the registry's SmolLM2-135M, converted into --cache-dir
    cache_dir: str = str(REPO_ROOT / ".cache")
    tofu_dir: str = str(REPO_ROOT.parent / "shared" / "data" / "tofu")
    records: int = 20
    copies: int = RUN.mpu.copies
    clients: int = RUN.scenario.num_forget_clients + RUN.scenario.num_retain_clients
    threads: int = 2
    fisher_batches: int = RUN.training.fisher_batches
    steps: int = RUN.training.retain_steps
    probe_steps: tuple[int, int] = (2, 4)
    repeats: int = 2
    lora_rank: int = RUN.lora.rank
    lora_alpha: float = RUN.lora.alpha
    lora_targets: str = RUN.lora.targets
    batch_size: int = RUN.training.batch_size
    lr: float = RUN.training.retain_lr
    kappa: float = RUN.mpu.kappa
    publish: tuple[str, ...] = MPU_PUBLISH


def load(cfg: BenchConfig) -> tuple[Any, Any, list]:
    """The model (float32, CPU), its tokenizer and the first ``records`` TOFU QA encoded."""
    folder = Path(cfg.model_path) if cfg.model_path else None
    folder = folder or pretrained_checkpoint(MODEL, Path(cfg.cache_dir))
    model, tokenizer = load_local_causal_lm(folder, dtype=torch.float32)
    lines = (Path(cfg.tofu_dir) / "full.json").read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines[: cfg.records]]
    return model.eval(), tokenizer, [encode_record(tokenizer, r) for r in records]


def make_strategy(model: Any, cfg: BenchConfig, publish: str) -> MpuStrategy:
    """MPU around FIRM for ``clients`` clients (the last one a retain client)."""
    roles = ["forget"] * (cfg.clients - 1) + ["retain"]
    assignments = [ClientAssignment(role, "d", (i,)) for i, role in enumerate(roles)]
    strategy = MpuStrategy(
        merge="firm",
        model_config=model.config,
        secret=SECRET,
        copies=cfg.copies,
        kappa=cfg.kappa,
        publish=publish,
        assignments=assignments,
    )
    strategy.node_assignment = {100 + i: a for i, a in enumerate(assignments)}
    return strategy


def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, dict[str, float]]:
    """``fn(*args, **kwargs)`` and its seconds on both clocks (see the module docstring)."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn(*args, **kwargs)
    return result, {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}


def time_publish(
    strategy: MpuStrategy, arrays: ArrayRecord, clients: int, rounds: int
) -> tuple[list[list[dict[str, float]]], RecordDict]:
    """Seconds of ``node_content`` for each client of rounds 1..``rounds``, and the content
    client 0 received in round 1."""
    strategy.global_arrays = arrays
    seconds, first = [], None
    for server_round in range(1, rounds + 1):
        seconds.append([])
        for position in range(clients):
            content, spent = timed(
                strategy.node_content, server_round, position, arrays, ConfigRecord({})
            )
            seconds[-1].append(spent)
            first = first if first is not None else content
    return seconds, first


def client_config(model: Any, tokenizer: Any, cfg: BenchConfig) -> ConfigRecord:
    """What a client reads from its TRAIN message (model skeleton, LoRA, Fisher, uploads)."""
    return ConfigRecord(
        {
            **describe_model(model, tokenizer),
            "lora-rank": cfg.lora_rank,
            "lora-alpha": cfg.lora_alpha,
            "lora-targets": cfg.lora_targets,
            "lora-layers": "all",
            "fisher-batches": cfg.fisher_batches,
            "task-vector-upload": RUN.upload.task_vector,
            "fisher-upload": RUN.upload.fisher,
            "fisher-upload-fraction": RUN.upload.fisher_fraction,
        }
    )


def client_round(
    arrays: ArrayRecord, config: ConfigRecord, examples: list, pad_id: int, cfg: BenchConfig
) -> tuple[dict[str, dict[str, float]], tuple[dict, dict]]:
    """One copy's local work (see the module docstring) extrapolated to ``steps`` LoRA steps,
    per clock, from the fastest of ``repeats`` runs of each probe length (interleaved);
    returns the seconds of each part and the upload parts of a short probe."""
    model, rebuild = timed(rebuild_model, config, arrays)
    low, high = cfg.probe_steps
    best: dict[int, dict[str, float]] = {}
    uploads: dict[int, tuple[dict, dict]] = {}
    for _ in range(cfg.repeats):
        for steps in (low, high):
            settings = LocalTrainSettings(
                objective="nll", steps=steps, lr=cfg.lr, batch_size=cfg.batch_size, seed=0
            )
            output, spent = timed(
                local_update,
                model,
                examples,
                config,
                settings,
                pad_token_id=pad_id,
                retain_examples=None,
                alternate_examples=None,
            )
            best[steps] = {c: min(spent[c], best.get(steps, spent)[c]) for c in CLOCKS}
            uploads[steps] = output[:2]
    step = {c: max(0.0, (best[high][c] - best[low][c]) / (high - low)) for c in CLOCKS}
    copy = {c: rebuild[c] + best[low][c] + (cfg.steps - low) * step[c] for c in CLOCKS}
    parts = {
        "rebuild": rebuild,
        "probe_low": best[low],
        "probe_high": best[high],
        "lora_step": step,
        "one_copy": copy,
        "round": {c: cfg.copies * copy[c] for c in CLOCKS},
    }
    return parts, uploads[low]


def reply_content(upload: tuple[dict, dict], copies: int, examples: int) -> RecordDict:
    """A client's reply holding the same upload for each of ``copies`` copies (``copies`` = 0:
    an ordinary single reply, ``task_vector`` / ``fisher``)."""
    tv, fisher = upload
    content = RecordDict(
        {
            "metrics": MetricRecord({"num-examples": examples}),
            "info": ConfigRecord({"role": "forget", "domain": "d", "objective": "ga"}),
        }
    )
    for suffix in [f"-{k}" for k in range(copies)] or [""]:
        content[f"task_vector{suffix}"] = ArrayRecord(dict(tv))
        content[f"fisher{suffix}"] = ArrayRecord(dict(fisher))
    return content


def time_map_back(
    strategy: MpuStrategy, upload: tuple[dict, dict], examples: int, server_round: int, repeats: int
) -> dict[str, dict[str, float]]:
    """The fastest of ``repeats`` timings of: ``decode_reply`` of client 0's reply in
    ``server_round`` (whose keys are drawn: the round just published); the part of it that
    validates each copy (``validate_reply_content``); T⁻¹ of the task vector, dense and on the
    factors."""
    node_id = next(iter(strategy.node_assignment))
    reply = reply_content(upload, strategy.copies, examples)
    single, spec = reply_content(upload, 0, examples), strategy.reply_spec(node_id)
    transforms = [strategy.copy_transforms(server_round, 0, k) for k in range(strategy.copies)]
    dense_parts = dict(DecodedTensors.from_parts(upload[0]))
    cases = {
        "decode_reply": lambda: strategy.decode_reply(server_round, node_id, reply),
        "validate": lambda: [validate_reply_content(node_id, single, spec) for _ in transforms],
        "tv_dense": lambda: [invert_delta(dense_parts, tf) for tf in transforms],
        "tv_factors": lambda: [map_back(upload[0], tf) for tf in transforms],
    }
    best: dict[str, dict[str, float]] = {}
    for _ in range(repeats):
        for name, case in cases.items():
            _, spent = timed(case)
            best[name] = {c: min(spent[c], best.get(name, spent)[c]) for c in CLOCKS}
    return best


def run_benchmark(cfg: BenchConfig) -> dict[str, Any]:
    """Every measurement of the module docstring, in one process."""
    torch.set_num_threads(cfg.threads)
    model, tokenizer, examples = load(cfg)
    arrays = wire_state(model)
    config = client_config(model, tokenizer, cfg)
    rows, local = [], None
    for publish in cfg.publish:
        strategy = make_strategy(model, cfg, publish)
        publish_s, content = time_publish(strategy, arrays, cfg.clients, cfg.repeats)
        if local is None:  # the client's work does not depend on how the copies were made
            local, upload = client_round(
                content["arrays-0"], config, examples, tokenizer.pad_token_id, cfg
            )
        maps = time_map_back(strategy, upload, len(examples), cfg.repeats, cfg.repeats)
        rows.append(summarise(publish, publish_s, maps, local["round"]))
        del strategy, content
    return {
        "config": asdict(cfg),
        "machine": {"platform": platform.platform(), "processor": platform.processor()},
        "load_average": os.getloadavg(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        "client_round": local,
        "rows": rows,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def summarise(
    publish: str,
    publish_s: Sequence[Sequence[dict[str, float]]],
    maps: dict[str, dict[str, float]],
    round_s: dict[str, float],
) -> dict[str, Any]:
    """One table row per clock: seconds and the two ratios of the module docstring (percent);
    one client's publish is the fastest round's total over its clients."""
    clients = len(publish_s[0])
    row: dict[str, Any] = {"publish": publish, "publish_s": publish_s, "maps": maps}
    for clock in CLOCKS:
        per_client = min(sum(s[clock] for s in one) for one in publish_s) / clients
        overhead = per_client + maps["decode_reply"][clock]
        row[clock] = {
            "publish_per_client_s": per_client,
            "map_back_s": maps["decode_reply"][clock],
            "round_s": round_s[clock],
            "percent_per_client": 100 * overhead / round_s[clock],
            "percent_per_round": 100 * clients * overhead / round_s[clock],
        }
    return row


def format_report(results: dict[str, Any]) -> str:
    """The table and the client round's parts as text."""
    cfg, local = results["config"], results["client_round"]
    wall = {k: v["wall"] for k, v in local.items()}
    low, high = cfg["probe_steps"]
    lines = [
        f"MPU overhead, m = {cfg['copies']}, {cfg['clients']} clients, LoRA r = "
        f"{cfg['lora_rank']} on {cfg['lora_targets']}, {cfg['threads']} threads "
        f"(OMP_WAIT_POLICY={results['omp_wait_policy'] or 'unset'}); load average "
        f"{', '.join(f'{x:.1f}' for x in results['load_average'])} at the end",
        f"one client's local round: {wall['round']:.1f} s wall = {cfg['copies']} copies × "
        f"({wall['rebuild']:.1f} s rebuild + {wall['probe_low']:.1f} s Fisher, setup, "
        f"{low} LoRA steps and encoding + {cfg['steps'] - low} more steps × "
        f"{wall['lora_step']:.2f} s, the step from {low} and {high} steps); CPU "
        f"{local['round']['cpu']:.1f} s; fastest of {cfg['repeats']} repeats throughout",
        "",
        "| publish | clock | publish s / client | map back s / client (validation) | round s "
        "| % per client | % per round | T⁻¹ task vector dense / factors s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        maps = row["maps"]
        for clock in CLOCKS:
            r = row[clock]
            lines.append(
                f"| {row['publish']} | {clock} | {r['publish_per_client_s']:.2f} "
                f"| {r['map_back_s']:.2f} ({maps['validate'][clock]:.2f}) | {r['round_s']:.1f} "
                f"| {r['percent_per_client']:.1f} | {r['percent_per_round']:.1f} "
                f"| {maps['tv_dense'][clock]:.3f} / {maps['tv_factors'][clock]:.3f} |"
            )
    met = {
        clock: all(r[clock]["percent_per_client"] <= TARGET_PERCENT for r in results["rows"])
        for clock in CLOCKS
    }
    verdict = ", ".join(f"{clock} {'met' if ok else 'NOT met'}" for clock, ok in met.items())
    lines += [
        "",
        f"target: publish + map back <= {TARGET_PERCENT:.0f} % of a client's round (per "
        f"client): {verdict}; peak RSS {results['peak_rss_mb']:.0f} MB",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    defaults = BenchConfig()
    for name in ("copies", "clients", "threads", "fisher_batches", "steps", "records", "repeats"):
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name)
        )
    parser.add_argument("--probe-steps", type=int, nargs=2, default=list(defaults.probe_steps))
    parser.add_argument("--lora-targets", default=defaults.lora_targets)
    parser.add_argument("--lora-rank", type=int, default=defaults.lora_rank)
    parser.add_argument("--model-path", default="", help="a checkpoint folder (default SmolLM2)")
    parser.add_argument("--cache-dir", default=defaults.cache_dir)
    parser.add_argument("--tofu-dir", default=defaults.tofu_dir, help="holds TOFU's full.json")
    parser.add_argument("--publish", default=",".join(defaults.publish))
    parser.add_argument("--output", type=Path, default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    low, high = args.probe_steps
    if not 0 < low < high <= args.steps:
        raise SystemExit("--probe-steps needs 0 < first < second <= --steps")
    cfg = BenchConfig(
        **{k: v for k, v in vars(args).items() if k not in ("output", "publish", "probe_steps")},
        probe_steps=(low, high),
        publish=tuple(p.strip() for p in args.publish.split(",") if p.strip()),
    )
    results = run_benchmark(cfg)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    output = args.output or REPO_ROOT / "outputs" / "bench" / f"bench_mpu-{stamp}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(format_report(results))
    print(f"\nJSON written to {output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
