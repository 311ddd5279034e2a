"""End to end: the README's main job as a real Flower simulation on Ray, at test size.

Starts a real simulation SuperLink, runs 5 forget + 1 retain ClientApps on Ray, merges
with FIRM on the server and checks from ``results.json`` that the forget authors are gone
while utility stays close to the original. Uses the small substrate preset (built once per
test session) with 20 authors, 2 of them forgotten, instead of the default 200-author model.
"""

import html
import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from simulations import compact_check, run_local
from tests.simulations.presets import SMALL_TOFU

pytestmark = pytest.mark.slow

# Thresholds, chosen from a measured run of SMALL_TOFU (forget ROUGE-L 0.994 → 0.475 with the
# reference at 0.601, exact match 0.95 → 0.00, utility 0.567 → 0.555, retain ROUGE-L
# 0.993 → 0.971, forget truth ratio 0.537 → 0.606 with the reference at 0.664) with head-room
# for float differences between machines:
# * ROUGE-L of a template-heavy answer never reaches 0 (the retain-only reference, which never
#   saw the forget authors, scores ~0.6), so forgetting is measured as the share of the gap
#   between the original and the reference that unlearning closes: at least 60 %;
# * forget exact match must fall from >= 0.9 to <= 0.25;
# * "close to the original": model utility may lose at most 0.05 and retain ROUGE-L at most
#   0.05 (absolute);
# * with 20 forget questions the KS forget-quality test moves in coarse steps, so the test asks
#   that the forget truth ratio moves toward the reference's instead.
MIN_GAP_CLOSED = 0.6
MAX_FORGET_EXACT_MATCH = 0.25
MAX_UTILITY_LOSS = 0.05
MAX_RETAIN_ROUGE_LOSS = 0.05


@pytest.fixture(scope="module")
def results_path(tmp_path_factory, substrate_cache) -> Path:
    root = tmp_path_factory.mktemp("e2e")
    return run_local.run(
        run_config=SMALL_TOFU,
        output_dir=root / "out",
        flwr_home=root / "flwr_home",
        cache_dir=substrate_cache,
    )


@pytest.fixture(scope="module")
def results(results_path):
    return json.loads(results_path.read_text())


def test_report_html_shows_the_run(results_path, results):
    """report.html sits next to results.json, self-contained, and shows this run's numbers."""
    page = (results_path.parent / "report.html").read_text(encoding="utf-8")
    assert page.count("src='data:image/png;base64,") == 2  # metric bars, damage per tensor
    assert "http://" not in page and "https://" not in page and "<link" not in page
    for metric in ("forget_rouge_l", "model_utility"):
        for model in ("before", "after", "reference"):
            value = results["metrics"][model][metric]
            low, high = results["metrics_ci"][model][metric]
            shown = f"<td>{value:.4g} <span class='note'>[{low:.3g}, {high:.3g}]</span></td>"
            assert shown in page, (metric, model)
    rows = [
        f"<td>{c['node_id']}</td><td>{c['role']}</td><td>{c['domain']}</td>"
        for c in results["clients"]
    ]
    assert all(row in page for row in rows)
    assert sorted(c["role"] for c in results["clients"]) == ["forget"] * 5 + ["retain"]
    tensors = results["merge"]["tensors"]
    assert len(tensors) > 0
    for name, t in tensors.items():
        assert f"<td class='text'>{name}</td><td>{t['norm_base']:.4g}</td>" in page
    after = results["metrics"]["after"]["samples"]["forget"][0]["generation"]
    before = results["metrics"]["before"]["samples"]["forget"][0]["generation"]
    assert html.escape(after, quote=True) in page and html.escape(before, quote=True) in page


def test_scores_json_holds_every_mean_metrics_questions_and_the_intervals_agree(
    results_path, results
):
    """scores.json: per stage, every metric that is a mean over questions as its list (in one
    question order for every stage); results.json: a 95 % interval for each and for the
    derived metrics; an interval recomputed from scores.json by numpy's own resampling
    agrees."""
    scores = json.loads((results_path.parent / "scores.json").read_text())
    metrics, intervals = results["metrics"], results["metrics_ci"]
    assert set(scores) == {"before", "after", "reference", "question_sets", "question_digests"}
    # every question set named with the digest of its questions (simulations.compare pairs on it)
    assert set(scores["question_digests"]) == set(scores["question_sets"].values())
    means = [f"{s}_{m}" for s in ("forget", "retain") for m in ("rouge_l", "prob", "exact_match")]
    for stage in ("before", "after", "reference"):
        assert "scores" not in metrics[stage] and set(means) <= set(scores[stage])
        for name, values in scores[stage].items():
            assert len(values) == len(scores["before"][name])
            assert sum(values) / len(values) == pytest.approx(metrics[stage][name], abs=1e-12)
            low, high = intervals[stage][name]
            assert low <= metrics[stage][name] <= high, (stage, name)
        low, high = intervals[stage]["model_utility"]
        assert low <= metrics[stage]["model_utility"] <= high
    assert scores["question_sets"]["forget_rouge_l"] == "forget"
    assert len(scores["after"]["forget_rouge_l"]) == 20  # 2 forget authors × 10 QA
    # forget quality: the KS p-values of the resampled forget truth ratios against the
    # reference's, recomputed here with scipy and numpy's own resampling
    ratios = np.asarray(metrics["after"]["forget_truth_ratios"])
    fixed = metrics["reference"]["forget_truth_ratios"]
    draws = np.random.default_rng(98).integers(0, ratios.size, size=(2000, ratios.size))
    pvalues = [stats.ks_2samp(ratios[row], fixed).pvalue for row in draws]
    low, high = intervals["after"]["forget_quality"]
    assert 0 <= low <= high <= 1
    assert [low, high] == pytest.approx(np.percentile(pvalues, [2.5, 97.5]), abs=0.01)
    values = np.asarray(scores["after"]["forget_rouge_l"])
    resampled = values[np.random.default_rng(99).integers(0, 20, size=(20000, 20))].mean(axis=1)
    expected = np.percentile(resampled, [2.5, 97.5])
    assert intervals["after"]["forget_rouge_l"] == pytest.approx(expected, abs=0.02)


def test_substrate_knows_the_authors(results):
    assert results["substrate"]["author_recall_exact_match"] >= 0.9
    # the retain-only reference never saw the forget authors
    assert results["substrate"]["forget_recall_reference_exact_match"] <= 0.2


def test_clients_and_merge_report(results):
    clients = results["clients"]
    assert sorted(c["role"] for c in clients) == ["forget"] * 5 + ["retain"]
    assert all("excluded" not in c for c in clients)
    forget = [c for c in clients if c["role"] == "forget"]
    assert sum(c["num_examples"] for c in forget) == 20  # forget 10 %: 2 authors × 10 QA
    assert [c["num_examples"] for c in clients if c["role"] == "retain"] == [100]
    assert all(c["bytes_sent"] > 0 and c["task_vector_norm"] > 0 for c in clients)
    merge = results["merge"]
    assert merge["method"] == "firm" and merge["norm_final"] > 0
    assert len(merge["tensors"]) == 2 * 7  # 2 layers × 7 projections
    retain_id = str(next(c["node_id"] for c in clients if c["role"] == "retain"))
    assert all(retain_id in t["damage_after"] for t in merge["tensors"].values())


def test_forgot_the_forget_authors_and_kept_the_rest(results):
    before = results["metrics"]["before"]
    after = results["metrics"]["after"]
    reference = results["metrics"]["reference"]
    assert before["forget_exact_match"] >= 0.9
    gap = before["forget_rouge_l"] - reference["forget_rouge_l"]
    assert gap > 0.2  # the original really knows the forget authors, the reference does not
    closed = (before["forget_rouge_l"] - after["forget_rouge_l"]) / gap
    assert closed >= MIN_GAP_CLOSED, closed
    assert after["forget_exact_match"] <= MAX_FORGET_EXACT_MATCH
    assert after["model_utility"] >= before["model_utility"] - MAX_UTILITY_LOSS
    assert after["retain_rouge_l"] >= before["retain_rouge_l"] - MAX_RETAIN_ROUGE_LOSS
    ratio = reference["forget_truth_ratio"]
    assert abs(after["forget_truth_ratio"] - ratio) < abs(before["forget_truth_ratio"] - ratio)


SMALL_RUN = (
    "scenario.num-authors=20 scenario.retain-samples=20 eval.retain-samples=20 "
    "eval.max-new-tokens=8 lora.rank=4 lora.alpha=8.0"
)


@pytest.fixture()
def checkpoint(tmp_path, tiny_model, tiny_tokenizer):
    tiny_model.save_pretrained(tmp_path / "ckpt")
    tiny_tokenizer.save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


@pytest.mark.parametrize("merge", ["ties", "fulm-mean"])
def test_baseline_merges_through_flower(tmp_path, checkpoint, merge):
    """merge= selects a baseline merge in a real simulation (FIRM: the tests above; SUM in
    test_studies and test_mpu_flower, FULM inside MPU there; every registered name resolves
    through the same registry, tested in tests/strategies/test_merge_plugins.py)."""
    path = run_local.run(
        run_config=f"model.path='{checkpoint}' merge='{merge}' {SMALL_RUN}",
        output_dir=tmp_path / "out",
        flwr_home=tmp_path / "flwr_home",
    )
    results = json.loads(path.read_text())
    assert results["merge"]["method"] == merge
    assert results["merge"]["norm_final"] > 0
    assert len(results["merge"]["tensors"]) == 2 * 7
    if merge.startswith("fulm"):
        clusters = results["merge"]["clusters"]
        assert sorted(m for c in clusters for m in c) == sorted(
            str(c["node_id"]) for c in results["clients"]
        )


def test_local_checkpoint_through_flower(tmp_path, checkpoint):
    """model.path: any local Hugging Face causal LM runs through the same Flower pipeline."""
    path = run_local.run(
        run_config=f"model.path='{checkpoint}' {SMALL_RUN}",
        output_dir=tmp_path / "out",
        flwr_home=tmp_path / "flwr_home",
    )
    results = json.loads(path.read_text())
    assert results["config"]["model.path"] == str(checkpoint)
    assert "reference" not in results["metrics"]  # no retain-only model for a foreign checkpoint
    assert results["metrics"]["after"]["forget_quality"] is None
    assert sorted(c["role"] for c in results["clients"]) == ["forget"] * 5 + ["retain"]
    assert sum(c["num_examples"] for c in results["clients"] if c["role"] == "forget") == 10
    assert len(results["merge"]["tensors"]) == 2 * 7
    assert results["metrics"]["after"] != results["metrics"]["before"]


PLUGIN = """
import torch
from fedunlearn.merging import MergeResult

def half_sum(updates, *, gamma=1.0):
    forget = [u for u in updates if u.role == "forget"]
    delta = {k: 0.5 * gamma * sum(u.task_vector[k] for u in forget) for k in forget[0].task_vector}
    norm = float(torch.sqrt(sum((d.double() ** 2).sum() for d in delta.values())))
    return MergeResult(delta=delta, report={"method": "half-sum", "norm_final": norm,
                                            "clients": len(updates)})
"""


def test_plugin_merge_through_flower(tmp_path, checkpoint, monkeypatch):
    """A merge defined outside the repository runs via merge='module:function'."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "my_merges.py").write_text(PLUGIN)
    monkeypatch.setenv("PYTHONPATH", str(plugins))  # for the Flower processes
    monkeypatch.syspath_prepend(str(plugins))  # run_local imports the merge up front
    path = run_local.run(
        run_config=f"model.path='{checkpoint}' merge='my_merges:half_sum' gamma=0.5 {SMALL_RUN}",
        output_dir=tmp_path / "out",
        flwr_home=tmp_path / "flwr_home",
    )
    results = json.loads(path.read_text())
    merge = results["merge"]
    assert merge["method"] == "half-sum" and merge["clients"] == 6
    assert merge["norm_final"] > 0
    assert results["config"]["merge"] == "my_merges:half_sum"
    assert (results["config"]["wrapper"], results["config"]["pipeline"]) == ("none", "unlearn")
    assert results["metrics"]["after"] != results["metrics"]["before"]


def test_compact_streamed_uploads_give_the_dense_runs_merge_at_a_fraction_of_the_bytes(
    tmp_path, checkpoint
):
    """The defaults (LoRA factors, top-k Fisher, uploads spooled to disk) merge exactly what
    dense float32 uploads held in memory merge: one forget client, so every client's top-k
    Fisher (α' ≥ α) is exact, and factors decode bit for bit (``simulations.compact_check``
    runs both forms and compares their saved weights)."""
    report = compact_check.check(
        f"model.path='{checkpoint}' {SMALL_RUN} scenario.num-forget-clients=1",
        "",
        tmp_path,
        reuse=False,
    )
    assert report["merged_update"]["error"] == 0.0
    assert report["merged_update"]["changed_weights"] == 2 * 7
    assert report["merged_update"]["dense_update_norm"] > 0
    assert report["bytes_ratio"] > 4
    assert "| bytes per client (sent) |" in (tmp_path / "compact_check.md").read_text()
    runs = {name: json.loads(Path(path).read_text()) for name, path in report["results"].items()}
    compact, dense = runs["compact"], runs["dense"]
    assert compact["merge"]["streamed"] and not dense["merge"]["streamed"]
    assert not (tmp_path / "compact" / "uploads-spool").exists()  # removed after the run
    for key, tensor in dense["merge"]["tensors"].items():
        assert compact["merge"]["tensors"][key]["norm_final"] == tensor["norm_final"], key
    assert compact["metrics"]["after"] == dense["metrics"]["after"]
    for small, full in zip(compact["clients"], dense["clients"], strict=True):
        assert full["bytes_sent"] == full["bytes_dense"] == small["bytes_dense"]
        assert small["bytes_sent"] * 4 < full["bytes_sent"]
        assert small["bytes_task_vector"] + small["bytes_fisher"] == small["bytes_sent"]
        # what the server received: the payload plus NumPy's per-array header
        assert small["bytes_sent"] < small["bytes_arrays"] < 1.2 * small["bytes_sent"]
        assert small["bytes_metadata"] > 0
        assert small["read_on_arrival"] and "read_on_arrival" not in full  # StreamingGrid
    assert compact["seconds"]["server_peak_rss_bytes"] > 0
