"""FIRM-QP with several retain clients (m = 1, 2, 3) on heterogeneous retain data.

One real Flower simulation runs the forget clients and THREE retain clients with different
data (fictitious authors A, real-world knowledge, fictitious authors B) and saves their
uploads; m = 1, 2, 3 then re-merge the forget uploads with the first m retain uploads
(clients never see each other's uploads, so a run with fewer retain clients would have
produced the same ones). The budget ε is calibrated per m as the FIRM paper does:
0.3 × the mean no-projection damage over retain clients and tensors. For every m and
solver (exact, increase-only) the report gives, per retain client, the multipliers, the
Fisher-proxy damage before/after projection and the utility on that client's own data
without/with projection.

    python -m simulations.multi_retain --run-config "gamma=8.0"
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

from fedunlearn.evaluation import evaluate_split
from fedunlearn.merging import firm_merge
from simulations import run_local
from simulations.sweep import FlowerUploads, run_and_load_uploads
from strategies.results import json_safe

SCENARIO = (
    "scenario.num-retain-clients=3 scenario.retain-layout='heterogeneous' "
    "scenario.retain-samples=100"
)
BUDGET_FRACTION = 0.3


def _client_records(flower: FlowerUploads, node_id: str) -> list[dict]:
    assignment = next(a for a in flower.results["assignments"] if str(a["node_id"]) == node_id)
    records = flower.run_model.scenario.records()
    return [records[i] for i in assignment["indices"]]


def _own_data_utility(
    flower: FlowerUploads, model, records: list[dict], domain: str
) -> dict[str, float]:
    # real-world knowledge is scored like TOFU's extra sets, fictitious authors like retain
    kind = "extra" if domain == "retain-world" else "retain"
    out = evaluate_split(
        model,
        flower.run_model.tokenizer,
        records,
        kind=kind,
        batch_size=flower.settings.eval.batch_size,
        max_new_tokens=flower.settings.eval.max_new_tokens,
        n_samples=0,
    )
    return {"rouge_l": out["rouge_l"], "prob": out["prob"], "exact_match": out["exact_match"]}


def _per_client(report: dict, node_id: str, key: str) -> list[float]:
    return [t[key][node_id] for t in report["tensors"].values()]


def study(
    run_config: str, output_dir: Path, gamma: float | None = None, *, reuse: bool = False
) -> dict[str, Any]:
    output_dir.mkdir(parents=True, exist_ok=True)
    flower = run_and_load_uploads(
        f"{SCENARIO} {run_config}".strip(), output_dir / "flower-run", reuse=reuse
    )
    # the scenario's client order (authors A, world, authors B), not the order replies came in
    position = {str(a["node_id"]): i for i, a in enumerate(flower.results["assignments"])}
    flower.updates.sort(key=lambda u: position[str(u.node_id)])
    gamma = gamma if gamma is not None else flower.settings.gamma
    forget = [u for u in flower.updates if u.role == "forget"]
    retain = [u for u in flower.updates if u.role == "retain"]
    rows = []
    for m in (1, 2, 3):
        updates = forget + retain[:m]
        base = firm_merge(updates, gamma=gamma, epsilon=float("inf"))
        ids = [str(u.node_id) for u in retain[:m]]
        damages = [d for i in ids for d in _per_client(base.report, i, "damage_before")]
        epsilon = BUDGET_FRACTION * statistics.fmean(damages)
        base_model = flower.merged(base.delta)
        entry: dict[str, Any] = {
            "m": m,
            "epsilon": epsilon,
            "gamma": gamma,
            "without_projection": flower.evaluate_merged(f"m={m} base", base_model),
        }
        records = {node_id: _client_records(flower, node_id) for node_id in ids}
        utility_without = {
            node_id: _own_data_utility(flower, base_model, records[node_id], update.domain)
            for node_id, update in zip(ids, retain[:m], strict=True)
        }
        for solver in ("exact", "increase-only"):
            started = time.perf_counter()
            projected = firm_merge(updates, gamma=gamma, epsilon=epsilon, solver=solver)
            seconds = time.perf_counter() - started
            model = flower.merged(projected.delta)
            clients = {}
            for node_id, update in zip(ids, retain[:m], strict=True):
                clients[node_id] = {
                    "domain": update.domain,
                    "multipliers_mean": statistics.fmean(
                        _per_client(projected.report, node_id, "multipliers")
                    ),
                    "multipliers_max": max(_per_client(projected.report, node_id, "multipliers")),
                    "damage_before": sum(_per_client(projected.report, node_id, "damage_before")),
                    "damage_after": sum(_per_client(projected.report, node_id, "damage_after")),
                    "utility_without": utility_without[node_id],
                    "utility_with": _own_data_utility(
                        flower, model, records[node_id], update.domain
                    ),
                }
            projections = [t["projection"] for t in projected.report["tensors"].values()]
            entry[solver] = {
                "seconds": seconds,
                "norm_final": projected.report["norm_final"],
                "norm_base": projected.report["norm_base"],
                "max_violation": max(p.get("max_violation", 0.0) for p in projections),
                "max_complementary_slackness": max(
                    p.get("max_complementary_slackness", 0.0) for p in projections
                ),
                "max_duality_gap": max(p.get("duality_gap", 0.0) for p in projections),
                # ½‖Δ* − Δ_base‖² summed over tensors: what the projection minimises
                "objective": sum(
                    0.5 * float(((projected.delta[k].double() - base.delta[k].double()) ** 2).sum())
                    for k in base.delta
                ),
                "clients": clients,
                "metrics": flower.evaluate_merged(f"m={m} {solver}", model),
            }
        rows.append(entry)
    summary = {
        "flower_run": str(flower.results_path),
        "budget_fraction": BUDGET_FRACTION,
        "before": flower.results["metrics"]["before"],
        "rows": rows,
    }
    (output_dir / "multi_retain.json").write_text(json.dumps(json_safe(summary), indent=2))
    (output_dir / "multi_retain.md").write_text(markdown(summary))
    return summary


def markdown(summary: dict[str, Any]) -> str:
    lines = [
        "| m | ε | solver | retain client | λ mean / max | damage before → after "
        "| own ROUGE-L without → with | own prob without → with | model utility |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summary["rows"]:
        for solver in ("exact", "increase-only"):
            res = row[solver]
            for node_id, c in res["clients"].items():
                lines.append(
                    f"| {row['m']} | {row['epsilon']:.3g} | {solver} | {c['domain']} "
                    f"({node_id[-4:]}) | {c['multipliers_mean']:.3g} / {c['multipliers_max']:.3g} "
                    f"| {c['damage_before']:.3g} → {c['damage_after']:.3g} "
                    f"| {c['utility_without']['rouge_l']:.3f} → {c['utility_with']['rouge_l']:.3f} "
                    f"| {c['utility_without']['prob']:.3f} → {c['utility_with']['prob']:.3f} "
                    f"| {row['without_projection']['model_utility']:.3f} → "
                    f"{res['metrics']['model_utility']:.3f} |"
                )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-config", default="")
    parser.add_argument("--output-dir", type=Path, default=None)
    parser.add_argument(
        "--reuse-run",
        action="store_true",
        help="re-merge the uploads of an earlier run in --output-dir",
    )
    args = parser.parse_args(argv)
    logging.getLogger("flwr").propagate = False  # one copy of each log line
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = (args.output_dir or run_local.REPO_ROOT / "outputs" / f"multi-retain-{stamp}").resolve()
    print(markdown(study(args.run_config, out, reuse=args.reuse_run)))
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
