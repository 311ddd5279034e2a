"""simulations.compare: paired bootstrap differences and matched forgetting on constructed
scores with a known difference (and with none), and the refusal of runs on other questions."""

import json
from pathlib import Path

import numpy as np
import pytest

from fedunlearn.evaluation.intervals import QUESTIONS_KEY, SCORE_SETS_KEY, SCORES_KEY
from simulations import compare as cmp

N = 120


def _metrics(lists: dict[str, np.ndarray], questions: str = "q") -> dict:
    return {
        **{k: float(np.mean(v)) for k, v in lists.items()},
        SCORES_KEY: {k: [float(x) for x in v] for k, v in lists.items()},
        SCORE_SETS_KEY: {k: k.split("_")[0] for k in lists},
        QUESTIONS_KEY: {k.split("_")[0]: f"{questions}-{k.split('_')[0]}" for k in lists},
    }


def _point(label: str, lists: dict[str, np.ndarray], merge: str = "firm", gamma=1.0, q="q"):
    return cmp.Point(label, merge, gamma, _metrics(lists, q), None, Path(label))


def _paired_draws(rng: np.random.Generator, p_a: float, p_b: float) -> tuple:
    """Per question correctness of two models; P(b=1 | a) chosen so E[a] = p_a, E[b] = p_b and
    the two agree on most questions (a paired design)."""
    a = (rng.random(N) < p_a).astype(float)
    keep = rng.random(N) < 0.8
    b = np.where(keep, a, (rng.random(N) < (p_b - 0.8 * p_a) / 0.2).astype(float))
    return a, b


@pytest.mark.parametrize("p_b, truth", [(0.6, 0.1), (0.7, 0.0)])
def test_paired_interval_covers_the_true_difference(p_b, truth):
    """150 constructed pairs of runs with a true difference of 0.1 (and of none): the paired
    95 % interval holds it in 88-99 % of them; with a difference it excludes 0 mostly."""
    rng = np.random.default_rng(7)
    covered = excludes_zero = 0
    for trial in range(150):
        a, b = _paired_draws(rng, 0.7, p_b)
        row = cmp.paired_differences(
            _point("a", {"forget_acc": a}), _point("b", {"forget_acc": b}), 500, trial
        )["forget_acc"]
        low, high = row["interval"]
        assert row["difference"] == pytest.approx(a.mean() - b.mean())
        covered += low <= truth <= high
        excludes_zero += not low <= 0 <= high
    assert 0.88 <= covered / 150 <= 0.995
    if truth:
        assert excludes_zero / 150 > 0.6
    else:
        assert excludes_zero / 150 < 0.12


def test_pairing_narrows_the_interval():
    """The same questions resampled for both runs: the interval of A − B is narrower than the
    difference of two unpaired intervals would suggest."""
    rng = np.random.default_rng(8)
    a, b = _paired_draws(rng, 0.7, 0.6)
    drawn_apart = cmp.paired_differences(
        _point("a", {"forget_acc": a}), _point("b", {"forget_acc": b}), 2000, 0
    )["forget_acc"]["interval"]
    single = cmp.paired_differences(
        _point("a", {"forget_acc": a}), _point("z", {"forget_acc": 0 * a}), 2000, 0
    )["forget_acc"]["interval"]
    assert drawn_apart[1] - drawn_apart[0] < 0.8 * (single[1] - single[0]) * np.sqrt(2)


def _curve(merge: str, slope: float, offset: float, rng) -> list:
    """Three γ points of a merge: forget ROUGE-L f and retain ROUGE-L offset + slope·f on the
    same questions (values per question around those means)."""
    points = []
    for gamma, forget in ((1.0, 0.3), (2.0, 0.5), (3.0, 0.7)):
        noise = rng.normal(0, 0.05, N)
        lists = {
            "forget_rouge": np.clip(forget + noise, 0, 1),
            "retain_rouge": np.clip(offset + slope * forget + rng.normal(0, 0.05, N), 0, 1),
        }
        points.append(_point(f"{merge} γ={gamma}", lists, merge, gamma))
    return points


def test_matched_forgetting_interpolates_both_curves_at_one_level():
    rng = np.random.default_rng(9)
    curves = {
        "firm": _curve("firm", 0.5, 0.45, rng),  # retain 0.45 + 0.5 f
        "sum": _curve("sum", 0.5, 0.35, rng),  # 0.1 lower at every forget level
    }
    result = cmp.matched_forgetting(curves, "forget_rouge", "retain_rouge", 1000, 0, 0.5)
    row = result["differences"]["sum"]
    assert result["anchor"] == "firm" and result["forget_level"] == 0.5
    low, high = row["interval"]
    assert row["difference"] == pytest.approx(0.1, abs=0.03)
    assert 0 < low <= 0.1 <= high and row["resamples_used"] > 900
    # FIRM is the anchor wherever its curve stands (a sweep lists its points by file name)
    swapped = cmp.matched_forgetting(
        {"sum": curves["sum"], "firm": curves["firm"]}, "forget_rouge", "retain_rouge", 200, 0, 0.5
    )
    assert swapped["anchor"] == "firm" and list(swapped["differences"]) == ["sum"]
    # the default level: the middle of the range both curves span
    default = cmp.matched_forgetting(curves, "forget_rouge", "retain_rouge", 200, 0)
    assert default["forget_level"] == pytest.approx(0.5, abs=0.02)


def _write_run(folder: Path, lists: dict[str, np.ndarray], merge: str, q: str = "q") -> Path:
    folder.mkdir(parents=True)
    metrics = _metrics(lists, q)
    after = {k: v for k, v in metrics.items() if k not in (SCORES_KEY, SCORE_SETS_KEY)}
    after.pop(QUESTIONS_KEY)
    results = {"config": {"merge": merge, "gamma": 2.0}, "metrics": {"after": after}}
    (folder / "results.json").write_text(json.dumps(results))
    scores = {
        "after": metrics[SCORES_KEY],
        "question_sets": metrics[SCORE_SETS_KEY],
        "question_digests": metrics[QUESTIONS_KEY],
    }
    (folder / "scores.json").write_text(json.dumps(scores))
    return folder


def test_the_command_compares_saved_runs_and_refuses_other_questions(tmp_path, capsys):
    rng = np.random.default_rng(10)
    a, b = _paired_draws(rng, 0.8, 0.5)
    run_a = _write_run(tmp_path / "a", {"forget_acc": a}, "firm")
    run_b = _write_run(tmp_path / "b", {"forget_acc": b}, "ties")
    out = tmp_path / "cmp.json"
    assert cmp.main([str(run_a), str(run_b / "results.json"), "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    row = json.loads(out.read_text())["paired"]["ties γ=2 (b)"]["forget_acc"]
    assert row["difference"] == pytest.approx(a.mean() - b.mean())
    assert f"{row['difference']:+.4f}" in printed and "*" in printed
    other = _write_run(tmp_path / "c", {"forget_acc": b}, "ties", q="other")
    assert cmp.main([str(run_a), str(other)]) == 2
    err = capsys.readouterr().err
    assert f"{other / 'results.json'} was scored on other 'forget' questions" in err
    (run_b / "scores.json").unlink()
    assert cmp.main([str(run_a), str(run_b)]) == 2
    assert "no scores.json beside results.json" in capsys.readouterr().err
    assert cmp.main([str(run_a)]) == 2
    assert "at least two runs" in capsys.readouterr().err


def test_matched_forgetting_over_seeds_combines_seeds_and_questions():
    """Three seeds whose baseline curve sits 0.06, 0.10 and 0.14 below FIRM's: the mean
    difference 0.10, the between-seed sd 0.04, an interval wider than one seed's."""
    rng = np.random.default_rng(11)
    seed_curves = {
        s: {"firm": _curve("firm", 0.5, 0.45, rng), "sum": _curve("sum", 0.5, 0.45 - gap, rng)}
        for s, gap in ((0, 0.06), (1, 0.10), (2, 0.14))
    }
    result = cmp.matched_forgetting_over_seeds(
        seed_curves, "forget_rouge", "retain_rouge", 1000, 0, 0.5
    )
    row = result["differences"]["sum"]
    assert result["seeds"] == [0, 1, 2]
    assert row["difference"] == pytest.approx(0.10, abs=0.02)
    assert row["sd"] == pytest.approx(0.04, abs=0.015)
    low, high = row["interval"]
    one = cmp.matched_forgetting(seed_curves[1], "forget_rouge", "retain_rouge", 1000, 0, 0.5)
    one_low, one_high = one["differences"]["sum"]["interval"]
    assert low < row["difference"] < high and high - low > one_high - one_low
