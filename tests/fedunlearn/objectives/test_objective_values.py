"""Every objective's loss on a tiny hand-made case equals an independent by-hand formula.

A fake "language model" returns logits that depend only on the current token
(logits[b, t] = TABLE[input_ids[b, t]]) and hidden states
(hidden_states[l][b, t] = STATES[l, input_ids[b, t]]), so every quantity below is computed
with plain Python arithmetic on explicit positions.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from fedunlearn.objectives import ObjectiveContext, get_objective

V, D, LAYERS, PAD = 6, 4, 4, 5


class FakeLM(torch.nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(2.0 * torch.randn(V, V, generator=g, dtype=torch.float64))
        self.states = torch.nn.Parameter(torch.randn(LAYERS + 1, V, D, generator=g).double())
        self.config = SimpleNamespace(num_hidden_layers=LAYERS, hidden_size=D)

    def forward(self, input_ids, attention_mask, output_hidden_states=False):
        hidden = None
        if output_hidden_states:
            hidden = tuple(self.states[layer][input_ids] for layer in range(LAYERS + 1))
        return SimpleNamespace(logits=self.table[input_ids], hidden_states=hidden)


def _batch(rows):
    """rows: list of (input_ids, labels) -> right-padded batch with PAD / -100."""
    width = max(len(ids) for ids, _ in rows)
    ids = [list(i) + [PAD] * (width - len(i)) for i, _ in rows]
    lab = [list(lb) + [-100] * (width - len(lb)) for _, lb in rows]
    mask = [[1] * len(i) + [0] * (width - len(i)) for i, _ in rows]
    return {
        "input_ids": torch.tensor(ids),
        "labels": torch.tensor(lab),
        "attention_mask": torch.tensor(mask),
    }


FORGET = [([0, 1, 2, 3], [-100, -100, 2, 3]), ([4, 2, 1], [-100, 2, 1])]
REFUSAL = [([0, 1, 4, 4, 0], [-100, -100, 4, 4, 0]), ([4, 2, 3], [-100, 2, 3])]
RETAIN = [([3, 3, 0, 1, 2], [-100, 3, 0, 1, 2]), ([1, 0], [-100, 0])]


def _with_alt(rows, alt_rows):
    batch = _batch(rows)
    batch.update({f"alt_{k}": v for k, v in _batch(alt_rows).items()})
    return batch


# ---- independent by-hand arithmetic -------------------------------------------------------


def _row(model, token):
    return [float(x) for x in model.table.detach()[token]]


def _log_softmax(row):
    m = max(row)
    lse = m + math.log(sum(math.exp(x - m) for x in row))
    return [x - lse for x in row]


def _softmax(row):
    return [math.exp(x) for x in _log_softmax(row)]


def _positions(rows):
    """(sequence index, current token, next-token target) for every labelled target."""
    out = []
    for s, (ids, labels) in enumerate(rows):
        for t in range(len(ids) - 1):
            if labels[t + 1] != -100:
                out.append((s, ids[t], labels[t + 1]))
    return out


def _token_nlls(model, rows):
    """per sequence: list of token NLLs ℓ_t."""
    per = [[] for _ in rows]
    for s, tok, y in _positions(rows):
        per[s].append(-_log_softmax(_row(model, tok))[y])
    return per


def _mean_nll(model, rows):
    return sum(sum(x) / len(x) for x in _token_nlls(model, rows)) / len(rows)


def _seq_logp(model, rows):
    return [-sum(x) for x in _token_nlls(model, rows)]


def _logsig(x):
    return -math.log1p(math.exp(-x))


def _ctx(**kw):
    return ObjectiveContext(**kw)


def _loss(name, model, batch, context):
    return get_objective(name)(model, batch, context).item()


@pytest.fixture()
def model():
    return FakeLM(seed=0)


@pytest.fixture()
def ref():
    return FakeLM(seed=1)


# ---- tests ----------------------------------------------------------------------------------


def test_nll_and_ga_signs(model):
    nll = _mean_nll(model, FORGET)
    assert _loss("nll", model, _batch(FORGET), _ctx()) == pytest.approx(nll, rel=1e-6)
    assert _loss("ga", model, _batch(FORGET), _ctx()) == pytest.approx(-nll, rel=1e-6)


@pytest.mark.parametrize("options,alpha", [({}, 1.0), ({"graddiff_alpha": 0.25}, 0.25)])
def test_graddiff(model, options, alpha):
    ctx = _ctx(retain_batches=iter([_batch(RETAIN)]), options=options)
    expected = -_mean_nll(model, FORGET) + alpha * _mean_nll(model, RETAIN)
    assert _loss("graddiff", model, _batch(FORGET), ctx) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("options,beta", [({}, 0.1), ({"npo_beta": 0.5}, 0.5)])
def test_npo(model, ref, options, beta):
    lp, lp_ref = _seq_logp(model, FORGET), _seq_logp(ref, FORGET)
    expected = (
        -(2 / beta) * sum(_logsig(-beta * (a - b)) for a, b in zip(lp, lp_ref, strict=True)) / 2
    )
    ctx = _ctx(reference_model=ref, options=options)
    assert _loss("npo", model, _batch(FORGET), ctx) == pytest.approx(expected, rel=1e-6)
    # at the reference itself the NPO loss is (2/β)·log 2
    at_ref = _loss("npo", ref, _batch(FORGET), ctx)
    assert at_ref == pytest.approx(2 / beta * math.log(2), rel=1e-6)


@pytest.mark.parametrize("options,beta,delta", [({}, 4.5, 0.0), ({"simnpo_delta": 0.7}, 4.5, 0.7)])
def test_simnpo(model, options, beta, delta):
    per = [sum(x) / len(x) for x in _token_nlls(model, FORGET)]
    expected = -(2 / beta) * sum(_logsig(beta * (lbar - delta)) for lbar in per) / len(per)
    got = _loss("simnpo", model, _batch(FORGET), _ctx(options=options))
    assert got == pytest.approx(expected, rel=1e-6)


def test_simnpo_falls_as_nll_rises(model):
    """Minimising SimNPO raises ℓ̄: the loss is decreasing in the forget NLL."""
    batch = _batch(FORGET)
    sharp = FakeLM(seed=0)
    with torch.no_grad():
        sharp.table.mul_(0.0)  # uniform predictions: higher NLL than a confident correct model
        for _, tok, y in _positions(FORGET):
            model.table[tok, y] = 8.0  # model is confident and right
    assert _mean_nll(sharp, FORGET) > _mean_nll(model, FORGET)
    assert _loss("simnpo", sharp, batch, _ctx()) < _loss("simnpo", model, batch, _ctx())


@pytest.mark.parametrize("options,beta", [({}, 0.1), ({"dpo_beta": 1.0}, 1.0)])
def test_dpo(model, ref, options, beta):
    win = [a - b for a, b in zip(_seq_logp(model, REFUSAL), _seq_logp(ref, REFUSAL), strict=True)]
    lose = [a - b for a, b in zip(_seq_logp(model, FORGET), _seq_logp(ref, FORGET), strict=True)]
    expected = (
        -(2 / beta) * sum(_logsig(beta * (w - lo)) for w, lo in zip(win, lose, strict=True)) / 2
    )
    ctx = _ctx(reference_model=ref, options=options)
    batch = _with_alt(FORGET, REFUSAL)
    assert _loss("dpo", model, batch, ctx) == pytest.approx(expected, rel=1e-6)
    assert _loss("dpo", ref, batch, ctx) == pytest.approx(2 / beta * math.log(2), rel=1e-6)


def test_idk_is_nll_of_refusals(model):
    expected = _mean_nll(model, REFUSAL)
    got = _loss("idk", model, _with_alt(FORGET, REFUSAL), _ctx())
    assert got == pytest.approx(expected, rel=1e-6)


def test_alternate_rows_missing_is_clear(model, ref):
    for name in ("idk", "dpo"):
        with pytest.raises(ValueError, match=f"{name}.*alternate.*alt_input_ids"):
            get_objective(name)(model, _batch(FORGET), _ctx(reference_model=ref))


@pytest.mark.parametrize("options,beta", [({}, 10.0), ({"undial_beta": 2.0}, 2.0)])
def test_undial(model, ref, options, beta):
    total, count = 0.0, 0
    for _, tok, y in _positions(FORGET):
        adjusted = [z - (beta if v == y else 0.0) for v, z in enumerate(_row(ref, tok))]
        q = _softmax(adjusted)
        logp = _log_softmax(_row(model, tok))
        total += -sum(qv * lv for qv, lv in zip(q, logp, strict=True))
        count += 1
    ctx = _ctx(reference_model=ref, options=options)
    assert _loss("undial", model, _batch(FORGET), ctx) == pytest.approx(total / count, rel=1e-6)


@pytest.mark.parametrize(
    "options,b1,b2", [({}, 5.0, 1.0), ({"satimp_beta1": 1.0, "satimp_beta2": 2.0}, 1.0, 2.0)]
)
def test_satimp(model, options, b1, b2):
    with torch.no_grad():  # make some tokens likely so the weights are not all tiny
        for _, tok, y in _positions(FORGET)[:2]:
            model.table[tok, y] += 3.0
    total, count = 0.0, 0
    for per in _token_nlls(model, FORGET):
        for nll in per:
            p = math.exp(-nll)
            total += p**b1 * (1 - p) ** b2 * nll
            count += 1
    got = get_objective("satimp")(model, _batch(FORGET), _ctx(options=options))
    assert got.item() == pytest.approx(-total / count, rel=1e-6)
    # the weights are constants: the gradient is that of −Σ w·ℓ / N with w frozen
    got.backward()
    grad = model.table.grad.clone()
    model.table.grad = None
    weights, nlls = [], []
    for _, tok, y in _positions(FORGET):
        nll = -torch.log_softmax(model.table[tok], dim=-1)[y]
        p = math.exp(-nll.item())
        weights.append(p**b1 * (1 - p) ** b2)
        nlls.append(nll)
    (-sum(w * n for w, n in zip(weights, nlls, strict=True)) / len(nlls)).backward()
    assert torch.allclose(grad, model.table.grad)


@pytest.mark.parametrize("options,alpha", [({}, 1.0), ({"kl_alpha": 3.0}, 3.0)])
def test_kl(model, ref, options, alpha):
    kl_total, count = 0.0, 0
    for _, tok, _y in _positions(RETAIN):
        p_ref, lp_ref = _softmax(_row(ref, tok)), _log_softmax(_row(ref, tok))
        lp = _log_softmax(_row(model, tok))
        kl_total += sum(pr * (a - b) for pr, a, b in zip(p_ref, lp_ref, lp, strict=True))
        count += 1
    expected = -_mean_nll(model, FORGET) + alpha * kl_total / count
    ctx = _ctx(reference_model=ref, retain_batches=iter([_batch(RETAIN)]), options=options)
    assert _loss("kl", model, _batch(FORGET), ctx) == pytest.approx(expected, rel=1e-6)
    # at the reference the KL term vanishes: KL = GA
    ctx = _ctx(reference_model=ref, retain_batches=iter([_batch(RETAIN)]), options=options)
    assert _loss("kl", ref, _batch(FORGET), ctx) == pytest.approx(-_mean_nll(ref, FORGET))


def _unit_u(seed):
    g = torch.Generator().manual_seed(seed)
    u = [float(x) for x in torch.rand(D, generator=g, dtype=torch.float32)]
    norm = math.sqrt(sum(x * x for x in u))
    return [x / norm for x in u]


@pytest.mark.parametrize(
    "options,layer,c,alpha,seed",
    [
        ({}, LAYERS // 2, 6.5, 100.0, 0),
        ({"rmu_layer": 0, "rmu_steering": 2.0, "rmu_alpha": 0.5, "rmu_seed": 3}, 0, 2.0, 0.5, 3),
    ],
)
def test_rmu(model, ref, options, layer, c, alpha, seed):
    u = _unit_u(seed)
    assert all(x >= 0 for x in u) and sum(x * x for x in u) == pytest.approx(1.0)

    def h(m, tok):  # output of decoder layer `layer` = hidden_states[layer + 1]
        return [float(x) for x in m.states.detach()[layer + 1, tok]]

    forget = [
        sum((a - c * b) ** 2 for a, b in zip(h(model, tok), u, strict=True)) / D
        for ids, _ in FORGET
        for tok in ids
    ]  # every non-padding token
    retain = [
        sum((a - b) ** 2 for a, b in zip(h(model, tok), h(ref, tok), strict=True)) / D
        for ids, _ in RETAIN
        for tok in ids
    ]
    expected = sum(forget) / len(forget) + alpha * sum(retain) / len(retain)
    ctx = _ctx(reference_model=ref, retain_batches=iter([_batch(RETAIN)]), options=options)
    assert _loss("rmu", model, _batch(FORGET), ctx) == pytest.approx(expected, rel=1e-6)


def test_rmu_bad_layer_is_clear(model, ref):
    ctx = _ctx(reference_model=ref, retain_batches=iter([_batch(RETAIN)]), options={"rmu_layer": 9})
    with pytest.raises(ValueError, match="rmu_layer=9"):
        get_objective("rmu")(model, _batch(FORGET), ctx)
