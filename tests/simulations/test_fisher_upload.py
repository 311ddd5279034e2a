"""The Fisher-upload study's core on synthetic uploads: exact where FIRM uses each client's own
top-α, errors shrinking with α' where a domain pools several clients, bytes as the codec sends
them, Fisher redraws measured against the dense merge, and the recommendation rule."""

import math
from dataclasses import replace

import pytest
import torch

from fedunlearn.merging import firm_merge
from fedunlearn.upload_codec import deflate_mask, pack_mask
from simulations import bench_merge
from simulations.fisher_upload import (
    ALPHA,
    FisherForm,
    budget,
    factor_bytes,
    fisher_forms,
    markdown,
    perturbed,
    recommend,
    redraw_batches,
    relative_error,
    relative_spread,
    resampling_bound,
    smallest_fraction,
    synthetic_input,
    synthetic_updates,
)

SHAPE = {"tensors": 2, "rows": 192, "cols": 96, "seed": 3}
SPREAD = {"forget": 0.3, "retain": 0.6}
REDRAWS = 3


@pytest.fixture(scope="module")
def results():
    return {n: synthetic_input(n, SPREAD, REDRAWS, SHAPE) for n in (1, 2, 4)}


def _topk(rows):
    return [r for r in rows if r["form"] == "topk"]


def test_the_grid_is_alpha_multiples_and_one():
    forms = fisher_forms()
    assert forms[:2] == [FisherForm("dense"), FisherForm("bf16")]
    fractions = [f.fraction for f in forms[2:]]
    assert fractions == pytest.approx([0.1, 0.125, 0.15, 0.2, 0.3, 0.5, 1.0])
    assert all(f.form == "topk" for f in forms[2:])


def test_one_forget_client_per_domain_is_exact_at_every_fraction_from_alpha(results):
    result = results[1]
    assert result["clients"] == {"forget": 2, "retain": 1, "forget_domains": 2}
    assert result["projection_active_tensors"] != "0/2"  # the budget binds
    rows = [r for r in result["rows"] if r["form"] == "dense"] + _topk(result["rows"])
    assert all(r["fraction"] is None or r["fraction"] >= ALPHA for r in rows)
    for r in rows:
        for merge in ("base", "projected"):
            assert r[merge]["error"] == 0.0 and r[merge]["worst_error"] == 0.0, (r["label"], merge)
        assert r["support_change"] == 0.0
    bf16 = next(r for r in result["rows"] if r["form"] == "bf16")
    assert bf16["base"]["error"] > 0.0  # rounding moves FIRM's threshold: not exact


@pytest.mark.parametrize("n", [2, 4])
def test_pooled_domains_error_shrinks_as_the_fraction_grows(results, n):
    rows = _topk(results[n]["rows"])
    assert [r["fraction"] for r in rows] == sorted(r["fraction"] for r in rows)
    for key in ("base", "projected"):
        errors = [r[key]["error"] for r in rows]
        assert errors[0] > 0.05, errors  # top-α of each client misses the pooled top-α
        assert all(b <= a for a, b in zip(errors, errors[1:], strict=False)), (key, errors)
        assert errors[-1] == 0.0  # α' = 1 sends every non-zero entry
    changes = [r["support_change"] for r in rows]
    assert changes[0] > 0.0 and changes[-1] == 0.0
    assert all(b <= a for a, b in zip(changes, changes[1:], strict=False)), changes


def _expected_topk_bytes(fisher, fraction):
    total = 0
    for f in fisher.values():
        flat = f.reshape(-1).float()
        k = max(1, math.floor(fraction * flat.numel() * (1 + 1e-9)))
        threshold = torch.sort(flat, descending=True).values[k - 1]
        keep = (flat >= threshold) & (flat > 0)
        # the packed mask (1 bit per entry), deflated, + the kept values in float32
        total += deflate_mask(pack_mask(keep)).numel() + 4 * int(keep.sum())
    return total


def test_bytes_are_the_deflated_mask_plus_the_kept_values(results):
    updates, result = synthetic_updates(2, **SHAPE), results[2]
    entries = 2 * SHAPE["rows"] * SHAPE["cols"]
    assert result["entries_per_client"] == entries
    factors = 2 * factor_bytes((SHAPE["rows"], SHAPE["cols"]), bench_merge.RANK)
    assert factors == 2 * 4 * (16 * (192 + 96) + 1)
    by_form = {r["label"]: r for r in result["rows"]}
    assert by_form["dense"]["fisher_bytes_ratio"] == 1.0
    assert by_form["bf16"]["fisher_bytes_ratio"] == 0.5
    for r in _topk(result["rows"]):
        expected = sum(_expected_topk_bytes(u.fisher, r["fraction"]) for u in updates)
        assert r["fisher_bytes"] == pytest.approx(expected / len(updates), rel=1e-12)
        # continuous Fishers have no ties: α' of dense for the values plus the mask, under
        # 1/32 of dense (one bit per entry) once deflated, except where α' is 1 (all ones)
        assert r["fraction"] < r["fisher_bytes_ratio"] < 1 / 32 + r["fraction"] + 1e-3
        assert r["upload_bytes"] == factors + r["fisher_bytes"]
        assert r["upload_ratio"] == pytest.approx(8 * entries / (factors + r["fisher_bytes"]))


def test_redraws_are_disjoint_blocks_where_the_shard_allows_else_with_replacement():
    blocks = [redraw_batches(80, 20, r, redraws=3, seed=r) for r in (1, 2, 3)]
    assert blocks == [list(range(20, 40)), list(range(40, 60)), list(range(60, 80))]
    small = redraw_batches(5, 20, 1, redraws=3, seed=7)
    assert len(small) == 20 and set(small) <= set(range(5)) and len(set(small)) > 1
    assert small == redraw_batches(5, 20, 1, redraws=3, seed=7)  # seeded
    assert small != redraw_batches(5, 20, 2, redraws=3, seed=8)
    # 79 examples cannot hold three more disjoint blocks of 20: drawn with replacement
    assert redraw_batches(79, 20, 1, redraws=3, seed=1) != list(range(20, 40))
    with pytest.raises(ValueError, match="redraw"):
        redraw_batches(80, 20, 4, redraws=3)


def test_perturbation_keeps_the_mean_and_moves_each_fisher_by_its_roles_spread():
    updates = synthetic_updates(1, tensors=1, rows=512, cols=512, seed=0)
    redraw = perturbed(updates, {"forget": 0.3, "retain": 1.2}, seed=5)
    for u, d in zip(updates, redraw, strict=True):
        (key,) = u.fisher
        f, g = u.fisher[key].double(), d.fisher[key].double()
        assert d.task_vector is u.task_vector and bool((g > 0).all())
        rho = 0.3 if u.role == "forget" else 1.2
        ratio = g / f  # exp(σz − σ²/2): mean 1, E(ratio − 1)² = ρ²
        assert float(ratio.mean()) == pytest.approx(1.0, abs=0.02 * rho)
        assert float((ratio - 1).pow(2).mean().sqrt()) == pytest.approx(rho, rel=0.05)
    spread = relative_spread(redraw, perturbed(updates, {"forget": 0.3, "retain": 1.2}, 6), updates)
    # the lognormal ratio is heavy-tailed for large ρ, so the Fisher-weighted estimate is rough
    assert spread["forget"] == pytest.approx(0.3, rel=0.1)
    assert spread["retain"] == pytest.approx(1.2, rel=0.35)


def test_spread_is_the_difference_of_two_redraws_over_root_two():
    updates = synthetic_updates(1, tensors=1, rows=64, cols=32, seed=1)
    scale = {"forget": 0.1, "retain": 0.4}
    a = [
        replace(u, fisher={k: f * (1 + scale[u.role]) for k, f in u.fisher.items()})
        for u in updates
    ]
    b = [
        replace(u, fisher={k: f * (1 - scale[u.role]) for k, f in u.fisher.items()})
        for u in updates
    ]
    spread = relative_spread(a, b, updates)  # ‖2δ·F̂‖ / (√2·‖F̂‖) = √2·δ
    assert spread == pytest.approx({r: math.sqrt(2) * s for r, s in scale.items()}, rel=1e-6)


@pytest.mark.parametrize("n", [1, 2])
def test_resampling_error_is_positive_and_measured_against_the_dense_merge(results, n):
    result = results[n]
    updates = synthetic_updates(n, **SHAPE)
    kwargs = {"gamma": 1.0, "alpha": ALPHA, "eps0": bench_merge.EPS0}
    dense_base = firm_merge(updates, epsilon=math.inf, **kwargs)
    epsilon = budget(dense_base)
    assert result["epsilon"] == epsilon
    dense_projected = firm_merge(updates, epsilon=epsilon, **kwargs)
    rows = result["resampling"]
    assert set(rows) == {"all", "forget"} and len(rows["all"]["draws"]) == REDRAWS
    for r in range(1, REDRAWS + 1):
        redraw = perturbed(updates, SPREAD, 1000 * SHAPE["seed"] + r)  # synthetic_input's seeds
        forget_only = [d if u.role == "forget" else u for u, d in zip(updates, redraw, strict=True)]
        for redrawn, draw_updates in (("all", redraw), ("forget", forget_only)):
            draw = rows[redrawn]["draws"][r - 1]
            base = firm_merge(draw_updates, epsilon=math.inf, **kwargs)
            projected = firm_merge(draw_updates, epsilon=epsilon, **kwargs)
            assert draw["base"] == relative_error(base, dense_base)
            assert draw["projected"] == relative_error(projected, dense_projected)
            assert draw["base"]["error"] > 0.0 and draw["projected"]["error"] > 0.0
    for redrawn in ("all", "forget"):
        for merge in ("base", "projected"):
            errors = sorted(d[merge]["error"] for d in rows[redrawn]["draws"])
            assert rows[redrawn][merge] == {"min": errors[0], "median": errors[1], "max": errors[2]}
    # an exact upload (α' ≥ α, one client per domain) lies far inside the estimate's own noise
    assert rows["forget"]["base"]["min"] > 0.01


def test_recommendation_is_the_smallest_fraction_within_the_bound_everywhere(results):
    inputs = {f"n={n}": result for n, result in results.items()}
    worst = recommend(inputs, 0.01)["max_error_by_form"]
    at = smallest_fraction(inputs, worst["topk 0.3"])  # e ≤ bound: the boundary is in
    assert at["fraction"] == 0.3 and worst["topk 0.2"] > at["bound"]
    assert smallest_fraction(inputs, math.nextafter(worst["topk 0.3"], 0))["fraction"] == 0.5
    assert at["bytes_input"] == "n=1"
    row = next(r for r in inputs["n=1"]["rows"] if r["fraction"] == 0.3)
    assert at["fisher_bytes"] == row["fisher_bytes"] and at["upload_bytes"] == row["upload_bytes"]
    assert smallest_fraction(inputs, 1e-12)["fraction"] == 1.0  # α' = 1 is exact
    assert smallest_fraction(inputs, 0.0)["fraction"] == 1.0


def test_the_recommendation_bound_is_the_smallest_median_resampling_error(results):
    inputs = {f"n={n}": result for n, result in results.items()}
    rec = recommend(inputs, 0.01)
    for redrawn in ("all", "forget"):
        medians = [
            r["resampling"][redrawn][m]["median"]
            for r in results.values()
            for m in ("base", "projected")
        ]
        bound = resampling_bound(inputs, redrawn)
        assert bound == min(medians) > 0.0
        assert rec[f"resampling_{redrawn}"] == smallest_fraction(inputs, bound)
    assert rec["fixed"]["bound"] == 0.01 and rec["fixed"]["fraction"] == 1.0  # the 1 % rule
    without = {k: {kk: v for kk, v in r.items() if kk != "resampling"} for k, r in inputs.items()}
    assert resampling_bound(without) is None and recommend(without, 0.01)["resampling_all"] is None


def test_report_of_an_unevaluated_run_has_no_metrics_table(results):
    """``--no-evaluate``: the run's rows carry no metrics, so the report leaves out the metrics
    table (and says what the redraws were); an evaluated run's report has it."""
    run = {
        **results[2],
        "fisher_batches": 2,
        "fisher_reproduction_max_rel_diff": 0.0,
        "shard_sizes": [{"role": "forget", "examples": 8}, {"role": "retain", "examples": 40}],
        "fisher_spread": SPREAD,
    }
    inputs = {"tofu-run": run, "synthetic 4/domain": results[4]}
    summary = {"inputs": inputs, "recommendation": recommend(inputs, 0.01)}
    text = markdown(summary)
    assert "Real redraws: F̂ recomputed at θ₀ from N = 2 batches" in text
    assert "| model |" not in text
    names = ["forget_rouge_l"]
    metrics = {"base": {"forget_rouge_l": 0.5}, "projected": {"forget_rouge_l": 0.4}}
    evaluated = {
        **run,
        "rows": [{**r, "metrics": metrics} for r in run["rows"]],
        "resampling": {
            k: {**v, "draws": [{**d, "metrics": metrics} for d in v["draws"]]}
            for k, v in run["resampling"].items()
        },
        "before": dict.fromkeys(names, 0.9),
        "reference": dict.fromkeys(names, 0.2),
    }
    inputs["tofu-run"] = evaluated
    text = markdown({"inputs": inputs, "recommendation": recommend(inputs, 0.01)})
    assert "| model | forget_rouge_l |" in text and "| before | 0.900 |" in text
