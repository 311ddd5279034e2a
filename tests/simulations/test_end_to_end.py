"""End to end: the README's main job as a real Flower simulation on Ray.

Starts a real simulation SuperLink, runs 5 forget + 1 retain ClientApps on Ray, merges
with FIRM on the server and checks from ``results.json`` that the forget authors are gone
while utility stays close to the original. Builds (or reuses) the cached default substrate.
"""

import json

import pytest

from simulations import run_local

pytestmark = pytest.mark.slow

# Thresholds (see the closing note for the measured numbers behind them):
# * forgetting — forget ROUGE-L and exact match must fall by at least half of their value
#   before unlearning: a clear, not marginal, drop;
# * utility — model utility may lose at most 0.1 (absolute) of its value before unlearning
#   and retain ROUGE-L at most 0.15: "close to the original" at this model scale.
FORGET_DROP = 0.5
MAX_UTILITY_LOSS = 0.10
MAX_RETAIN_ROUGE_LOSS = 0.15


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    path = run_local.run(output_dir=root / "out", flwr_home=root / "flwr_home")
    return json.loads(path.read_text())


def test_substrate_knows_the_authors(results):
    assert results["substrate"]["author_recall_exact_match"] >= 0.95
    # the retain-only reference never saw the forget authors
    assert results["substrate"]["forget_recall_reference_exact_match"] <= 0.2


def test_clients_and_merge_report(results):
    clients = results["clients"]
    assert sorted(c["role"] for c in clients) == ["forget"] * 5 + ["retain"]
    assert all("excluded" not in c for c in clients)
    forget = [c for c in clients if c["role"] == "forget"]
    assert sum(c["num_examples"] for c in forget) == 20  # forget-1 %: 2 authors × 10 QA
    assert all(c["bytes_sent"] > 0 and c["task_vector_norm"] > 0 for c in clients)
    report = results["merge"]["report"]
    assert report["method"] == "firm" and report["norm_final"] > 0
    assert len(report["tensors"]) == 4 * 7  # 4 layers × 7 projections


def test_forgot_the_forget_authors_and_kept_the_rest(results):
    before, after = results["metrics"]["before"], results["metrics"]["after"]
    assert before["forget_exact_match"] >= 0.9
    assert after["forget_rouge_l"] <= (1 - FORGET_DROP) * before["forget_rouge_l"]
    assert after["forget_exact_match"] <= (1 - FORGET_DROP) * before["forget_exact_match"]
    assert after["model_utility"] >= before["model_utility"] - MAX_UTILITY_LOSS
    assert after["retain_rouge_l"] >= before["retain_rouge_l"] - MAX_RETAIN_ROUGE_LOSS
    reference = results["metrics"]["reference"]
    assert after["forget_quality"] > before["forget_quality"]
    assert reference["forget_rouge_l"] < before["forget_rouge_l"]
