"""The study drivers end to end at a tiny scale: one real Flower run each, then re-merges."""

import dataclasses
import json

import numpy as np
import pytest

from fedunlearn.evaluation.intervals import SCORES_KEY
from simulations import compare, magnitude, multi_retain, sweep, sweep_seeds
from strategies.merge_plugins import merge_kwargs, resolve_merge

pytestmark = pytest.mark.slow

TINY = "lora.rank=4 lora.alpha=8.0 eval.max-new-tokens=8 eval.retain-samples=20"


@pytest.fixture()
def checkpoint(tmp_path, tiny_model, tiny_tokenizer):
    tiny_model.save_pretrained(tmp_path / "ckpt")
    tiny_tokenizer.save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_sweep_writes_points_table_and_frontier(tmp_path, checkpoint):
    out = tmp_path / "sweep"
    summary = sweep.sweep(
        ["firm", "sum"],
        {"firm": [1.0, 4.0, 8.0], "sum": [0.5]},
        f"model.path='{checkpoint}' scenario.num-authors=20 scenario.retain-samples=20 {TINY}",
        out,
    )
    assert sorted(p.name for p in (out / "points").iterdir()) == [
        "firm-g1.json",
        "firm-g4.json",
        "firm-g8.json",
        "sum-g0.5.json",
    ]
    norms = {(p["strategy"], p["gamma"]): p["norm_final"] for p in summary["points"]}
    assert norms[("firm", 4.0)] == pytest.approx(4 * norms[("firm", 1.0)], rel=1e-4)
    assert len(summary["matched_forgetting"]) == 3  # every FIRM point vs its nearest SUM point
    assert "Matched forgetting" in (out / "summary.md").read_text()
    assert (out / "frontier.png").stat().st_size > 10_000
    # the points keep their per-question scores: a paired comparison of the sweep's points
    compared = compare.compare([out], resamples=200)
    assert compared["points"] == ["firm γ=1", "firm γ=4", "firm γ=8", "sum γ=0.5"]
    rows = compared["paired"]["firm γ=4"]
    by_gamma = {p["gamma"]: p["metrics"] for p in summary["points"] if p["strategy"] == "firm"}
    for name in ("forget_rouge_l", "model_utility", "retain_exact_match"):
        assert rows[name]["difference"] == pytest.approx(by_gamma[1.0][name] - by_gamma[4.0][name])
        low, high = rows[name]["interval"]
        assert low <= high
    # γ = 8 (tofu's default) is the Flower run's own merge: its point is the run's own
    # evaluation, read back, and evaluating the re-merge again gives exactly that
    own = json.loads((out / "points" / "firm-g8.json").read_text())
    assert own["how"].endswith("equal to the run's own merge: the run's evaluation")
    assert "own" not in json.loads((out / "points" / "firm-g4.json").read_text())["how"]
    flower = sweep.run_and_load_uploads("", out / "flower-run", reuse=True)
    params = dataclasses.replace(flower.settings, merge="firm", gamma=8.0)
    firm = resolve_merge("firm")
    delta = firm(flower.updates, **merge_kwargs(firm, params.merge_parameters())).delta
    fresh = flower.evaluate("firm γ=8", delta)
    assert {k: fresh[k] for k in own["metrics"]} == own["metrics"]
    assert fresh[SCORES_KEY] == own["evaluation"][SCORES_KEY]
    # re-using the finished Flower run: a point evaluated before with the same merge arguments
    # is read back (a value changed on disk stays changed), one whose file is gone or whose
    # arguments differ is merged and evaluated again, with the same numbers as the first time
    points = out / "points"
    for name, kwargs_change in (("firm-g4.json", {}), ("sum-g0.5.json", {"gamma": 9.0})):
        saved = json.loads((points / name).read_text())
        saved["metrics"]["forget_rouge_l"] = -1.0
        saved["merge_kwargs"].update(kwargs_change)
        (points / name).write_text(json.dumps(saved))
    (points / "firm-g1.json").unlink()
    again = sweep.sweep(
        ["firm", "sum"], {"firm": [1.0, 4.0, 8.0], "sum": [0.5]}, "", out, reuse_run=True
    )
    assert again["points"][0]["metrics"] == summary["points"][0]["metrics"]
    assert again["points"][1]["metrics"]["forget_rouge_l"] == -1.0
    assert again["points"][3]["metrics"] == summary["points"][3]["metrics"]


def test_sweep_over_client_training_seeds(tmp_path, checkpoint):
    """--seeds: one sweep per training.seed (the clients train differently, the questions stay),
    then per point the mean, the between-seed sd and the interval over seeds and questions."""
    out = tmp_path / "seeds"
    run_config = (
        f"model.path='{checkpoint}' scenario.num-authors=20 scenario.retain-samples=20 {TINY}"
    )
    argv = ["--strategies", "firm", "--gammas", "firm=4", "--run-config", run_config]
    assert sweep.main([*argv, "--seeds", "0,1", "--output-dir", str(out)]) == 0
    summary = json.loads((out / "seeds.json").read_text())
    assert summary["seeds"] == [0, 1]
    rows = summary["points"]["firm-g4"]
    per_run = [
        json.loads((out / f"seed-{s}" / "points" / "firm-g4.json").read_text())["metrics"]
        for s in (0, 1)
    ]
    norms = [
        json.loads((out / f"seed-{s}" / "points" / "firm-g4.json").read_text())["norm_final"]
        for s in (0, 1)
    ]
    assert norms[0] != norms[1]  # the clients trained differently
    for metric in ("forget_rouge_l", "model_utility"):
        row = rows[metric]
        values = [m[metric] for m in per_run]
        assert row["per_seed"] == {"0": values[0], "1": values[1]}
        assert row["mean"] == pytest.approx(sum(values) / 2)
        assert row["sd"] == pytest.approx(abs(values[0] - values[1]) / 2**0.5)
        assert row["interval"][0] <= min(values) and max(values) <= row["interval"][1]
    assert "firm-g4" in (out / "seeds.md").read_text()
    # compare reads the seeds' sweeps; one merge of one γ has no curve to match
    with pytest.raises(compare.CompareError, match="seed 0: fewer than two merges"):
        compare.compare([out], resamples=50)


def test_seed_interval_reduces_to_the_questions_interval_for_equal_seeds():
    rng = np.random.default_rng(0)
    one = {"m": rng.normal(0.5, 0.05, 1000)}
    assert sweep_seeds.seed_interval([one, one, one], "m", 1000) == pytest.approx(
        np.percentile(one["m"], [2.5, 97.5])
    )
    spread = [{"m": one["m"] + shift} for shift in (-0.2, 0.0, 0.2)]
    low, high = sweep_seeds.seed_interval(spread, "m", 1000)
    assert high - low > 0.2  # the between-seed spread widens it


def test_multi_retain_exact_beats_increase_only(tmp_path, checkpoint):
    summary = multi_retain.study(
        f"model.path='{checkpoint}' scenario.num-authors=20 {TINY}", tmp_path / "mr", gamma=4.0
    )
    assert [row["m"] for row in summary["rows"]] == [1, 2, 3]
    for row in summary["rows"]:
        exact, paper = row["exact"], row["increase-only"]
        assert len(exact["clients"]) == row["m"]
        for client in exact["clients"].values():
            assert client["damage_after"] <= client["damage_before"]
        assert exact["max_violation"] <= 1e-4 * row["epsilon"] + 1e-12
        assert exact["objective"] <= paper["objective"] * (1 + 1e-6) + 1e-15
        assert exact["norm_final"] <= exact["norm_base"] + 1e-9
    domains = sorted(c["domain"] for c in summary["rows"][2]["exact"]["clients"].values())
    assert domains == ["retain-authors-a", "retain-authors-b", "retain-world"]
    assert json.loads((tmp_path / "mr" / "multi_retain.json").read_text())["rows"]


def test_magnitude_sum_grows_firm_does_not(tmp_path, checkpoint):
    summary = magnitude.study(
        f"model.path='{checkpoint}' scenario.num-authors=200 scenario.retain-samples=20 {TINY}",
        {"sum": 1.0, "fulm": 1.0, "firm": 1.0},
        tmp_path / "mag",
    )
    norm = {(r["method"], r["n_domains"]): r["norm"] for r in summary["rows"]}
    assert norm[("sum", 4)] > 1.5 * norm[("sum", 1)]
    assert norm[("firm", 4)] / norm[("firm", 1)] < norm[("sum", 4)] / norm[("sum", 1)]
    assert (tmp_path / "mag" / "magnitude.png").stat().st_size > 10_000
