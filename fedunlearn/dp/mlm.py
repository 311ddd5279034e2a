"""DP-MLM text rewriting (docs/algorithms.md, "DP2Unlearning"; DP2Unlearning, Al Mahmud et al.
2025, after DP-MLM, Meisenbacher et al. 2024).

Each token chosen for rewriting is masked and a masked LM proposes replacements; one is drawn
with the exponential mechanism whose utility is the MLM logit, clipped to [c_min, c_max]
(paper: c_min = −5.2093, c_max = 20.3048). The clipped utility has sensitivity
Δu = c_max − c_min, so drawing w′ with probability ∝ exp(ε · u(w′) / (2Δu)) is ε-DP per token.
A document's ε composes over its replaced tokens by basic (sequential) composition:
ε_doc = n_replaced · ε_token (the paper: "the total protection adheres to the sequential
composition theorem").

Design:

* **Tokenizer: word level.** A :class:`tokenizers.models.WordLevel` vocabulary (whitespace and
  punctuation pre-tokenisation) trained on the public background corpus, so a replacement is
  always a whole word — never a sub-word piece glued into a new non-word. Words outside the
  vocabulary (e.g. every benchmark author's name: background names use disjoint letters) read
  as ``[UNK]`` *context*; the text itself is edited by character offsets, so untouched words
  are kept verbatim and ``[UNK]`` never reaches the output.
* **Masking: one token at a time, against the original context** (as in DP-MLM): the copy of
  the text for target token *i* has only position *i* masked and every other token original.
  All copies of all texts are independent, so they are batched into few forward passes; the
  draws are independent given the original document, which is what sequential composition
  assumes. Special tokens (``[UNK]``, ``[MASK]``, ...) are never candidates.
* **The MLM** is a tiny BERT trained here (no model hub is reachable) with standard 15 %
  masking (80 % ``[MASK]``, 10 % random, 10 % kept) on the corpus split into sentences —
  the rewritten fields are short QA sentences, and short sequences train far faster.
  ``tokenizer.model_max_length`` is the longest context it saw; longer texts are rewritten
  with a window of that many tokens around each target.
"""

from __future__ import annotations

import copy
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
from tqdm.auto import tqdm
from transformers import (
    AutoModelForMaskedLM,
    AutoTokenizer,
    BertConfig,
    BertForMaskedLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

C_MIN = -5.2093
C_MAX = 20.3048
RESERVED_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
_LOGIT_BUDGET = 1 << 23  # max batch x length x vocab logits held at once while rewriting
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_WORD_CHAR = re.compile(r"\w")


# --------------------------------------------------------------------------- mechanism
def exponential_mechanism_probs(
    logits: torch.Tensor,
    epsilon: float,
    *,
    c_min: float = C_MIN,
    c_max: float = C_MAX,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exponential-mechanism distribution over the last dimension of ``logits``.

    The utility u = clip(logits, c_min, c_max) has sensitivity Δu = c_max − c_min; the result
    is softmax(u · ε / (2Δu)) (float64), ε being the budget of ONE replaced token. ε = 0 gives
    the uniform distribution, ε = ∞ the argmax (ties share). ``allowed`` (bool, broadcastable
    to ``logits``) removes candidates: they get probability 0 and the rest are renormalised.
    """
    if not c_max > c_min:
        raise ValueError(f"need c_max > c_min, got c_min={c_min}, c_max={c_max}")
    if math.isnan(epsilon) or epsilon < 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
    utility = logits.detach().to(torch.float64).clamp(c_min, c_max)
    if math.isinf(epsilon):
        best = utility if allowed is None else utility.masked_fill(~allowed, -math.inf)
        scores = torch.where(best == best.amax(dim=-1, keepdim=True), 0.0, -math.inf)
    else:
        scores = utility * (epsilon / (2.0 * (c_max - c_min)))
    if allowed is not None:
        if not bool(allowed.any(dim=-1).all()):
            raise ValueError("every row needs at least one allowed candidate")
        scores = scores.masked_fill(~allowed, -math.inf)
    return torch.softmax(scores, dim=-1)


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index k with P(k) = probs[..., k] for each row, from one U(0, 1) draw per row."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    target = (uniforms.to(torch.float64) * cdf[..., -1]).unsqueeze(-1)
    index = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return index.clamp_(max=probs.shape[-1] - 1)


def sample_exponential_mechanism(
    logits: torch.Tensor,
    epsilon: float,
    *,
    generator: torch.Generator,
    c_min: float = C_MIN,
    c_max: float = C_MAX,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """One draw per row of ``logits`` from :func:`exponential_mechanism_probs` (the sampler
    :func:`rewrite_text` uses: inverse CDF of one uniform per row, taken from ``generator``)."""
    probs = exponential_mechanism_probs(logits, epsilon, c_min=c_min, c_max=c_max, allowed=allowed)
    uniforms = torch.rand(probs.shape[:-1], generator=generator, dtype=torch.float64)
    return _inverse_cdf(probs, uniforms)


# --------------------------------------------------------------------------- the masked LM
def split_sentences(texts: Sequence[str]) -> list[str]:
    """Split texts at sentence ends (``.``, ``!``, ``?`` followed by whitespace)."""
    return [s for text in texts for s in _SENTENCE_END.split(text.strip()) if s]


def train_word_tokenizer(
    texts: Sequence[str], *, vocab_size: int = 8192, min_frequency: int = 2, max_length: int = 32
) -> PreTrainedTokenizerFast:
    """A word-level tokenizer (``[PAD] [UNK] [CLS] [SEP] [MASK]`` specials, ``[CLS] … [SEP]``
    template) over the words of ``texts`` seen at least ``min_frequency`` times."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(RESERVED_TOKENS),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[(t, tok.token_to_id(t)) for t in ("[CLS]", "[SEP]")],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=max_length,
    )


def _mask_batch(
    ids: torch.Tensor, tokenizer: PreTrainedTokenizerBase, prob: float, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking: pick ``prob`` of the non-special tokens; 80 % → [MASK], 10 % → a random
    word, 10 % unchanged. Returns the corrupted ids and the bool mask of picked positions."""
    special = torch.zeros_like(ids, dtype=torch.bool)
    for sid in tokenizer.all_special_ids:
        special |= ids == sid
    picked = (torch.rand(ids.shape, generator=gen) < prob) & ~special
    roll = torch.rand(ids.shape, generator=gen)
    random_ids = torch.randint(len(RESERVED_TOKENS), len(tokenizer), ids.shape, generator=gen)
    corrupted = ids.clone()
    corrupted[picked & (roll < 0.8)] = tokenizer.mask_token_id
    swap = picked & (roll >= 0.8) & (roll < 0.9)
    corrupted[swap] = random_ids[swap]
    return corrupted, picked


def train_masked_lm(
    texts: Sequence[str],
    *,
    seed: int,
    vocab_size: int = 8192,
    min_frequency: int = 2,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    intermediate_size: int = 256,
    dropout: float = 0.0,
    max_length: int = 32,
    steps: int = 800,
    batch_size: int = 64,
    lr: float = 3e-3,
    mask_probability: float = 0.15,
    show_progress: bool = False,
) -> tuple[BertForMaskedLM, PreTrainedTokenizerFast]:
    """Train a word-level tokenizer and a tiny BERT masked LM on a PUBLIC corpus ``texts``.

    Texts are split into sentences (cut to ``max_length`` tokens with [CLS]/[SEP]), grouped
    into length-sorted batches, and ``steps`` AdamW steps are taken over shuffled batches
    (linear warm-up over 10 %, linear decay, gradient clipping at 1) with standard 15 % masking.
    The loss is computed on the masked positions only. Deterministic given ``seed``; the
    caller's global torch RNG is left untouched. Returns the model in eval mode.

    Defaults (2 layers, hidden 128, 2 heads, ~1.1 M parameters with the ~6.4 k-word vocabulary
    of the default 3000-document background corpus), measured with one thread on 2 CPU cores
    shared with other jobs: 35-56 s, held-out masked-token accuracy ~0.81 (NLL ~1.0 nat,
    ``[UNK]`` targets aside). ``steps=1000``-``1200`` reach ~0.85 (NLL 0.6-0.7) at +25-50 %
    time; it matters only at large ε, since at ε ≲ 10 per token the draw is close to uniform.
    """
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps and batch_size must be >= 1, got {steps}, {batch_size}")
    sentences = split_sentences(texts)
    if not sentences:
        raise ValueError("no training text")
    tokenizer = train_word_tokenizer(
        sentences, vocab_size=vocab_size, min_frequency=min_frequency, max_length=max_length
    )
    encoded = list(tokenizer(sentences, truncation=True, max_length=max_length)["input_ids"])
    order = sorted(range(len(encoded)), key=lambda i: (len(encoded[i]), i))
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max(64, 2 * max_length),
        type_vocab_size=1,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        pad_token_id=tokenizer.pad_token_id,
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # weight init and dropout
        model = BertForMaskedLM(config)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        warmup = max(1, steps // 10)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda s: min((s + 1) / warmup, max(0.0, (steps - s) / max(1, steps - warmup))),
        )
        queue: list[int] = []
        bar = tqdm(range(steps), desc="DP-MLM masked LM", disable=not show_progress)
        for _ in bar:
            if not queue:
                queue = torch.randperm(len(batches), generator=gen).tolist()
            batch = [encoded[i] for i in batches[queue.pop()]]
            width = max(len(e) for e in batch)
            ids = torch.full((len(batch), width), tokenizer.pad_token_id, dtype=torch.long)
            for row, e in enumerate(batch):
                ids[row, : len(e)] = torch.tensor(e)
            corrupted, picked = _mask_batch(ids, tokenizer, mask_probability, gen)
            if not picked.any():
                continue
            hidden = model.bert(
                input_ids=corrupted, attention_mask=(ids != tokenizer.pad_token_id).long()
            ).last_hidden_state
            loss = F.cross_entropy(model.cls(hidden[picked]), ids[picked])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    model.eval()
    return model, tokenizer


def save_masked_lm(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | Path
) -> None:
    """Write model and tokenizer to one folder with ``save_pretrained``."""
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def load_masked_lm(path: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a masked LM and its tokenizer from a LOCAL folder (never the hub), in eval mode."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"no masked-LM folder at {folder}")
    model = AutoModelForMaskedLM.from_pretrained(folder, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if tokenizer.mask_token_id is None:
        raise ValueError(f"the tokenizer in {folder} has no mask token")
    model.eval()
    return model, tokenizer


# --------------------------------------------------------------------------- rewriting
@dataclass
class RewriteResult:
    """One rewritten text.

    ``epsilon`` = ``replaced_tokens`` · ε_token (basic sequential composition). A token is
    "replaced" when it went through the mechanism (the draw may return the same word;
    ``changed_tokens`` counts real changes). ``positions`` are the character spans of the
    replaced tokens in the ORIGINAL text, ``new_positions`` those of their replacements.
    """

    text: str
    replaced_tokens: int
    epsilon: float
    changed_tokens: int = 0
    positions: list[tuple[int, int]] = field(default_factory=list)
    new_positions: list[tuple[int, int]] = field(default_factory=list)
    _start_map: list[int] = field(default_factory=list, repr=False)
    _end_map: list[int] = field(default_factory=list, repr=False)

    def map_span(self, start: int, end: int) -> tuple[int, int]:
        """The span of the new text that ``[start, end)`` of the original became (a span
        touching a replaced token grows to cover its whole replacement)."""
        if end <= start:
            return (self._start_map[start], self._start_map[start])
        return (self._start_map[start], self._end_map[end - 1])


@dataclass
class _Plan:
    text: str
    ids: list[int]
    offsets: list[tuple[int, int]]
    targets: list[int]
    uniforms: torch.Tensor


def _context_length(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> int:
    limit = int(getattr(model.config, "max_position_embeddings", 512))
    if 0 < tokenizer.model_max_length < 100_000:
        limit = min(limit, int(tokenizer.model_max_length))
    return max(1, limit - 2)  # room for [CLS] and [SEP]


def _window(
    plan: _Plan, target: int, width: int, tokenizer: PreTrainedTokenizerBase
) -> tuple[list[int], int]:
    """Input ids of a ``width``-token window around ``target`` (masked) and the mask index."""
    start = min(max(0, target - width // 2), max(0, len(plan.ids) - width))
    ids = list(plan.ids[start : start + width])
    pos = target - start
    ids[pos] = tokenizer.mask_token_id
    head = [tokenizer.cls_token_id] if tokenizer.cls_token_id is not None else []
    tail = [tokenizer.sep_token_id] if tokenizer.sep_token_id is not None else []
    return head + ids + tail, pos + len(head)


@torch.no_grad()
def _sample_masked(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    queries: list[tuple[list[int], int]],
    uniforms: torch.Tensor,
    epsilon: float,
    c_min: float,
    c_max: float,
) -> list[int]:
    """For every (input ids, mask position) query: the MLM logits at the masked position, then
    one exponential-mechanism draw (inverse CDF of the query's uniform). Queries are batched in
    chunks of at most ``_LOGIT_BUDGET`` logits; special tokens are never candidates."""
    vocab = int(model.config.vocab_size)
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[: min(len(tokenizer), vocab)] = True
    allowed[[i for i in tokenizer.all_special_ids if i < vocab]] = False
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    exponential_mechanism_probs(torch.zeros(vocab), epsilon, c_min=c_min, c_max=c_max)  # checks
    chosen: list[int] = []
    i = 0
    while i < len(queries):
        j, width = i, 0
        while j < len(queries):
            w = max(width, len(queries[j][0]))
            if j > i and (j - i + 1) * w * vocab > _LOGIT_BUDGET:
                break
            width, j = w, j + 1
        chunk = queries[i:j]
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for row, (q, _) in enumerate(chunk):
            ids[row, : len(q)] = torch.tensor(q)
            attention[row, : len(q)] = 1
        logits = model(input_ids=ids, attention_mask=attention).logits
        logits = logits[torch.arange(len(chunk)), [p for _, p in chunk]].float()
        probs = exponential_mechanism_probs(
            logits, epsilon, c_min=c_min, c_max=c_max, allowed=allowed
        )
        chosen.extend(_inverse_cdf(probs, uniforms[i:j]).tolist())
        i = j
    return chosen


def _splice(text: str, plan: _Plan, words: list[str], epsilon_per_token: float) -> RewriteResult:
    """Replace the target tokens' characters by ``words`` and record the position maps."""
    replace = {plan.offsets[t]: w for t, w in zip(plan.targets, words, strict=True)}
    edits = sorted(replace.items())
    pieces: list[str] = []
    length = 0
    start_map = [0] * (len(text) + 1)
    end_map = [0] * (len(text) + 1)
    new_positions: list[tuple[int, int]] = []
    previous_replaced = False
    cursor = 0
    for (a, b), word in [*edits, ((len(text), len(text)), None)]:
        if a > cursor:  # untouched characters
            kept = text[cursor:a]
            if previous_replaced and pieces and _glued(pieces[-1], kept):
                pieces.append(" ")
                length += 1
            for k in range(cursor, a):
                start_map[k] = length + k - cursor
                end_map[k] = start_map[k] + 1
            pieces.append(kept)
            length += len(kept)
            previous_replaced = False
        if word is None:
            break
        if pieces and _glued(pieces[-1], word):
            pieces.append(" ")
            length += 1
        for k in range(a, b):
            start_map[k], end_map[k] = length, length + len(word)
        new_positions.append((length, length + len(word)))
        pieces.append(word)
        length += len(word)
        cursor, previous_replaced = b, True
    start_map[len(text)] = length
    changed = sum(text[a:b] != w for (a, b), w in edits)
    return RewriteResult(
        text="".join(pieces),
        replaced_tokens=len(edits),
        epsilon=len(edits) * epsilon_per_token,
        changed_tokens=changed,
        positions=[span for span, _ in edits],
        new_positions=new_positions,
        _start_map=start_map,
        _end_map=end_map,
    )


def _glued(before: str, after: str) -> bool:
    """Whether joining would fuse two words (both boundary characters are word characters)."""
    return bool(before and after and _WORD_CHAR.match(before[-1]) and _WORD_CHAR.match(after[0]))


def _plan(
    text: str,
    tokenizer: PreTrainedTokenizerBase,
    spans: Sequence[Sequence[int]] | None,
    generator: torch.Generator,
) -> _Plan:
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    offsets = [(int(a), int(b)) for a, b in enc["offset_mapping"]]
    targets = []
    for t, (a, b) in enumerate(offsets):
        if b <= a:
            continue
        if spans is None or any(a < int(e) and b > int(s) for s, e in spans):
            targets.append(t)
    uniforms = torch.rand(len(targets), generator=generator, dtype=torch.float64)
    return _Plan(text, list(enc["input_ids"]), offsets, targets, uniforms)


def _rewrite_many(
    texts: Sequence[str],
    spans: Sequence[Sequence[Sequence[int]] | None],
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    epsilon_per_token: float,
    generator: torch.Generator,
    c_min: float,
    c_max: float,
) -> list[RewriteResult]:
    """Rewrite several texts with one batched MLM pass. Uniforms are drawn text by text, so
    the result equals calling :func:`rewrite_text` on each text in turn with ``generator``."""
    if tokenizer.mask_token_id is None:
        raise ValueError("the tokenizer has no mask token")
    for text_spans in spans:
        for span in text_spans or ():
            if len(span) != 2 or not 0 <= int(span[0]) <= int(span[1]):
                raise ValueError(f"bad character span {span!r}: need [start, end], start <= end")
    plans = [_plan(t, tokenizer, s, generator) for t, s in zip(texts, spans, strict=True)]
    width = _context_length(model, tokenizer)
    queries = [_window(p, t, width, tokenizer) for p in plans for t in p.targets]
    uniforms = torch.cat([p.uniforms for p in plans]) if plans else torch.zeros(0)
    was_training = model.training
    model.eval()
    try:
        chosen = _sample_masked(
            model, tokenizer, queries, uniforms, epsilon_per_token, c_min, c_max
        )
    finally:
        model.train(was_training)
    cache: dict[int, str] = {}
    results, k = [], 0
    for plan in plans:
        words = []
        for tid in chosen[k : k + len(plan.targets)]:
            if tid not in cache:
                word = tokenizer.decode([tid], clean_up_tokenization_spaces=False)
                cache[tid] = cast(str, word).strip()  # one sequence decodes to a str
            words.append(cache[tid])
        k += len(plan.targets)
        results.append(_splice(plan.text, plan, words, epsilon_per_token))
    return results


def rewrite_text(
    text: str,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    *,
    epsilon_per_token: float,
    generator: torch.Generator,
    spans: Sequence[tuple[int, int]] | None = None,
    c_min: float = C_MIN,
    c_max: float = C_MAX,
) -> RewriteResult:
    """DP-MLM rewrite of ``text``: every token (``spans`` None) or every token overlapping one
    of the character ``spans`` is masked (one at a time, original context) and replaced by a
    draw from :func:`exponential_mechanism_probs` of the MLM logits (ε = ``epsilon_per_token``,
    clip [c_min, c_max], Δu = c_max − c_min). Text outside the replaced tokens is kept
    verbatim (a space is inserted where a replacement would fuse two words). The result's
    ε = replaced tokens · ε_token (basic composition).
    """
    return _rewrite_many(
        [text], [spans], model, tokenizer, epsilon_per_token, generator, c_min, c_max
    )[0]


def rewrite_records(
    records: Sequence[dict[str, Any]],
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    *,
    epsilon_per_token: float,
    seed: int,
    fields: Sequence[str] = ("question", "answer"),
    sensitive_only: bool = False,
    c_min: float = C_MIN,
    c_max: float = C_MAX,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """DP-MLM rewrite of the ``fields`` of TOFU-style QA records (copies; inputs untouched).

    With ``sensitive_only`` only the spans in ``record["sensitive_spans"][field]`` are
    rewritten, and those spans are moved onto the new text. A record is the privacy unit: its
    ε = Σ over its fields of replaced tokens · ε_token (basic composition). Draws come from one
    generator seeded with ``seed``, record by record and field by field. The report holds
    ``tokens_replaced``, ``tokens_changed``, ``epsilon_per_record_max``/``_mean``, ``seconds``.
    """
    started = time.perf_counter()
    texts: list[str] = []
    spans: list[Sequence[Sequence[int]] | None] = []
    for index, record in enumerate(records):
        for name in fields:
            if not isinstance(record.get(name), str):
                raise ValueError(f"record {index} has no string field {name!r}")
            texts.append(record[name])
            if not sensitive_only:
                spans.append(None)
                continue
            marked = record.get("sensitive_spans")
            if not isinstance(marked, dict) or name not in marked:
                raise ValueError(
                    f"record {index} has no sensitive_spans for field {name!r} "
                    "(needed with sensitive_only=True)"
                )
            spans.append(marked[name])
    generator = torch.Generator().manual_seed(seed)
    results = _rewrite_many(
        texts, spans, model, tokenizer, epsilon_per_token, generator, c_min, c_max
    )
    out: list[dict[str, Any]] = []
    per_record: list[float] = []
    for index, record in enumerate(records):
        new = copy.deepcopy(record)
        mine = results[index * len(fields) : (index + 1) * len(fields)]
        for name, result in zip(fields, mine, strict=True):
            new[name] = result.text
            if isinstance(new.get("sensitive_spans"), dict) and name in new["sensitive_spans"]:
                new["sensitive_spans"][name] = [
                    list(result.map_span(int(a), int(b))) for a, b in new["sensitive_spans"][name]
                ]
        per_record.append(sum(r.epsilon for r in mine))
        out.append(new)
    report = {
        "records": len(records),
        "fields": list(fields),
        "sensitive_only": sensitive_only,
        "epsilon_per_token": epsilon_per_token,
        "composition": "basic: epsilon_record = sum over replaced tokens of epsilon_per_token",
        "c_min": c_min,
        "c_max": c_max,
        "tokens_replaced": sum(r.replaced_tokens for r in results),
        "tokens_changed": sum(r.changed_tokens for r in results),
        "epsilon_per_record_max": max(per_record, default=0.0),
        "epsilon_per_record_mean": sum(per_record) / len(per_record) if per_record else 0.0,
        "seconds": time.perf_counter() - started,
    }
    return out, report
