"""Evaluations of unchanged models are cached under a key of weights, settings and code."""

import json

import torch

from strategies.eval_cache import cached_evaluation, evaluation_key
from strategies.settings import RunSettings

REAL = {"model.name": "smollm2-135m"}


def test_key_follows_weights_settings_and_reference(tiny_model):
    settings = RunSettings.from_run_config(REAL)
    key = evaluation_key(tiny_model, settings, None, None)
    assert key == evaluation_key(tiny_model, settings, None, None)
    with torch.no_grad():
        tiny_model.lm_head.weight[0, 0] += 1e-3
    changed = evaluation_key(tiny_model, settings, None, None)
    assert changed != key
    other = RunSettings.from_run_config({**REAL, "eval.max-new-tokens": 8})
    assert evaluation_key(tiny_model, other, None, None) != changed
    assert evaluation_key(tiny_model, settings, {"forget_truth_ratios": [0.5]}, None) != changed
    unrelated = RunSettings.from_run_config({**REAL, "gamma": 3.0})  # a merge setting
    assert evaluation_key(tiny_model, unrelated, None, None) == changed


def test_cached_evaluation_computes_once_and_survives_a_damaged_file(tmp_path):
    calls = []

    def evaluate():
        calls.append(1)
        return {"forget_rouge_l": 0.25, "forget_quality": float("nan"), "n": len(calls)}

    first = cached_evaluation(tmp_path, "k", "original", evaluate)
    again = cached_evaluation(tmp_path, "k", "original", evaluate)
    assert first == again == {"forget_rouge_l": 0.25, "forget_quality": "nan", "n": 1}
    assert len(calls) == 1
    (tmp_path / "evaluations" / "k.json").write_text('{"forget_rouge_l": 0.2')  # cut short
    assert cached_evaluation(tmp_path, "k", "original", evaluate)["n"] == 2
    assert json.loads((tmp_path / "evaluations" / "k.json").read_text())["n"] == 2
