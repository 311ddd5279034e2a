"""DP-MLM rewriting: the exponential-mechanism sampler, span-restricted rewriting, the tiny
masked LM, and the sensitive spans of the TOFU-style generator."""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from scipy import stats

from fedunlearn.benchmarks.tofu import (
    TEMPLATES,
    generate_background_corpus,
    generate_tofu,
)
from fedunlearn.dp.mlm import (
    C_MAX,
    C_MIN,
    exponential_mechanism_probs,
    load_masked_lm,
    rewrite_records,
    rewrite_text,
    sample_exponential_mechanism,
    save_masked_lm,
    split_sentences,
    train_masked_lm,
    train_word_tokenizer,
)

DELTA_U = C_MAX - C_MIN
# Toy logits: one far below c_min, one far above c_max (clipped to it), one exactly at c_max.
TOY_LOGITS = torch.tensor([-40.0, -2.0, 0.0, 4.0, 9.0, 15.0, C_MAX, 1000.0])


def _expected(logits: torch.Tensor, epsilon: float) -> torch.Tensor:
    clipped = logits.double().clamp(C_MIN, C_MAX)
    return torch.softmax(clipped * epsilon / (2 * DELTA_U), dim=-1)


def _assert_matches(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """Chi-square goodness of fit (p > 0.001) and every cell within 4 standard errors."""
    n = int(counts.sum())
    expected = probs.double() * n
    support = probs > 0
    assert int(counts[~support].sum()) == 0
    chi2 = stats.chisquare(counts[support].numpy(), expected[support].numpy())
    assert chi2.pvalue > 1e-3, (counts.tolist(), expected.tolist())
    stderr = torch.sqrt(n * probs * (1 - probs)).clamp_min(1e-12)
    assert bool(((counts - expected).abs() <= 4 * stderr + 1e-9).all())


# --------------------------------------------------------------------------- mechanism
def test_probs_are_softmax_of_clipped_scaled_logits() -> None:
    probs = exponential_mechanism_probs(TOY_LOGITS, 3.0)
    assert torch.allclose(probs, _expected(TOY_LOGITS, 3.0), atol=1e-12)
    assert probs[-1] == probs[-2]  # 1000 behaves as c_max
    assert probs[0] == exponential_mechanism_probs(torch.tensor([C_MIN, *TOY_LOGITS[1:]]), 3.0)[0]
    ratio = (probs.max() / probs.min()).item()  # utility range Δu at ε/(2Δu) → e^{ε/2}
    assert ratio == pytest.approx(math.exp(3.0 / 2), rel=1e-9)


@pytest.mark.parametrize("epsilon", [2.0, 60.0])
def test_sampler_follows_exponential_mechanism(epsilon: float) -> None:
    n = 40_000
    gen = torch.Generator().manual_seed(11)
    draws = sample_exponential_mechanism(TOY_LOGITS.expand(n, -1), epsilon, generator=gen)
    counts = torch.bincount(draws, minlength=len(TOY_LOGITS)).double()
    probs = _expected(TOY_LOGITS, epsilon)
    _assert_matches(counts, probs)
    # Without clipping the 1000 logit would take (almost) all mass; clipped it matches c_max.
    assert abs(counts[-1] - counts[-2]) <= 4 * math.sqrt(2 * n * probs[-1].item())
    assert counts[-1] / n < 0.9


def test_epsilon_limits_and_allowed_mask() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, 8.0, -1.0])
    assert exponential_mechanism_probs(logits, 1e5)[3] > 0.999999
    assert torch.equal(exponential_mechanism_probs(logits, math.inf), torch.eye(5)[3].double())
    uniform = exponential_mechanism_probs(logits, 0.0)
    assert torch.allclose(uniform, torch.full((5,), 0.2, dtype=torch.float64))
    allowed = torch.tensor([True, True, True, False, True])
    masked = exponential_mechanism_probs(logits, 1e5, allowed=allowed)
    assert masked[3] == 0 and masked[1] > 0.999999
    with pytest.raises(ValueError, match="epsilon"):
        exponential_mechanism_probs(logits, -1.0)


# --------------------------------------------------------------------------- stub MLM
class FixedLogitsMLM(torch.nn.Module):
    """A "masked LM" that outputs the same logits at every position."""

    def __init__(self, row: torch.Tensor, max_positions: int = 16) -> None:
        super().__init__()
        self.register_buffer("row", row)
        self.config = SimpleNamespace(vocab_size=len(row), max_position_embeddings=max_positions)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        return SimpleNamespace(logits=self.row.expand(*input_ids.shape, -1))


@pytest.fixture(scope="module")
def toy_tokenizer():
    return train_word_tokenizer(["alpha beta gamma delta eta theta iota kappa ."], min_frequency=1)


def _stub(tokenizer, special_logit: float = 50.0) -> FixedLogitsMLM:
    row = torch.linspace(-8.0, 30.0, len(tokenizer))
    row[tokenizer.all_special_ids] = special_logit  # the best logits: must still never be drawn
    return FixedLogitsMLM(row)


def test_rewrite_draws_follow_mechanism_and_skip_special_tokens(toy_tokenizer) -> None:
    model = _stub(toy_tokenizer)
    n, epsilon = 6000, 40.0
    text = " ".join(["alpha"] * n)  # longer than the context: windows around each target
    result = rewrite_text(
        text, model, toy_tokenizer, epsilon_per_token=epsilon, generator=torch.Generator()
    )
    assert result.replaced_tokens == n and result.epsilon == pytest.approx(n * epsilon)
    words = result.text.split(" ")
    assert len(words) == n
    ids = torch.tensor(toy_tokenizer.convert_tokens_to_ids(words))
    counts = torch.bincount(ids, minlength=len(toy_tokenizer)).double()
    allowed = torch.ones(len(toy_tokenizer), dtype=torch.bool)
    allowed[toy_tokenizer.all_special_ids] = False
    probs = exponential_mechanism_probs(model.row, epsilon, allowed=allowed)
    assert float(probs[~allowed].sum()) == 0.0
    _assert_matches(counts, probs)


def test_sensitive_spans_only_rewrite_inside(toy_tokenizer) -> None:
    model = _stub(toy_tokenizer)
    text = "alpha beta gamma, delta eta theta. iota kappa"
    spans = [(6, 16), (24, 27)]  # "beta gamma" and "eta"
    result = rewrite_text(
        text,
        model,
        toy_tokenizer,
        epsilon_per_token=0.5,
        generator=torch.Generator().manual_seed(3),
        spans=spans,
    )
    assert result.replaced_tokens == 3
    assert result.epsilon == pytest.approx(1.5)
    assert result.positions == [(6, 10), (11, 16), (24, 27)]
    new = result.text
    (a1, b1), (a2, b2) = result.map_span(6, 16), result.map_span(24, 27)
    assert new[:a1] == "alpha " and new[b1:a2] == ", delta " and new[b2:] == " theta. iota kappa"
    # A span covering part of a word rewrites the whole word.
    partial = rewrite_text(
        text,
        model,
        toy_tokenizer,
        epsilon_per_token=1.0,
        generator=torch.Generator(),
        spans=[(1, 2)],
    )
    assert partial.replaced_tokens == 1 and partial.text.endswith(text[5:])


# --------------------------------------------------------------------------- tiny real MLM
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    corpus = generate_background_corpus(seed=0, num_documents=400)
    model, tokenizer = train_masked_lm(
        corpus,
        seed=0,
        steps=200,
        batch_size=64,
        lr=4e-3,
        hidden_size=64,
        intermediate_size=128,
        dropout=0.0,
    )
    return corpus, model, tokenizer


def test_tiny_mlm_beats_unigram_on_held_out_text(trained) -> None:
    corpus, model, tok = trained
    train_ids = tok(split_sentences(corpus), add_special_tokens=False)["input_ids"]
    unigram = Counter(i for ids in train_ids for i in ids)
    total = sum(unigram.values())
    held_out = split_sentences(generate_background_corpus(seed=1, num_documents=40))
    gen = torch.Generator().manual_seed(0)
    model_nll = unigram_nll = 0.0
    count = 0
    for sentence in held_out:
        ids = tok(sentence)["input_ids"]
        positions = [p for p in range(1, len(ids) - 1) if ids[p] != tok.unk_token_id]
        positions = [p for p in positions if torch.rand(1, generator=gen).item() < 0.3]
        if not positions:
            continue
        batch = torch.tensor([ids] * len(positions))
        rows = torch.arange(len(positions))
        batch[rows, positions] = tok.mask_token_id
        with torch.no_grad():
            logp = model(input_ids=batch).logits[rows, positions].log_softmax(-1)
        for row, p in enumerate(positions):
            model_nll -= logp[row, ids[p]].item()
            unigram_nll -= math.log((unigram[ids[p]] + 1) / (total + len(tok)))
            count += 1
    assert count > 200
    # Measured: ~3.6 nats (model) vs ~5.1 (add-one unigram of the training sentences).
    assert model_nll / count < unigram_nll / count - 1.0, (model_nll / count, unigram_nll / count)


def test_save_and_load_round_trip(trained, tmp_path) -> None:
    _, model, tok = trained
    save_masked_lm(model, tok, tmp_path / "mlm")
    loaded, loaded_tok = load_masked_lm(tmp_path / "mlm")
    text = "Where was Bora Tenlai born?"
    ids = torch.tensor([tok(text)["input_ids"]])
    assert ids.tolist() == [loaded_tok(text)["input_ids"]]
    assert loaded_tok.mask_token_id == tok.mask_token_id
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, loaded(input_ids=ids).logits)
    with pytest.raises(FileNotFoundError):
        load_masked_lm(tmp_path / "missing")


def _strip_spans(text: str, spans: list[list[int]]) -> list[str]:
    """The pieces of ``text`` outside ``spans``."""
    pieces, cursor = [], 0
    for a, b in sorted(spans):
        pieces.append(text[cursor:a])
        cursor = b
    return [*pieces, text[cursor:]]


def test_rewrite_records_sensitive_only(trained) -> None:
    _, model, tok = trained
    records = generate_tofu(seed=0, num_authors=10, qa_per_author=10).author_qa[:40]
    before = json.dumps(records, sort_keys=True)
    out, report = rewrite_records(
        records, model, tok, epsilon_per_token=1.0, seed=5, sensitive_only=True
    )
    assert json.dumps(records, sort_keys=True) == before  # inputs not mutated
    expected_per_record = []
    for old, new in zip(records, out, strict=True):
        for key in ("paraphrased_answer", "perturbed_answer", "author"):
            assert new[key] == old[key]
        tokens = 0
        for field in ("question", "answer"):
            old_spans, new_spans = old["sensitive_spans"][field], new["sensitive_spans"][field]
            assert _strip_spans(old[field], old_spans) == _strip_spans(new[field], new_spans)
            tokens += sum(len(re.findall(r"\w+|[^\w\s]+", old[field][a:b])) for a, b in old_spans)
        expected_per_record.append(tokens * 1.0)
    assert report["tokens_replaced"] == sum(expected_per_record)
    assert report["epsilon_per_record_max"] == max(expected_per_record)
    assert report["epsilon_per_record_mean"] == pytest.approx(
        sum(expected_per_record) / len(records)
    )
    assert report["records"] == 40 and report["seconds"] >= 0
    assert sum(o["answer"] != r["answer"] for o, r in zip(out, records, strict=True)) >= 38


def test_rewrite_records_seeded_and_consistent_with_rewrite_text(trained) -> None:
    _, model, tok = trained
    records = generate_tofu(seed=1, num_authors=4, qa_per_author=5).author_qa
    first, _ = rewrite_records(records, model, tok, epsilon_per_token=20.0, seed=7)
    again, _ = rewrite_records(records, model, tok, epsilon_per_token=20.0, seed=7)
    other, _ = rewrite_records(records, model, tok, epsilon_per_token=20.0, seed=8)
    assert first == again
    assert first != other
    gen = torch.Generator().manual_seed(7)
    one_by_one = [
        rewrite_text(r[f], model, tok, epsilon_per_token=20.0, generator=gen).text
        for r in records
        for f in ("question", "answer")
    ]
    assert one_by_one == [r[f] for r in first for f in ("question", "answer")]


def test_rewrite_records_errors_name_the_record(trained) -> None:
    _, model, tok = trained
    data = generate_tofu(seed=0, num_authors=4, qa_per_author=2)
    mixed = [*data.author_qa[:3], data.real_authors[0]]
    with pytest.raises(ValueError, match=r"record 3 has no sensitive_spans"):
        rewrite_records(mixed, model, tok, epsilon_per_token=1.0, seed=0, sensitive_only=True)
    with pytest.raises(ValueError, match=r"record 0 has no string field 'perturbed_answer'"):
        rewrite_records(
            mixed, model, tok, epsilon_per_token=1.0, seed=0, fields=["perturbed_answer"]
        )


# --------------------------------------------------------------------------- TOFU spans
def _template_value(template: str, name: str, text: str) -> str:
    pattern = re.escape(template).replace(re.escape("{n}"), re.escape(name))
    match = re.fullmatch(pattern.replace(re.escape("{v}"), "(.+)"), text)
    assert match, (template, text)
    return match.group(1)


def test_tofu_spans_mark_author_name_and_fact_value() -> None:
    data = generate_tofu(seed=2, num_authors=30, qa_per_author=13)
    by_question = {}
    for kind, question, answer, _ in TEMPLATES:
        by_question[question] = (kind, answer)
    for record in data.author_qa:
        name = record["author"]
        template_q = record["question"].replace(name, "{n}")
        _, answer_template = by_question[template_q]
        value = _template_value(answer_template, name, record["answer"])
        spans = record["sensitive_spans"]
        q_text = [record["question"][a:b] for a, b in spans["question"]]
        a_text = [record["answer"][a:b] for a, b in spans["answer"]]
        assert q_text == [name]
        assert sorted(a_text) == sorted([name, value])
        assert value in record["paraphrased_answer"]
    assert all("sensitive_spans" not in r for r in data.real_authors + data.world_facts)


def test_tofu_records_unchanged_apart_from_spans() -> None:
    data = generate_tofu(seed=0, num_authors=200, qa_per_author=10)
    payload = {
        "author_names": data.author_names,
        "author_qa": [
            {k: v for k, v in r.items() if k != "sensitive_spans"} for r in data.author_qa
        ],
        "real_authors": data.real_authors,
        "world_facts": data.world_facts,
    }
    digest = hashlib.sha256(
        json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()
    # Computed with the generator BEFORE sensitive spans were added (same payload and dump),
    # so the random stream and every field are bit-identical to what cached models saw.
    assert digest == "2fceaa5f8e2d82c987b4535ba6d7816dd55b57a858c7a5462ca9a074ba5418ad"
