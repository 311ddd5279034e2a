"""γ sweeps of several server merges on one scenario, and the forgetting–utility frontier.

How each point is obtained: ONE real Flower simulation runs the clients (5 forget + 1 retain
by default) and saves their uploads; every (merge, γ) point is then a re-merge of those
same uploads followed by the server's evaluation (the point that is the run's own merge keeps
the run's evaluation of it, which evaluating again would repeat exactly). This is honest for
single-round merges: clients train from the same θ₀ whatever the server does with their
uploads, so a separate Flower run per point would produce the same uploads (seeded) and
differ only in cost.

    python -m simulations.sweep --strategies firm,fulm,ties,sum,avg --run-config "..."
        [--seeds 0,1,2]

Writes ``points/<merge>-g<γ>.json`` (each with its ``evaluation``: the metrics with their
per-question scores, which ``python -m simulations.compare`` reads), ``summary.json``,
``summary.md`` and ``frontier.png`` into the output folder; with ``--seeds`` one such sweep
per client-training seed in ``seed-<s>/`` and ``seeds.md`` / ``seeds.json`` beside them
(:mod:`simulations.sweep_seeds`).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from fedunlearn.evaluation.intervals import QUESTIONS_KEY, SCORE_SETS_KEY, SCORES_KEY
from fedunlearn.merging import ClientUpdate, apply_delta
from fedunlearn.uploads import load_uploads
from simulations import run_local
from simulations.frontier import matched_forgetting, plot_frontier, summary_markdown
from simulations.sweep_seeds import seeds_markdown, write_seed_summary
from strategies.merge_plugins import merge_kwargs, resolve_merge
from strategies.results import json_safe
from strategies.run_setup import RunModel, evaluate_model, load_run_model
from strategies.settings import RunSettings

DEFAULT_GAMMAS = {
    "firm": [2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 16.0],
    "fulm": [0.25, 0.5, 1.0, 1.5, 2.0, 3.0],
    "fulm-mean": [0.5, 1.0, 2.0, 3.0, 4.0, 6.0],
    "ties": [1.0, 2.0, 3.0, 4.0, 6.0, 8.0],
    "sum": [0.2, 0.4, 0.6, 0.8, 1.0, 1.5],
    "avg": [1.0, 2.0, 4.0, 6.0, 8.0, 12.0],
}
TOFU_POINT_METRICS = (
    "forget_rouge_l",
    "forget_exact_match",
    "forget_truth_ratio",
    "forget_quality",
    "model_utility",
    "retain_rouge_l",
    "retain_exact_match",
    "real_authors_rouge_l",
    "world_facts_rouge_l",
)


def point_metrics(run_model: RunModel) -> tuple[str, ...]:
    """The scalar metrics a sweep point records for this scenario (and a real model's MMLU)."""
    scenario = run_model.scenario
    general = ("mmlu_accuracy",) if run_model.general_questions else ()
    if scenario.name == "tofu":
        return (*TOFU_POINT_METRICS, *general)
    return tuple(dict.fromkeys((*scenario.summary_metrics, scenario.utility_metric, *general)))


def parse_gammas(text: str, strategies: list[str]) -> dict[str, list[float]]:
    """``"firm=2,4,8 fulm=0.5,1"`` → per-merge grids (defaults for the others)."""
    grids = {s: DEFAULT_GAMMAS.get(s, [0.5, 1.0, 2.0, 4.0]) for s in strategies}
    for part in text.split():
        name, _, values = part.partition("=")
        if name not in grids:
            raise ValueError(f"--gammas names {name!r}, which is not in --strategies")
        grids[name] = [float(v) for v in values.split(",") if v]
    return grids


def merged_model(model: torch.nn.Module, delta: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A copy of ``model`` with θ ← θ₀ + Δ."""
    merged = copy.deepcopy(model)
    merged.load_state_dict(apply_delta(model.state_dict(), delta))
    return merged


@dataclasses.dataclass
class FlowerUploads:
    """One real Flower simulation's uploads plus what is needed to evaluate re-merges."""

    settings: RunSettings
    results: dict[str, Any]
    results_path: Path
    run_model: RunModel
    reference_metrics: dict[str, Any] | None
    updates: list[ClientUpdate]

    def merged(self, delta: dict[str, torch.Tensor]) -> torch.nn.Module:
        """θ₀ + Δ as a model."""
        return merged_model(self.run_model.model, delta)

    def evaluate(
        self,
        name: str,
        delta: dict[str, torch.Tensor],
        splits: dict[str, list[dict]] | None = None,
        with_reference: bool = True,
    ) -> dict[str, Any]:
        """Metrics of θ₀ + Δ (see :meth:`evaluate_merged`)."""
        return self.evaluate_merged(name, self.merged(delta), splits, with_reference)

    def evaluate_merged(
        self,
        name: str,
        model: torch.nn.Module,
        splits: dict[str, list[dict]] | None = None,
        with_reference: bool = True,
    ) -> dict[str, Any]:
        """Metrics of ``model`` as the server measures them; TOFU ``splits`` replace the
        scenario's (then without forget quality: the reference saw the scenario's forget set)."""
        reference = self.reference_metrics if with_reference else None
        extra = {"splits": splits} if splits is not None else {}
        return evaluate_model(name, model, self.run_model, self.settings, reference, **extra)


def run_and_load_uploads(
    run_config: str, output_dir: Path, *, reuse: bool = False
) -> FlowerUploads:
    """Run the clients in a real Flower simulation (uploads saved), then load everything.

    With ``reuse`` an earlier run in ``output_dir`` (same run config) is loaded instead.
    """
    config = f"{run_config} save-uploads=true".strip()
    results_path = output_dir / "results.json"
    if not (reuse and results_path.is_file() and (output_dir / "uploads").is_dir()):
        results_path = run_local.run(config, output_dir=output_dir)
    results = json.loads(results_path.read_text())
    settings = RunSettings.from_run_config(results["config"])  # exactly what the run used
    return FlowerUploads(
        settings=settings,
        results=results,
        results_path=results_path,
        run_model=load_run_model(settings, show_progress=False),
        reference_metrics=results["metrics"].get("reference"),
        updates=load_uploads(output_dir / "uploads"),
    )


#: run-config keys in which a whole Flower run may differ from the sweep's run and still be a
#: point of it (the merge, γ and where outputs go); every other key must be equal
RUN_POINT_FREE_KEYS = ("merge", "gamma", "output-dir", "save-uploads", "resume")


def flower_run_point(results_path: Path, config: dict[str, Any], names: tuple) -> dict:
    """A sweep point from a whole single-round Flower run (``results.json``) of the same model,
    data, clients and evaluation as the sweep's run: its merge and γ, its "after" metrics."""
    results = json.loads(results_path.read_text())
    other = results["config"]
    differing = [
        k
        for k in sorted(set(config) | set(other))
        if k not in RUN_POINT_FREE_KEYS and config.get(k) != other.get(k)
    ]
    if differing or other.get("num-rounds") != 1:
        raise ValueError(
            f"{results_path}: not a single-round run of the sweep's config (differs in "
            f"{differing[:5] or ['num-rounds']})"
        )
    return {
        "strategy": other["merge"],
        "gamma": other["gamma"],
        "norm_final": results["merge"].get("norm_final"),
        "metrics": {k: results["metrics"]["after"].get(k) for k in names},
        "how": f"a whole Flower run ({results_path})",
    }


def own_merge_evaluation(
    flower: FlowerUploads, strategy: str, gamma: float, norm_final: float | None
) -> dict[str, Any] | None:
    """The Flower run's own evaluation of its unlearned model, with its per-question scores, as
    the evaluation of the re-merge (``strategy``, ``gamma``) when that re-merge IS the run's
    merge: a one-round run without a wrapper or request schedule, with this merge and γ, whose
    merged update had the re-merge's norm bit for bit (the same uploads merged with the same
    arguments). Else None: the point is evaluated."""
    results, config = flower.results, flower.results["config"]
    scores_path = flower.results_path.parent / "scores.json"
    same_merge = (config.get("merge"), config.get("gamma")) == (strategy, gamma)
    single_round = config.get("num-rounds") == 1 and not config.get("requests.schedule")
    unwrapped = config.get("wrapper", "none") == "none"
    same_norm = norm_final is not None and results.get("merge", {}).get("norm_final") == norm_final
    if not (same_merge and single_round and unwrapped and same_norm and scores_path.is_file()):
        return None
    scores = json.loads(scores_path.read_text())
    after = results["metrics"].get("after")
    if after is None or "after" not in scores:
        return None
    return {k: v for k, v in after.items() if k != "samples"} | {
        SCORES_KEY: scores["after"],
        SCORE_SETS_KEY: scores.get("question_sets", {}),
        QUESTIONS_KEY: scores.get("question_digests", {}),
    }


#: what a sweep point records beside its full evaluation
POINT_KEYS = ("strategy", "gamma", "merge_kwargs", "merge_seconds", "norm_final", "metrics", "how")


def saved_point(path: Path, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The point an earlier sweep wrote to ``path`` if it was merged with these ``kwargs``
    (so a re-run with ``--reuse-run`` evaluates only new or changed points), else None."""
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    if saved.get("merge_kwargs") != json_safe(kwargs):
        return None
    return {k: saved.get(k) for k in POINT_KEYS}


def sweep(
    strategies: list[str],
    grids: dict[str, list[float]],
    run_config: str,
    output_dir: Path,
    *,
    reuse_run: bool = False,
    runs: tuple[Path, ...] = (),
) -> dict[str, Any]:
    """Run the clients once in Flower, then re-merge and evaluate every (merge, γ); the
    whole Flower runs in ``runs`` (results.json files) join as points of their own."""
    output_dir.mkdir(parents=True, exist_ok=True)
    flower = run_and_load_uploads(run_config, output_dir / "flower-run", reuse=reuse_run)
    settings, updates = flower.settings, flower.updates
    run_results, reference = flower.results, flower.results["metrics"].get("reference")
    scenario = flower.run_model.scenario
    metric_names = point_metrics(flower.run_model)
    points = []
    (output_dir / "points").mkdir(exist_ok=True)
    jobs = [(s, g) for s in strategies for g in grids[s]]
    for strategy, gamma in tqdm(jobs, desc="re-merge + evaluate", unit="point"):
        fn = resolve_merge(strategy)
        params = dataclasses.replace(settings, merge=strategy, gamma=gamma)
        kwargs = merge_kwargs(fn, params.merge_parameters())
        point_path = output_dir / "points" / f"{strategy}-g{gamma:g}.json"
        saved = saved_point(point_path, kwargs) if reuse_run else None
        if saved is not None:
            points.append(saved)
            continue
        started = time.perf_counter()
        result = fn(updates, **kwargs)
        merge_seconds = time.perf_counter() - started
        how = "re-merge of the uploads saved by one Flower simulation"
        # the Flower run's own merge was evaluated by the run: its evaluation is read back
        evaluation = own_merge_evaluation(flower, strategy, gamma, result.report.get("norm_final"))
        if evaluation is None:
            metrics = flower.evaluate(f"{strategy} γ={gamma}", result.delta)
            # with every per-question score, for simulations.compare (paired intervals)
            evaluation = {k: v for k, v in metrics.items() if k != "samples"}
        else:
            how += ", equal to the run's own merge: the run's evaluation"
        point = {
            "strategy": strategy,
            "gamma": gamma,
            "merge_kwargs": kwargs,
            "merge_seconds": merge_seconds,
            "norm_final": result.report.get("norm_final"),
            "metrics": {k: evaluation.get(k) for k in metric_names},
            "how": how,
        }
        point_path.write_text(
            json.dumps(
                json_safe({**point, "report": result.report, "evaluation": evaluation}), indent=2
            )
        )
        points.append(point)
    points += [flower_run_point(p, run_results["config"], metric_names) for p in runs]
    summary = {
        "flower_run": str(flower.results_path),
        "scenario": scenario.name,
        "forget_metric": scenario.forget_metric,
        "utility_metric": scenario.utility_metric,
        "metric_names": list(metric_names),
        "before": {k: run_results["metrics"]["before"].get(k) for k in metric_names},
        "reference": {k: reference.get(k) for k in metric_names} if reference else None,
        "points": points,
        "matched_forgetting": matched_forgetting(
            points,
            anchor="firm",
            forget_metric=scenario.forget_metric,
            utility_metric=scenario.utility_metric,
        ),
    }
    (output_dir / "summary.json").write_text(json.dumps(json_safe(summary), indent=2))
    (output_dir / "summary.md").write_text(summary_markdown(summary))
    plot_frontier(summary, output_dir / "frontier.png")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--strategies",
        default="firm,fulm,ties,sum,avg",
        help="the merges to sweep (values of the run-config key merge), comma-separated",
    )
    parser.add_argument("--gammas", default="", help='e.g. "firm=2,4,8 fulm=0.5,1"')
    parser.add_argument("--run-config", default="", help="run-config overrides for the scenario")
    parser.add_argument("--output-dir", type=Path, default=None)
    parser.add_argument(
        "--reuse-run",
        action="store_true",
        help="re-merge the uploads of an earlier run in --output-dir; points it already "
        "evaluated with the same merge arguments are read back, not evaluated again",
    )
    parser.add_argument(
        "--seeds",
        default="",
        help="client-training seeds, e.g. 0,1,2: the sweep once per training.seed, then "
        "seeds.md / seeds.json (mean, between-seed sd, interval over seeds and questions)",
    )
    parser.add_argument(
        "--add-runs",
        type=Path,
        nargs="*",
        default=[],
        help="results.json of whole single-round Flower runs of the same config to add as points",
    )
    args = parser.parse_args(argv)
    logging.getLogger("flwr").propagate = False  # one copy of each log line
    strategies = [s for s in args.strategies.split(",") if s]
    grids = parse_gammas(args.gammas, strategies)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    output_dir = (args.output_dir or run_local.REPO_ROOT / "outputs" / f"sweep-{stamp}").resolve()
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if seeds:
        folders = {}
        for seed in seeds:
            folders[seed] = output_dir / f"seed-{seed}"
            summary = sweep(
                strategies,
                grids,
                f"{args.run_config} training.seed={seed}",
                folders[seed],
                reuse_run=args.reuse_run,
            )
        combined = write_seed_summary(output_dir, folders, summary["metric_names"])
        print(seeds_markdown(combined["points"], seeds, summary["metric_names"]))
        print(f"\nsweeps written to {output_dir}/seed-*, seeds.md beside them")
        return 0
    summary = sweep(
        strategies,
        grids,
        args.run_config,
        output_dir,
        reuse_run=args.reuse_run,
        runs=tuple(args.add_runs),
    )
    print(summary_markdown(summary))
    print(f"\nsweep written to {output_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
