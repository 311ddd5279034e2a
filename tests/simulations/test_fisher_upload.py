"""The Fisher-upload study's core on synthetic uploads: exact where FIRM uses each client's own
top-α, errors shrinking with α' where a domain pools several clients, bytes as the codec sends
them."""

import math

import pytest
import torch

from simulations import bench_merge
from simulations.fisher_upload import (
    ALPHA,
    FisherForm,
    factor_bytes,
    fisher_forms,
    measure_input,
    recommend,
    synthetic_updates,
)

SHAPE = {"tensors": 2, "rows": 192, "cols": 96, "seed": 3}


@pytest.fixture(scope="module")
def results():
    return {
        n: (updates, measure_input(updates, gamma=1.0, lora_rank=bench_merge.RANK))
        for n in (1, 2, 4)
        for updates in [synthetic_updates(n, **SHAPE)]
    }


def _topk(rows):
    return [r for r in rows if r["form"] == "topk"]


def test_the_grid_is_alpha_multiples_and_one():
    forms = fisher_forms()
    assert forms[:2] == [FisherForm("dense"), FisherForm("bf16")]
    fractions = [f.fraction for f in forms[2:]]
    assert fractions == pytest.approx([0.1, 0.125, 0.15, 0.2, 0.3, 0.5, 1.0])
    assert all(f.form == "topk" for f in forms[2:])


def test_one_forget_client_per_domain_is_exact_at_every_fraction_from_alpha(results):
    _, result = results[1]
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
    _, result = results[n]
    rows = _topk(result["rows"])
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
        kept = int(((flat >= threshold) & (flat > 0)).sum())
        total += math.ceil(flat.numel() / 8) + 4 * kept  # 1 bit per entry + float32 values
    return total


def test_bytes_are_one_bit_per_entry_plus_the_kept_values(results):
    updates, result = results[2]
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
        # continuous Fishers have no ties: 1/32 of dense for the mask plus α' for the values
        assert r["fisher_bytes_ratio"] == pytest.approx(1 / 32 + r["fraction"], abs=1e-4)
        assert r["upload_ratio"] == pytest.approx(8 * entries / (factors + r["fisher_bytes"]))


def test_recommendation_is_the_smallest_fraction_under_the_bound_everywhere(results):
    inputs = {f"n={n}": result for n, (_, result) in results.items()}
    strict = recommend(inputs, 0.01)
    assert strict["fraction"] == 1.0  # pooled domains: only the whole Fisher is within 1 %
    worst = strict["max_error_by_form"]
    loose = recommend(inputs, worst["topk 0.3"] * 1.0001)
    assert loose["fraction"] == 0.3 and worst["topk 0.2"] >= loose["bound"]
    assert loose["bytes_input"] == "n=1"
    row = next(r for r in inputs["n=1"]["rows"] if r["fraction"] == 0.3)
    assert loose["fisher_bytes_ratio"] == row["fisher_bytes_ratio"]
    assert recommend(inputs, 1e-12)["fraction"] == 1.0  # α' = 1 is exact
