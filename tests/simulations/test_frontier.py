"""Matched-forgetting comparison and the sweep's table and plot."""

from simulations.frontier import matched_forgetting, plot_frontier, summary_markdown


def _point(strategy, gamma, forget, utility, retain=1.0):
    metrics = {
        "forget_rouge_l": forget,
        "model_utility": utility,
        "retain_rouge_l": retain,
        "forget_exact_match": forget,
        "forget_quality": 0.5,
        "real_authors_rouge_l": 0.7,
        "world_facts_rouge_l": 1.0,
    }
    return {"strategy": strategy, "gamma": gamma, "norm_final": gamma, "metrics": metrics}


POINTS = [
    _point("firm", 4, 0.80, 0.52),
    _point("firm", 8, 0.65, 0.51),
    _point("fulm", 0.5, 0.90, 0.50),
    _point("fulm", 1.0, 0.66, 0.45, 0.9),
    _point("sum", 1.0, 0.79, 0.40),
]


def test_matched_forgetting_picks_nearest_by_forget_metric():
    rows = matched_forgetting(POINTS, anchor="firm")
    by = {(r["anchor_gamma"], r["baseline"]): r for r in rows}
    assert len(rows) == 4
    r = by[(8, "fulm")]
    assert r["baseline_gamma"] == 1.0
    assert abs(r["forget_gap"] - 0.01) < 1e-12
    assert abs(r["utility_diff"] - 0.06) < 1e-12 and abs(r["retain_rouge_diff"] - 0.1) < 1e-12
    assert by[(4, "fulm")]["baseline_gamma"] == 0.5  # |0.90-0.80| < |0.66-0.80|
    assert by[(4, "sum")]["baseline_gamma"] == 1.0


def test_table_and_plot(tmp_path):
    before = _point("x", 0, 1.0, 0.52)["metrics"]
    summary = {
        "before": before,
        "reference": None,
        "points": POINTS,
        "matched_forgetting": matched_forgetting(POINTS),
    }
    text = summary_markdown(summary)
    assert "| firm | 8 |" in text and "Matched forgetting" in text and "+0.060" in text
    path = plot_frontier(summary, tmp_path / "frontier.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
