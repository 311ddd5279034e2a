"""MPU's threat model, measured: what a client that aligns its m copies recovers.

    python -m simulations.mpu_attack [--model builtin|smollm2-135m] [--kappas 0.001,0.01,0.05]
        [--copies 2,3,4] [--defenses none,shared-noise,...] [--shared-kappas 0.01]
        [--run-config "..."] [--run-defaults] [--output-dir DIR]

The server's model θ is the run's model (``--model builtin``: the tofu substrate of the run
config; ``smollm2-135m``: the registry's SmolLM2-135M-Instruct). For every cell (κ, m, KV-group
permutation on / off, defense) the copies are published with the functions the MPU strategy
publishes with (:func:`fedunlearn.mpu.perturbed_copies` with T_k from
:func:`fedunlearn.mpu.draw_transforms`, keys from a fixed study secret so the study is
reproducible), then attacked with :mod:`fedunlearn.mpu.alignment` by a client that knows the
algorithm but not the keys. Each estimate is scored against θ:

* ``max_dlogit``: max |logits − θ's logits| over the tokens of held-out text (tofu: the
  never-trained holdout authors' QA; SmolLM2: TOFU QA);
* ``kl``: mean KL(p_θ ‖ p_estimate) of the next-token distributions on the same tokens;
* ``weight_error``: ‖T_1⁻¹(estimate) − θ‖ / ‖θ‖ over the decoder layers, the estimate taken
  back through copy 1's true map (the function-preserving map the attacker cannot undo, and
  need not: the estimate already computes what θ computes);
* builtin only (``--no-evaluate`` skips it), in every cell with the permutation on: the
  scenario's metrics of the recovered model and of one copy next to the server's model's
  (against the scenario's retain-only reference, as a run scores them).

Estimates: one copy as is; the naive (unaligned) mean; the aligned harmonic mean with the
published α_k; the aligned minimum-norm combination (no α needed). Each estimate's leak ratio
(one copy's max |Δlogits| ÷ the estimate's) is reported on its own. The attacker cannot tell
which of the two aligned estimates is closer to θ (that needs θ), so the best of the two,
``leak_upper_bound``, is an upper bound on what an attacker achieves, not a measured attack;
the attacker's own choice needs no θ: the harmonic mean where the α_k are the public grid, the
minimum-norm combination under ``secret-scales`` (``attacker_estimate``, ``leak_ratio``).
The ``shared-noise`` defense runs once per ``--shared-kappas`` value κ_η (σ_η = κ_η·RMS of the
layer, what ``mpu.shared-kappa`` sets in a run). ``--run-defaults`` replaces the grid by the
one cell a run with ``--run-config`` publishes (its κ, m and κ_η; by default κ_η = 1.5·κ). What a
defense costs the server is measured on the same copies as ``denoise_error``: one
full-gradient step of the NLL on forget QA taken on every copy, mapped back exactly and
aggregated harmonically as the server does, against the same step taken on θ,
‖Δ̄ − Δ_θ‖ / ‖Δ_θ‖ (a one-step proxy for a client's update; the utility and forgetting of full
runs are in the MPU study). Writes
``mpu_attack.json``, ``mpu_attack.md`` and ``mpu_attack.png`` into the output folder.
"""

from __future__ import annotations

import argparse
import copy as copying
import dataclasses
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from fedunlearn.mpu import (
    HarmonicAggregator,
    ReparamDims,
    alphas,
    derive_seed,
    draw_transforms,
    invert_transform,
    layer_groups,
    layer_sigmas,
    noisy_copy,
    perturbed_copies,
    plan_reparam,
    sigma_per_tensor,
)
from fedunlearn.mpu.alignment import (
    align_copy,
    harmonic_combination,
    min_norm_combination,
    ov_combination,
)
from fedunlearn.qa_format import encode_qa, format_answer, format_prompt
from fedunlearn.training.batching import collate
from simulations.mpu_attack_defenses import DEFENSES, Defense
from simulations.run_local import default_cache_dir

REPO_ROOT = Path(__file__).resolve().parents[1]
STUDY_SECRET = b"fedunlearn-mpu-attack-study"
ESTIMATES = ("one_copy", "naive_mean", "aligned_harmonic", "aligned_min_norm")
ALIGNED = ("aligned_harmonic", "aligned_min_norm")
SCENARIO_METRICS = (
    "forget_rouge_l",
    "forget_truth_ratio",
    "forget_quality",
    "model_utility",
    "retain_rouge_l",
    "privleak",
)


@dataclass(frozen=True)
class AttackConfig:
    """The study's grid and inputs (defaults: the issue's grid on the built-in model)."""

    model: str = "builtin"
    kappas: tuple[float, ...] = (0.001, 0.01, 0.05)
    copies: tuple[int, ...] = (2, 3, 4)
    defenses: tuple[str, ...] = tuple(DEFENSES)
    defense_copies: tuple[int, ...] = (2, 3)
    shared_kappas: tuple[float, ...] = (0.01,)
    texts: int = 16
    forget_texts: int = 8
    evaluate: bool = True
    run_config: str = ""
    cache_dir: str = str(default_cache_dir())
    tofu_dir: str = str(REPO_ROOT.parent / "shared" / "data" / "tofu")


@dataclass
class Target:
    """The server's model and what the study scores it on."""

    model: Any
    heldout: dict[str, Tensor]
    forget: dict[str, Tensor]
    evaluate: Any = None  # model → scenario metrics (builtin), or None


def load_target(cfg: AttackConfig) -> Target:
    """θ (float32, CPU, eval mode) with a batch of held-out text and one of forget QA."""
    if cfg.model == "builtin":
        return _builtin_target(cfg)
    from fedunlearn.models.llama import load_local_causal_lm
    from fedunlearn.models.pretrained import pretrained_checkpoint

    model, tokenizer = load_local_causal_lm(
        pretrained_checkpoint(cfg.model, Path(cfg.cache_dir)), dtype=torch.float32
    )
    lines = (Path(cfg.tofu_dir) / "full.json").read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines[: cfg.texts + cfg.forget_texts]]
    heldout, forget = records[: cfg.texts], records[cfg.texts :]
    return Target(model.eval(), _text_batch(tokenizer, heldout), _qa_batch(tokenizer, forget))


def _builtin_target(cfg: AttackConfig) -> Target:
    from simulations.run_local import parse_config_pairs, run_settings
    from strategies.run_setup import evaluate_model, load_run_model

    settings = run_settings(parse_config_pairs(cfg.run_config))
    if not settings.model.cache_dir:
        model = dataclasses.replace(settings.model, cache_dir=cfg.cache_dir)
        settings = dataclasses.replace(settings, model=model)
    run_model = load_run_model(settings)
    scenario = run_model.scenario
    heldout = scenario.holdout_records()[: cfg.texts]
    forget = scenario.data.forget_split(settings.scenario.forget_percent)[: cfg.forget_texts]
    tokenizer = run_model.tokenizer

    reference = (
        evaluate_model("reference", run_model.reference, run_model, settings)
        if cfg.evaluate and run_model.reference is not None
        else None
    )

    def evaluate(model: Any) -> dict[str, Any]:
        metrics = evaluate_model("attack", model, run_model, settings, reference_metrics=reference)
        return {k: metrics.get(k) for k in SCENARIO_METRICS}

    return Target(
        run_model.model.float().eval(),
        _text_batch(tokenizer, heldout),
        _qa_batch(tokenizer, forget),
        evaluate if cfg.evaluate else None,
    )


def _text_batch(tokenizer: Any, records: Sequence[dict[str, Any]]) -> dict[str, Tensor]:
    texts = [format_prompt(r["question"]) + format_answer(r["answer"]) for r in records]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"][:96] for t in texts]
    return collate([(i, i) for i in ids], tokenizer.pad_token_id or 0)


def _qa_batch(tokenizer: Any, records: Sequence[dict[str, Any]]) -> dict[str, Tensor]:
    examples = [encode_qa(tokenizer, r["question"], r["answer"], 96) for r in records]
    return collate(examples, tokenizer.pad_token_id or 0)


@dataclass
class Published:
    """One client's copies as the server sent them, with the keys only the study may use."""

    copies: list[dict[str, Tensor]]
    scales: list[float]  # the α_k the server used
    transforms: list[Any]  # T_k per copy (None: not reparameterised)
    extra_maps: list[Any]  # S_k per copy (None: no extra map)
    dims: ReparamDims  # what the attacker knows of the architecture (public)


def publish(
    state: Mapping[str, Tensor],
    model_config: Any,
    kappa: float,
    m: int,
    permute_groups: bool,
    defense: Defense,
    cell_seed: int,
    shared_kappa: float = 0.0,
) -> Published:
    """A client's m copies under ``defense`` (MPU's own publishing functions; see the module
    docstring); ``single-copy`` publishes MPU's Noised baseline: θ + ε, one copy, no T;
    ``shared_kappa`` > 0 adds the noise η (σ_η = κ_η·RMS of the layer) common to the copies."""
    num_layers = int(model_config.num_hidden_layers)
    groups = layer_groups(state.keys(), num_layers)
    sigmas = sigma_per_tensor(groups, layer_sigmas(state, groups, kappa))
    gen = torch.Generator().manual_seed(derive_seed(STUDY_SECRET, cell_seed, "noise"))
    dims = plan_reparam(model_config, permute_groups=permute_groups).dims
    if defense.single_copy:
        noise = {n: torch.randn(state[n].shape, generator=gen).mul_(s) for n, s in sigmas.items()}
        return Published([noisy_copy(state, noise, 1.0)], [1.0], [None], [None], dims)
    scales = alphas(m)
    if defense.secret_scales:
        draw = torch.Generator().manual_seed(derive_seed(STUDY_SECRET, cell_seed, "scales"))
        scales = sorted((1.0 + torch.rand(m, generator=draw, dtype=torch.float64)).tolist())
    transforms = [
        draw_transforms(dims, STUDY_SECRET, cell_seed, k, num_layers, permute_groups=permute_groups)
        for k in range(m)
    ]
    shared = None
    if shared_kappa > 0:
        shared = sigma_per_tensor(groups, layer_sigmas(state, groups, shared_kappa))
    copies = perturbed_copies(state, sigmas, scales, gen, transforms, shared_sigmas=shared)
    extra = [None] * m
    if defense.extra_map is not None:
        seeds = [derive_seed(STUDY_SECRET, cell_seed, k, "extra") for k in range(m)]
        extra = [defense.extra_map(dims, num_layers, seed) for seed in seeds]
        copies = [s.forward(c) for s, c in zip(extra, copies, strict=True)]
    return Published(copies, list(scales), transforms, extra, dims)


def _to_original(state: Mapping[str, Tensor], published: Published, k: int) -> dict[str, Tensor]:
    """(S_k ∘ T_k)⁻¹ of weights or of an update given in copy k's coordinates (both linear)."""
    out = dict(state)
    if published.extra_maps[k] is not None:
        out = published.extra_maps[k].inverse(out)
    if published.transforms[k] is not None:
        out = invert_transform(out, published.transforms[k])
    return out


def estimates(
    published: Published, num_layers: int, defense: Defense
) -> dict[str, dict[str, Tensor]]:
    """What the client makes of its copies (the four ``ESTIMATES``), each in copy 1's
    coordinates; with one copy there is nothing to combine and every estimate is that copy."""
    copies = published.copies
    if len(copies) == 1:
        return {name: copies[0] for name in ESTIMATES}
    dims, public_scales = published.dims, alphas(len(copies))
    aligned = [copies[0]] + [
        align_copy(
            c,
            copies[0],
            dims,
            num_layers,
            estimate_scales=defense.estimate_scales,
            general_vo=defense.general_vo,
        )
        for c in copies[1:]
    ]
    naive = {n: sum(c[n].double() for c in copies).div(len(copies)).float() for n in copies[0]}
    # the attacker weights by the public α grid: it cannot know secret scales
    harmonic = harmonic_combination(aligned, public_scales)
    if defense.general_vo:  # average what attention computes, W_o,h W_v,g, not the factors
        harmonic = ov_combination(harmonic, aligned, public_scales, dims, num_layers)
    return {
        "one_copy": copies[0],
        "naive_mean": naive,
        "aligned_harmonic": harmonic,
        "aligned_min_norm": min_norm_combination(aligned, num_layers),
    }


class Scorer:
    """Scores states against θ on the held-out text, and one-step updates against θ's."""

    def __init__(self, target: Target) -> None:
        self.probe = copying.deepcopy(target.model)
        self.theta = {n: t.detach().clone() for n, t in target.model.state_dict().items()}
        self.num_layers = int(target.model.config.num_hidden_layers)
        groups = layer_groups(self.theta.keys(), self.num_layers)
        self.layer_names = [name for names in groups.values() for name in names]
        self._theta_sq = sum(float(self.theta[n].double().pow(2).sum()) for n in self.layer_names)
        self.heldout, self.forget = target.heldout, target.forget
        self.reference = self._logits(self.theta)
        self.clean_step = self.gradient_step(self.theta)
        self._clean_sq = sum(float(c.pow(2).sum()) for c in self.clean_step.values())

    def _load(self, state: Mapping[str, Tensor]) -> Any:
        self.probe.load_state_dict(dict(state), strict=True)
        return self.probe

    def _logits(self, state: Mapping[str, Tensor]) -> Tensor:
        batch = {k: self.heldout[k] for k in ("input_ids", "attention_mask")}
        with torch.no_grad():
            logits = self._load(state)(**batch).logits
        return logits[self.heldout["attention_mask"].bool()].double()

    def logit_scores(self, state: Mapping[str, Tensor]) -> dict[str, float]:
        """max |Δlogits| and mean KL(p_θ ‖ p_state) over the held-out tokens."""
        logits = self._logits(state)
        log_p, log_q = self.reference.log_softmax(-1), logits.log_softmax(-1)
        return {
            "max_dlogit": float((logits - self.reference).abs().max()),
            "kl": float((log_p.exp() * (log_p - log_q)).sum(-1).mean()),
        }

    def weight_error(self, original: Mapping[str, Tensor]) -> float:
        """‖state − θ‖ / ‖θ‖ over the decoder layers (the perturbed tensors)."""
        num = sum(
            float((original[n].double() - self.theta[n].double()).pow(2).sum())
            for n in self.layer_names
        )
        return math.sqrt(num / self._theta_sq)

    def gradient_step(self, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """−∇ NLL(forget QA) at ``state``, for the decoder-layer weights (float64)."""
        model = self._load(state)
        model.zero_grad(set_to_none=True)
        model(**self.forget).loss.backward()
        return {
            n: -p.grad.detach().double()
            for n, p in model.named_parameters()
            if p.grad is not None and ".layers." in n
        }

    def denoise_error(self, published: Published) -> float:
        """‖Δ̄ − Δ_θ‖ / ‖Δ_θ‖ for the server's harmonic aggregate Δ̄ of the copies' one-step
        updates mapped back exactly, aggregated by the server's HarmonicAggregator."""
        aggregate = HarmonicAggregator()
        for k, (copy, alpha) in enumerate(zip(published.copies, published.scales, strict=True)):
            aggregate.add(_to_original(self.gradient_step(copy), published, k), alpha)
        total = aggregate.result()
        num = sum(float((total[n] - c).pow(2).sum()) for n, c in self.clean_step.items())
        return math.sqrt(num / self._clean_sq)


@dataclass(frozen=True)
class Cell:
    """One point of the grid."""

    kappa: float
    m: int
    permute_groups: bool
    defense: str
    shared_kappa: float = 0.0  # κ_η of the noise common to the copies (shared-noise only)

    @property
    def seed(self) -> int:
        shared = (f"{self.shared_kappa:g}",) if self.shared_kappa else ()
        return derive_seed(
            STUDY_SECRET, f"{self.kappa:g}", self.m, int(self.permute_groups), self.defense, *shared
        )


def grid(cfg: AttackConfig) -> list[Cell]:
    """The main grid (κ × m × permutation, no defense), then every defense at each κ
    (m ∈ ``defense_copies``, permutation on; ``single-copy`` once per κ; ``shared-noise`` once
    per κ_η of ``shared_kappas``)."""
    cells = [
        Cell(kappa, m, permute, "none")
        for kappa in cfg.kappas
        for m in cfg.copies
        for permute in (True, False)
        if "none" in cfg.defenses
    ]
    for name in cfg.defenses:
        if name == "none":
            continue
        shared = cfg.shared_kappas if DEFENSES[name].shared_noise else (0.0,)
        for kappa in cfg.kappas:
            ms = (1,) if DEFENSES[name].single_copy else cfg.defense_copies
            cells += [Cell(kappa, m, True, name, eta) for m in ms for eta in shared]
    return cells


def attacker_estimate(defense: Defense) -> str:
    """The aligned estimate an attacker uses without knowing θ: the harmonic mean with the
    public α grid, or the minimum-norm combination when the α_k are secret."""
    return "aligned_min_norm" if defense.secret_scales else "aligned_harmonic"


def run_cell(cell: Cell, target: Target, scorer: Scorer, cfg: AttackConfig) -> dict[str, Any]:
    """Publish, attack and score one cell."""
    started = time.perf_counter()
    config = target.model.config
    defense = DEFENSES[cell.defense]
    published = publish(
        scorer.theta,
        config,
        cell.kappa,
        cell.m,
        cell.permute_groups,
        defense,
        cell.seed,
        cell.shared_kappa,
    )
    scores: dict[str, dict[str, float]] = {}
    recovered = estimates(published, scorer.num_layers, defense)
    for estimate, state in recovered.items():
        scores[estimate] = {
            **scorer.logit_scores(state),
            "weight_error": scorer.weight_error(_to_original(state, published, 0)),
        }
    one = scores["one_copy"]["max_dlogit"]
    ratios = {e: one / max(scores[e]["max_dlogit"], 1e-30) for e in ALIGNED}
    chosen = attacker_estimate(defense)
    record: dict[str, Any] = {
        **asdict(cell),
        "estimates": scores,
        # one copy's max |Δlogits| ÷ each aligned estimate's
        "leak_ratios": ratios,
        # the estimate an attacker picks without θ, and its ratio
        "attacker_estimate": chosen,
        "leak_ratio": ratios[chosen],
        # the better of the two, chosen by the distance to θ: an upper bound, not an attack
        "leak_upper_bound": max(ratios.values()),
        "denoise_error": scorer.denoise_error(published),
    }
    if target.evaluate is not None and cell.permute_groups:
        record["scenario"] = {
            "one_copy": target.evaluate(scorer._load(recovered["one_copy"])),
            "recovered": target.evaluate(scorer._load(recovered[chosen])),
        }
    record["seconds"] = time.perf_counter() - started
    return record


def _g(value: Any) -> str:
    return "–" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)


def study_markdown(summary: dict[str, Any]) -> str:
    """The leak table (every cell) and the scenario metrics of the recovered models."""
    lines = [
        f"MPU alignment attack on `{summary['config']['model']}`: max |Δlogits| / KL / weight "
        "error of each estimate against θ; leak = one copy ÷ the aligned estimate (max "
        "|Δlogits|), for the harmonic and the min-norm estimate; 'attacker' = the leak of the "
        "estimate an attacker picks without θ (harmonic; min-norm under secret scales); 'upper "
        "bound' = the better of the two, picked by the distance to θ, which an attacker cannot "
        "know; κ_η = shared-noise scale; denoise = the server's one-step aggregate error.",
        "",
        "| defense | κ | κ_η | m | perm | one copy | naive mean | aligned harmonic "
        "| aligned min-norm | KL one / attacker | weight err one / attacker "
        "| leak harmonic | leak min-norm | leak attacker | upper bound | denoise |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["cells"]:
        e, chosen = r["estimates"], r["estimates"][r["attacker_estimate"]]
        gaps = " | ".join(_g(e[name]["max_dlogit"]) for name in ESTIMATES)
        perm = "on" if r["permute_groups"] else "off"
        leaks = " | ".join(f"{r['leak_ratios'][name]:.1f}×" for name in ALIGNED)
        lines.append(
            f"| {r['defense']} | {r['kappa']:g} | {r['shared_kappa']:g} | {r['m']} | {perm}"
            f" | {gaps}"
            f" | {_g(e['one_copy']['kl'])} / {_g(chosen['kl'])}"
            f" | {_g(e['one_copy']['weight_error'])} / {_g(chosen['weight_error'])}"
            f" | {leaks} | {r['leak_ratio']:.1f}× | {r['leak_upper_bound']:.1f}×"
            f" | {_g(r['denoise_error'])} |"
        )
    scored = [r for r in summary["cells"] if "scenario" in r]
    if scored:
        server = summary["server_metrics"]
        lines += [
            "",
            "Scenario metrics (server's model / one copy / the attacker's estimate):",
            "",
            "| defense | κ | κ_η | m | " + " | ".join(SCENARIO_METRICS) + " |",
            "|---|---|---|---|" + "---|" * len(SCENARIO_METRICS),
        ]
        for r in scored:
            s = r["scenario"]
            cols = [
                f"{_g(server.get(k))} / {_g(s['one_copy'].get(k))} / {_g(s['recovered'].get(k))}"
                for k in SCENARIO_METRICS
            ]
            lines.append(
                f"| {r['defense']} | {r['kappa']:g} | {r['shared_kappa']:g} | {r['m']} | "
                + " | ".join(cols)
                + " |"
            )
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], path: Path) -> Path:
    """Left: max |Δlogits| per κ for one copy and the aligned attack (no defense, m lines);
    right: each defense at the middle κ, one copy vs the attacker's aligned estimate, with the
    denoise error."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = summary["cells"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for m in summary["config"]["copies"]:
        rows = [r for r in cells if r["defense"] == "none" and r["m"] == m and r["permute_groups"]]
        if not rows:
            continue
        kappas = [r["kappa"] for r in rows]
        chosen = [r["estimates"][r["attacker_estimate"]]["max_dlogit"] for r in rows]
        left.plot(kappas, chosen, marker="o", label=f"aligned, m={m}")
    rows = [r for r in cells if r["defense"] == "none" and r["permute_groups"] and r["m"] == 2]
    if rows:
        one = [r["estimates"]["one_copy"]["max_dlogit"] for r in rows]
        left.plot([r["kappa"] for r in rows], one, "k--", marker="s", label="one copy")
    left.set(xscale="log", yscale="log", xlabel="κ", ylabel="max |Δlogits| vs θ")
    left.set_title("what a client recovers (no defense)")
    left.legend()
    kappas = sorted({r["kappa"] for r in cells})
    mid = kappas[len(kappas) // 2] if kappas else None
    rows = [r for r in cells if r["kappa"] == mid and r["permute_groups"] and r["m"] in (1, 2)]
    labels = [
        f"{r['defense']} κ_η={r['shared_kappa']:g}" if r["shared_kappa"] else r["defense"]
        for r in rows
    ]
    x = range(len(rows))
    one = [r["estimates"]["one_copy"]["max_dlogit"] for r in rows]
    best = [r["estimates"][r["attacker_estimate"]]["max_dlogit"] for r in rows]
    right.bar([i - 0.2 for i in x], one, 0.4, label="one copy")
    right.bar([i + 0.2 for i in x], best, 0.4, label="aligned (attacker's estimate)")
    for i, r in enumerate(rows):
        right.annotate(
            f"denoise {r['denoise_error']:.2g}",
            (i, max(one[i], best[i])),
            ha="center",
            va="bottom",
            fontsize=7,
        )
    right.set_xticks(list(x), labels, rotation=20, fontsize=8)
    right.set(yscale="log", ylabel="max |Δlogits| vs θ")
    right.set_title(f"defenses at κ={mid:g}, m=2" if mid is not None else "defenses")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def study(cfg: AttackConfig, output_dir: Path) -> dict[str, Any]:
    """Every cell of :func:`grid`; writes the JSON, the table and the plot."""
    unknown = [d for d in cfg.defenses if d not in DEFENSES]
    if unknown:
        raise ValueError(f"unknown defense(s) {unknown}; known: {sorted(DEFENSES)}")
    output_dir.mkdir(parents=True, exist_ok=True)
    target = load_target(cfg)
    scorer = Scorer(target)
    summary: dict[str, Any] = {"config": asdict(cfg), "cells": [], "server_metrics": {}}
    if target.evaluate is not None:
        summary["server_metrics"] = target.evaluate(target.model)
    for cell in tqdm(grid(cfg), desc="mpu attack cells", unit="cell"):
        summary["cells"].append(run_cell(cell, target, scorer, cfg))
        (output_dir / "mpu_attack.json").write_text(json.dumps(summary, indent=1))
    (output_dir / "mpu_attack.md").write_text(study_markdown(summary))
    plot(summary, output_dir / "mpu_attack.png")
    return summary


def run_defaults(cfg: AttackConfig) -> AttackConfig:
    """``cfg`` reduced to the copies a run with ``cfg.run_config`` publishes: its
    ``mpu.kappa``, ``mpu.copies`` and ``mpu.shared-kappa`` as resolved (-1: κ_η = 1.5·κ), as the
    ``shared-noise`` cell (or ``none``, both permutation settings, where κ_η = 0)."""
    from simulations.run_local import parse_config_pairs, run_settings

    mpu = run_settings(parse_config_pairs(cfg.run_config)).mpu
    eta = mpu.shared_noise_kappa()
    return dataclasses.replace(
        cfg,
        kappas=(mpu.kappa,),
        copies=(mpu.copies,),
        defense_copies=(mpu.copies,),
        defenses=("shared-noise",) if eta > 0 else ("none",),
        shared_kappas=(eta,),
    )


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(",") if v)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    defaults = AttackConfig()
    parser.add_argument("--model", default=defaults.model, help="builtin or smollm2-135m")
    parser.add_argument("--kappas", type=_floats, default=defaults.kappas)
    parser.add_argument("--copies", type=_ints, default=defaults.copies)
    parser.add_argument("--defense-copies", type=_ints, default=defaults.defense_copies)
    parser.add_argument("--defenses", default=",".join(defaults.defenses))
    parser.add_argument(
        "--shared-kappas",
        type=_floats,
        default=defaults.shared_kappas,
        help="κ_η values of the shared-noise defense (σ_η = κ_η·RMS of the layer)",
    )
    parser.add_argument(
        "--run-defaults",
        action="store_true",
        help="attack only the copies the --run-config run publishes (its mpu.kappa, "
        "mpu.copies, mpu.shared-kappa); replaces the grid",
    )
    parser.add_argument("--texts", type=int, default=defaults.texts)
    parser.add_argument("--no-evaluate", action="store_true", help="skip the scenario metrics")
    parser.add_argument("--run-config", default="", help="builtin: run-config overrides")
    parser.add_argument("--cache-dir", default=defaults.cache_dir)
    parser.add_argument("--output-dir", default="")
    args = parser.parse_args(argv)
    cfg = AttackConfig(
        model=args.model,
        kappas=args.kappas,
        copies=args.copies,
        defenses=tuple(d for d in args.defenses.split(",") if d),
        defense_copies=args.defense_copies,
        shared_kappas=args.shared_kappas,
        texts=args.texts,
        evaluate=not args.no_evaluate and args.model == "builtin",
        run_config=args.run_config,
        cache_dir=args.cache_dir,
    )
    if args.run_defaults:
        cfg = run_defaults(cfg)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    output_dir = Path(args.output_dir or REPO_ROOT / "outputs" / "mpu_attack" / stamp)
    summary = study(cfg, output_dir)
    print(study_markdown(summary))
    print(f"written: {output_dir}/mpu_attack.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
