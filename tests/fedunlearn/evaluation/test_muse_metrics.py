"""Tests for the MUSE-style metrics: KnowMem, VerbMem, Min-K% Prob, AUC and PrivLeak."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from fedunlearn.benchmarks.muse import (
    MuseData,
    generate_muse,
    generate_muse_background,
    muse_training_texts,
)
from fedunlearn.evaluation import muse_metrics
from fedunlearn.evaluation.muse_metrics import (
    evaluate_muse,
    greedy_continue,
    knowmem,
    membership_auc,
    min_k_percent_scores,
    privleak,
    rouge_l_f1,
    verbmem,
)
from fedunlearn.qa_format import format_prompt
from fedunlearn.scenarios import ScenarioParams, get_scenario
from tests.shared_paths import shared_data

TEXTS = [
    "In the year 1860, Burtes Tarlai left Valdmoor and travelled to Emberly.",
    "A goat followed Burtes.",
    "Before they parted, Nolne gave Burtes a jar of honey and warned of the frozen lake.",
    "Hi there",
]


@pytest.fixture(scope="module")
def small_data() -> MuseData:
    return generate_muse(
        seed=0,
        num_books=5,
        passages_per_book=2,
        qa_per_passage=2,
        num_forget_books=2,
        num_holdout_books=2,
    )


# ------------------------------------------------------------------------------- ROUGE steps


def test_rouge_l_f1_hand_values() -> None:
    scores = rouge_l_f1(["a jar of honey", "1860", "Honey, a jar of"], ["a jar of honey"] * 3)
    assert scores[:2] == [1.0, 0.0]
    assert 0.0 < scores[2] < 1.0
    # LCS "red lantern" = 2 tokens; precision 2/3, recall 2/2 -> F1 0.8.
    assert rouge_l_f1(["the red lantern"], ["red lantern"]) == [pytest.approx(0.8)]
    assert rouge_l_f1([""], ["anything"]) == [0.0]


def test_knowmem_and_verbmem_are_one_when_generations_match(monkeypatch, small_data) -> None:
    qa = small_data.forget_qa
    probes = small_data.verbmem
    monkeypatch.setattr(
        muse_metrics, "greedy_generate", lambda m, t, qs, **kw: [r["answer"] for r in qa]
    )
    monkeypatch.setattr(
        muse_metrics, "greedy_continue", lambda m, t, ps, **kw: [p["gt"] for p in probes]
    )
    score, generations = knowmem(None, None, qa)
    assert score == 1.0 and generations == [r["answer"] for r in qa]
    score, generations = verbmem(None, None, probes)
    assert score == 1.0 and generations == [p["gt"] for p in probes]
    with pytest.raises(ValueError, match="at least one"):
        knowmem(None, None, [])
    with pytest.raises(ValueError, match="at least one"):
        verbmem(None, None, [])


def test_knowmem_and_raw_continuation_on_memorised_model(
    trained_model, tokenizer, memorised_records
) -> None:
    score, generations = knowmem(trained_model, tokenizer, memorised_records, batch_size=3)
    assert score == 1.0
    assert generations == [r["answer"] for r in memorised_records]
    # The raw text of the QA prompt continues exactly like the QA generation.
    probes = [
        {"prompt": format_prompt(r["question"]), "gt": r["answer"]} for r in memorised_records
    ]
    score, generations = verbmem(trained_model, tokenizer, probes, max_new_tokens=20)
    assert score == 1.0


# --------------------------------------------------------------------------- raw continuation


def test_greedy_continue_batched_equals_unbatched(tiny_model, tiny_tokenizer) -> None:
    single = [greedy_continue(tiny_model, tiny_tokenizer, [t], max_new_tokens=8)[0] for t in TEXTS]
    for batch_size in (2, 4):
        batched = greedy_continue(
            tiny_model, tiny_tokenizer, TEXTS, max_new_tokens=8, batch_size=batch_size
        )
        assert batched == single
    assert greedy_continue(tiny_model, tiny_tokenizer, []) == []
    assert greedy_continue(tiny_model, tiny_tokenizer, TEXTS[:2], max_new_tokens=0) == ["", ""]
    with pytest.raises(ValueError, match="empty"):
        greedy_continue(tiny_model, tiny_tokenizer, [""])


def test_greedy_continue_keeps_last_prompt_tokens(tiny_model, tiny_tokenizer) -> None:
    text = TEXTS[2]
    ids = tiny_tokenizer(text)["input_ids"]
    tail = tiny_tokenizer.decode(ids[-5:])
    cut = greedy_continue(tiny_model, tiny_tokenizer, [text], max_new_tokens=6, max_prompt_tokens=5)
    assert cut == greedy_continue(tiny_model, tiny_tokenizer, [tail], max_new_tokens=6)


# -------------------------------------------------------------------------------- Min-K% Prob


def _min_k_by_hand(model, tokenizer, text: str, k: float) -> float:
    ids = tokenizer(text)["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    logp = torch.log_softmax(logits[:-1].double(), dim=-1)
    token_logp = [float(logp[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    lowest = sorted(token_logp)[: max(1, int(k * len(token_logp)))]
    return sum(lowest) / len(lowest)


def test_min_k_matches_hand_computation(tiny_model, tiny_tokenizer) -> None:
    tiny_model.eval()
    expected = [_min_k_by_hand(tiny_model, tiny_tokenizer, t, 0.4) for t in TEXTS]
    scores = min_k_percent_scores(tiny_model, tiny_tokenizer, TEXTS, k=0.4, batch_size=3)
    assert scores == pytest.approx(expected, rel=1e-5)
    assert all(s < 0 for s in scores)
    # k = 1 is the mean token log-probability; it is never below the Min-40% score.
    full = min_k_percent_scores(tiny_model, tiny_tokenizer, TEXTS, k=1.0)
    assert all(f >= s - 1e-6 for f, s in zip(full, scores, strict=True))


def test_min_k_validation(tiny_model, tiny_tokenizer) -> None:
    assert min_k_percent_scores(tiny_model, tiny_tokenizer, []) == []
    with pytest.raises(ValueError, match="k must be"):
        min_k_percent_scores(tiny_model, tiny_tokenizer, TEXTS, k=0.0)
    with pytest.raises(ValueError, match="at least 2"):
        min_k_percent_scores(tiny_model, tiny_tokenizer, ["a"])


# ------------------------------------------------------------------------------ AUC, PrivLeak


def test_membership_auc_hand_cases() -> None:
    assert membership_auc([3.0, 4.0], [1.0, 2.0]) == 1.0
    assert membership_auc([1.0, 2.0], [3.0, 4.0]) == 0.0
    assert membership_auc([1.0, 1.0], [1.0, 1.0, 1.0]) == 0.5
    # pairs (member, non-member): (.9,.5)=1 (.9,.1)=1 (.5,.5)=.5 (.5,.1)=1 (.5,.5)=.5 (.5,.1)=1
    assert membership_auc([0.9, 0.5, 0.5], [0.5, 0.1]) == pytest.approx(5 / 6)
    # (2 > 1) + (2 = 2) / 2 + (2 < 3) + ... over 1 x 3 pairs
    assert membership_auc([2.0], [1.0, 2.0, 3.0]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="at least one"):
        membership_auc([], [1.0])
    with pytest.raises(ValueError, match="non-finite"):
        membership_auc([math.nan], [1.0])


def test_privleak_formula() -> None:
    assert privleak(0.75, 0.5) == pytest.approx(50.0)
    assert privleak(0.5, 0.5) == 0.0
    assert privleak(0.25, 0.5) == pytest.approx(-50.0)
    with pytest.raises(ValueError, match="auc_retrain"):
        privleak(0.7, 0.0)


# -------------------------------------------------------------------------------- evaluation


def test_evaluate_muse_on_tiny_random_model(tiny_model, tiny_tokenizer, small_data) -> None:
    result = evaluate_muse(
        tiny_model,
        tiny_tokenizer,
        small_data,
        batch_size=4,
        max_new_tokens=6,
        verbmem_max_new_tokens=8,
        n_samples=2,
    )
    keys = {"knowmem_forget", "knowmem_retain", "verbmem_forget", "privleak_auc", "privleak"}
    assert set(result) == keys | {"samples", "scores", "score_sets", "question_digests"}
    for key in keys - {"privleak"}:
        assert 0.0 <= result[key] <= 1.0
    # every mean metric with its per-item values, each list its own item set
    means = {"knowmem_forget", "knowmem_retain", "verbmem_forget"}
    assert set(result["scores"]) == means and result["score_sets"] == {k: k for k in means}
    for key in means:
        assert result[key] == pytest.approx(sum(result["scores"][key]) / len(result["scores"][key]))
    assert len(result["scores"]["knowmem_forget"]) == len(small_data.forget_qa)
    assert result["privleak"] is None
    samples = result["samples"]
    assert [s["question"] for s in samples["knowmem_forget"]] == [
        r["question"] for r in small_data.forget_qa[:2]
    ]
    assert [s["gt"] for s in samples["verbmem_forget"]] == [p["gt"] for p in small_data.verbmem[:2]]
    assert all(isinstance(s["generation"], str) for s in samples["verbmem_forget"])
    json.dumps(result)

    again = evaluate_muse(
        tiny_model,
        tiny_tokenizer,
        small_data,
        retrain_auc=0.5,
        max_new_tokens=6,
        verbmem_max_new_tokens=8,
        n_samples=0,
    )
    assert again["privleak_auc"] == pytest.approx(result["privleak_auc"])
    assert again["privleak"] == pytest.approx(privleak(result["privleak_auc"], 0.5))
    assert again["samples"] == {"knowmem_forget": [], "verbmem_forget": []}


def test_evaluate_muse_missing_parts_give_none(tiny_model, tiny_tokenizer, small_data) -> None:
    bare = MuseData(
        forget_passages=small_data.forget_passages,
        retain_passages=[],
        holdout_passages=[],
        forget_qa=[],
        retain_qa=[],
        verbmem=[],
        seed=0,
    )
    result = evaluate_muse(tiny_model, tiny_tokenizer, bare, retrain_auc=0.5)
    for key in ("knowmem_forget", "knowmem_retain", "verbmem_forget", "privleak_auc", "privleak"):
        assert result[key] is None


# ------------------------------------------------------------------------------------- slow


def _train(texts: list[str], tokenizer, seed: int = 0):
    from fedunlearn.models.llama import new_tiny_llama, tiny_llama_config
    from fedunlearn.training.full import train_full

    config = tiny_llama_config(
        len(tokenizer),
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=256,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = new_tiny_llama(config, seed=seed)
    examples = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        examples.append((ids, list(ids)))
    train_full(
        model,
        examples,
        pad_token_id=tokenizer.pad_token_id,
        epochs=30,
        lr=4e-3,
        batch_size=8,
        seed=seed,
        show_progress=False,
    )
    return model


@pytest.mark.slow
def test_trained_model_remembers_forget_set_and_retrain_does_not() -> None:
    """A tiny Llama trained with the forget books vs. the same recipe without them.

    Measured (seed 0, one CPU thread, 15-18 s): knowledgeable knowmem_forget 1.0, verbmem_forget
    0.896, privleak_auc 1.0, knowmem_retain 1.0; retrain 0.089, 0.126, 0.472 and 0.722;
    PrivLeak of the knowledgeable model against the retrain AUC +111.8 %.
    """
    from fedunlearn.models.tokenizer import train_bpe_tokenizer

    start = time.perf_counter()
    tokenizer = train_bpe_tokenizer(generate_muse_background(seed=0, num_documents=600), 1024)
    data = generate_muse(
        seed=0,
        num_books=5,
        passages_per_book=3,
        qa_per_passage=2,
        num_forget_books=2,
        num_holdout_books=2,
    )
    results = {}
    for name, include_forget in (("knowledgeable", True), ("retrain", False)):
        model = _train(muse_training_texts(data, include_forget=include_forget), tokenizer)
        results[name] = evaluate_muse(model, tokenizer, data, batch_size=16, n_samples=1)
    know, retrain = results["knowledgeable"], results["retrain"]
    summary = {
        name: {k: round(v, 3) for k, v in r.items() if isinstance(v, float)}
        for name, r in results.items()
    }
    leak = privleak(know["privleak_auc"], retrain["privleak_auc"])
    print(f"MUSE slow test ({time.perf_counter() - start:.1f} s): {summary}, privleak {leak:.1f}")
    assert know["knowmem_forget"] >= 0.8
    assert know["knowmem_forget"] >= retrain["knowmem_forget"] + 0.4
    assert know["verbmem_forget"] >= 0.7
    assert know["verbmem_forget"] >= retrain["verbmem_forget"] + 0.4
    assert know["knowmem_retain"] >= 0.7
    assert know["privleak_auc"] >= 0.8
    assert leak > 0


# ------------------------------------------------------- the real files' subset (issue 14)


def test_real_muse_subset_evaluates_on_a_tiny_model(tiny_model, tiny_tokenizer) -> None:
    params = ScenarioParams(data_path=str(shared_data("muse-news")), subset_texts=3)
    scenario = get_scenario("muse")(params)
    kwargs = {"batch_size": 2, "max_new_tokens": 4, "n_samples": 1}
    result = scenario.evaluate(tiny_model, tiny_tokenizer, **kwargs)
    keys = {"knowmem_forget", "knowmem_retain", "verbmem_forget", "privleak_auc"}
    assert set(result) == keys | {"privleak", "samples", "scores", "score_sets", "question_digests"}
    assert result["privleak"] is None
    assert all(0.0 <= result[key] <= 1.0 for key in keys)
    probe = result["samples"]["verbmem_forget"][0]
    assert (probe["prompt"], probe["gt"]) == (
        scenario.data.verbmem[0]["prompt"],
        scenario.data.verbmem[0]["gt"],
    )
    against = scenario.evaluate(
        tiny_model, tiny_tokenizer, reference_metrics={"privleak_auc": 0.5}, **kwargs
    )
    assert against["privleak"] == pytest.approx(privleak(result["privleak_auc"], 0.5))
    # the build-time check: VerbMem with the evaluation's budget, KnowMem forget alone
    check = scenario.check_knowledge(tiny_model, tiny_tokenizer)
    assert set(check) == {"verbmem_forget", "knowmem_forget"}
    assert check["verbmem_forget"] == pytest.approx(result["verbmem_forget"])
    reference = scenario.check_reference(tiny_model, tiny_tokenizer)
    assert reference == {f"reference_{k}": v for k, v in check.items()}
