"""pipeline=dp2u in real Flower simulations: DP base, deployed and unlearned models, baselines."""

import json
import math

import pytest
from opacus.accountants import RDPAccountant

from fedunlearn.benchmarks.tofu import generate_tofu
from fedunlearn.dp2u import data_shards
from simulations import run_local

pytestmark = pytest.mark.slow

SMALL = (
    "scenario.num-authors=20 dp2u.clients=2 scenario.forget-percent=10.0 dp2u.dp-rounds=2 "
    "dp2u.finetune-rounds=2 dp2u.retrain-rounds=3 dp2u.dp-batch-size=16 "
    "eval.retain-samples=20 eval.max-new-tokens=8 training.forget-steps=3"
)


@pytest.fixture(scope="module")
def stage_cache(tmp_path_factory):
    """One stage cache for the module: a stage that two methods share (RFS-R, keyed by what
    determines it) is trained by the first run and reused by the next, as in a sweep."""
    return tmp_path_factory.mktemp("dp2u-cache")


def _run(tmp_path, checkpoint, options, cache):
    path = run_local.run(
        run_config=f"model.path='{checkpoint}' pipeline='dp2u' {options} {SMALL}",
        output_dir=tmp_path / "out",
        flwr_home=tmp_path / "flwr_home",
        cache_dir=cache,
    )
    return json.loads(path.read_text())


def test_dp2u_sgd_spends_the_budget_and_never_trains_on_forget_records(
    tmp_path, tiny_checkpoint, stage_cache
):
    results = _run(
        tmp_path, tiny_checkpoint, "dp2u.method='dp2u-sgd' dp2u.epsilon=2.0", stage_cache
    )
    dp = results["dp2u"]
    privacy = dp["privacy"]
    rounds = privacy["epsilon_per_round"]
    assert len(rounds) == 2 and len(rounds[0]) == 2
    for client, shard in enumerate(dp["shards"]):
        # the accountant persisted across rounds on the client: ε grows, and the final ε is
        # Opacus's for all steps of both rounds with this client's σ and q
        assert 0 < rounds[0][client] < rounds[1][client] <= 2.0
        accountant = RDPAccountant()
        q = min(1.0, 16 / shard["trained_records"])
        steps = 2 * math.ceil(shard["trained_records"] / 16)
        accountant.history = [(privacy["noise_multiplier"][client], q, steps)]
        assert rounds[1][client] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)
        assert rounds[1][client] > 0.98 * 2.0  # calibrated to spend the budget
    # stage C: the forget records never reached any training loop (digest of the examples)
    checks = dp["data_check"]
    assert [c["forget_records_on_client"] > 0 for c in checks] == [False, True]
    assert all(c["trained_on_retained_only"] for c in checks)
    assert set(dp["stages"]) == {
        "RFS-R (retain only, E)",
        "A: DP base (DP-SGD)",
        "B: deployed FM (E′)",
        "C: unlearned UM (E′)",
    }
    assert dp["cost_vs_rfs_r"]["epochs_ratio"] == pytest.approx(2 / 3)
    assert dp["cost_vs_rfs_r"]["client_seconds_ratio"] > 0
    distances = dp["forget_truth_ratio_distances"]
    assert set(distances) == {"js_divergence", "wasserstein", "entropy_difference", "ks_pvalue"}
    assert distances["ks_pvalue"] == pytest.approx(results["metrics"]["after"]["forget_quality"])
    for name in ("reference", "base", "before", "after"):
        assert 0 <= results["metrics"][name]["model_utility"] <= 1


def test_baseline_runs_a_named_forget_request_through_the_same_pipeline(
    tmp_path, tiny_checkpoint, stage_cache
):
    # a forget request naming one author on client 0 and one single record on client 1
    # (the forget-10 % split would have hit client 1's last two authors only)
    data = generate_tofu(seed=0, num_authors=20, qa_per_author=10)
    shards = data_shards(data, num_clients=2, forget_percent=10.0)
    author = data.author_qa[shards[0].indices[0]]["author"]
    record = shards[1].indices[3]
    request = json.dumps({"0": {"authors": [author]}, "1": {"records": [record]}})
    (tmp_path / "request.json").write_text(request)
    results = _run(
        tmp_path,
        tiny_checkpoint,
        f"dp2u.method='graddiff' dp2u.forget-request='{tmp_path / 'request.json'}'",
        stage_cache,
    )
    dp = results["dp2u"]
    assert dp["privacy"] == {"mechanism": "none"}
    assert set(dp["stages"]) == {"RFS-R (retain only, E)", "deployed (E)", "unlearning round"}
    assert dp["forget_request"] == [
        {"client": 0, "authors": [author], "records": []},
        {"client": 1, "authors": [], "records": [record]},
    ]
    assert [s["forget"] for s in dp["shards"]] == [10, 1]
    # RFS-R trained on exactly the retained records of both clients (digest of its examples)
    assert [c["forget_records_on_client"] for c in dp["data_check"]] == [10, 1]
    assert all(c["trained_on_retained_only"] for c in dp["data_check"])
    forget_clients = dp["stages"]["unlearning round"]["clients"]
    assert len(forget_clients) == 2 and forget_clients[0]["objective"] == "graddiff"
    after = results["metrics"]["after"]
    assert len(after["forget_truth_ratios"]) == 11  # evaluated on the requested records
    assert 0 < after["forget_quality"] <= 1
    assert after != results["metrics"]["before"]


def test_dp2u_mlm_rewrites_private_records_with_a_public_masked_lm(
    tmp_path, tiny_checkpoint, stage_cache
):
    results = _run(
        tmp_path,
        tiny_checkpoint,
        "dp2u.method='dp2u-mlm' dp2u.epsilon=1.0 dp2u.mlm-sensitive-only=true",
        stage_cache,
    )
    dp = results["dp2u"]
    privacy = dp["privacy"]
    assert privacy["epsilon_per_token"] == 1.0 and privacy["sensitive_only"] is True
    for shard, replaced, eps in zip(
        dp["shards"], privacy["tokens_replaced"], privacy["epsilon_per_record_max"], strict=True
    ):
        # names and fact values of every private record were replaced (a few tokens each);
        # a record's ε composes over its replaced tokens
        assert replaced >= shard["private_records"]
        assert 1.0 <= eps == int(eps)
    assert "A: DP base (DP-MLM)" in dp["stages"]
    assert all(c["trained_on_retained_only"] for c in dp["data_check"])
    assert any(stage_cache.glob("dp2u/*/public-mlm-seed*"))  # the public MLM, kept for reuse
