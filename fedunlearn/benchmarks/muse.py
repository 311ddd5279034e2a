"""Synthetic MUSE-style benchmark: narrative passages from invented books (docs/scenarios.md,
"The three scenarios").

Every book has its own invented characters (two or three travellers who recur through the
book, plus one side character per passage). Each passage is one short paragraph (about
60-80 words, six sentences) that states concrete facts drawn from fixed pools: who travelled
where and in which year, what they carried and its colour, which animal followed them, whom
they met there, that person's trade and what they gave. Questions (:data:`QA_TEMPLATES`)
ask for one such fact with a short answer that occurs verbatim in the passage.

Splits (books are generated in order; ``F = num_forget_books``, ``H = num_holdout_books``):

* forget: the first ``F`` books (default 4 of 20);
* retain: the books in between (default 12);
* holdout: the last ``H`` books (default 4): same distribution, never trained on; they are
  the non-members of the membership-inference (PrivLeak) test.

With the defaults (20 books x 8 passages x 2 QA) that is 32 forget passages / 64 forget QA,
96 retain passages / 192 retain QA and 32 holdout passages: forget : retain is 1 : 3, close to
MUSE-News (889 forget vs 1777 + 1778 retain articles), and forget vs holdout gives 32 vs 32
texts for the AUC, small enough for a tiny model to learn in minutes on a CPU.

Verbatim-memorisation probes are built from every forget passage: the prompt is its first
:data:`VERBMEM_PREFIX_WORDS` words, the ground truth the remaining words, joined by single
spaces (passages are single-spaced, so ``prompt + " " + gt == text``).

Everything is a pure function of the seed: only ``random.Random`` instances are used.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fedunlearn.benchmarks import register_benchmark
from fedunlearn.benchmarks.tofu import CITIES, OCCUPATIONS, TITLE_ADJECTIVES, TITLE_NOUNS
from fedunlearn.qa_format import format_answer, format_prompt

#: Words of a forget passage that form the prompt of its verbatim-memorisation probe.
VERBMEM_PREFIX_WORDS = 16

COLOURS = (
    "red blue green yellow black white grey silver golden copper crimson violet purple "
    "scarlet brown pink"
).split()
OBJECTS = (
    "lantern, compass, brass key, leather satchel, wooden flute, map, pocket watch, "
    "iron kettle, spyglass, walking stick, sealed letter, music box, woollen cloak, "
    "hunting knife, prayer book, clay jug, silk scarf, tin drum, glass bottle, fishing net"
).split(", ")
ANIMALS = (
    "fox, black dog, grey cat, raven, goat, mule, hare, barn owl, heron, pony, badger, crow, "
    "stray hound, white goose, young stag, magpie"
).split(", ")
GIFTS = (
    "a loaf of rye bread, a silver coin, a bundle of letters, a jar of honey, a wooden carving, "
    "a small painting, a pair of boots, a bag of apples, a copper ring, a rolled map, "
    "a bottle of cider, a knitted hat, a lucky stone, a sketch of the harbour, a sack of salt, "
    "a box of candles, a feather pen, a wheel of cheese, a brass bell, a bunch of herbs"
).split(", ")
DANGERS = (
    "the flooded bridge, the wolves in the hills, the smugglers on the coast, "
    "the broken dam, the fever in the valley, the thieves at the market, "
    "the storms at sea, the rockfalls on the pass, the soldiers at the border, "
    "the quicksand by the river, the false guides, the frozen lake, "
    "the bandits in the forest, the landslides after rain, the empty wells, the marsh lights"
).split(", ")
ROADS = (
    "coast road, old drovers' track, river path, mountain pass, canal towpath, forest trail, "
    "high moor road, salt road, pilgrim way, cliff path"
).split(", ")
SEASONS = (
    "first snow, end of winter, spring thaw, harvest, long summer, autumn rains, midwinter "
    "fair, cherry blossom"
).split(", ")
TRAITS = (
    "spoke very little, laughed at everything, knew every star by name, "
    "kept a diary in code, never slept indoors, sang old ballads, collected stones, "
    "distrusted strangers, wrote long letters home, limped from an old wound, "
    "told wild stories, owed money to everyone"
).split(", ")

#: (kind, question, short answer); ``{hero}`` is the traveller's full name.
QA_TEMPLATES: list[tuple[str, str, str]] = [
    ("year", "In which year did {hero} travel to {place}?", "{year}"),
    ("place", "Where did {hero} travel in the year {year}?", "{place}"),
    ("object", "What did {hero} carry on the journey to {place}?", "a {colour} {object}"),
    ("colour", "What colour was the {object} that {hero} carried to {place}?", "{colour}"),
    ("animal", "Which animal followed {hero} on the way to {place}?", "a {animal}"),
    ("companion", "Whom did {hero} meet in {place}?", "{companion}"),
    ("occupation", "What was the trade of {companion}?", "{occupation}"),
    ("gift", "What did {companion} give to {hero}?", "{gift}"),
]

# Sentence variants; every variant keeps the exact answer strings of QA_TEMPLATES.
_SENTENCES: list[tuple[str, ...]] = [
    (
        "In the year {year}, {hero} left {home} and travelled to {place}.",
        "In the year {year}, {hero} set out from {home} for the town of {place}.",
    ),
    (
        "{first} carried a {colour} {object} wrapped in a blanket.",
        "On the journey {first} carried a {colour} {object} and nothing else.",
    ),
    (
        "On the {road}, a {animal} followed {first}.",
        "All along the {road}, a {animal} followed {first}.",
    ),
    (
        "In {place}, {first} met {companion}, who worked as {occupation}.",
        "At the inn of {place}, {first} met {companion}, {occupation} who {trait}.",
    ),
    (
        "{companion_first} gave {first} {gift} and warned of {danger}.",
        "Before they parted, {companion_first} gave {first} {gift}.",
    ),
    (
        "{first} stayed until the {season} and then went home.",
        "When the {season} came, {first} returned to {home}.",
    ),
]

# Name syllables: benchmark and background names use DISJOINT onset letters, so no background
# name can equal (or share a word with) a benchmark name, whatever the seeds.
_VOWELS = ["a", "e", "i", "o", "u", "a", "e", "o", "ai", "ou"]
_CODAS = ["", "", "", "n", "r", "l", "s"]
_BENCH_ONSETS = ["b", "d", "k", "l", "m", "n", "r", "t", "v", "br", "dr", "kl"]
_BACKGROUND_ONSETS = ["f", "g", "h", "j", "p", "s", "w", "z", "ch", "sh", "gl", "pr"]


def _make_name(rng: random.Random, onsets: Sequence[str], syllables: int) -> str:
    word = "".join(
        rng.choice(onsets) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)
    )
    return word.capitalize()


def _pool_words() -> frozenset[str]:
    pools = [CITIES, OCCUPATIONS, COLOURS, OBJECTS, ANIMALS, GIFTS, DANGERS, ROADS, SEASONS]
    words = {w for pool in [*pools, TRAITS] for item in pool for w in item.split()}
    words.update(w for variants in _SENTENCES for s in variants for w in s.split())
    words.update(w for _, q, a in QA_TEMPLATES for w in f"{q} {a}".split())
    return frozenset(w.strip(".,?'{}").capitalize() for w in words)


#: Capitalised words of every pool and template; never used as a name.
_RESERVED_WORDS = _pool_words()


def _unique_name(rng: random.Random, onsets: Sequence[str], seen: set[str]) -> str:
    """A ``First Last`` name whose words are in no earlier name of ``seen`` (which it joins).

    Words of the pools and templates (:data:`_RESERVED_WORDS`) are never used as names.
    """
    for _ in range(10_000):
        first = _make_name(rng, onsets, 2)
        last = _make_name(rng, onsets, rng.choice((2, 2, 3)))
        words = (first, last)
        if first != last and not any(w in seen or w in _RESERVED_WORDS for w in words):
            seen.update(words)
            return f"{first} {last}"
    raise ValueError("ran out of unique character names; generate fewer books or passages")


def _unique_title(rng: random.Random, seen: set[str], background: bool) -> str:
    for _ in range(10_000):
        adj, noun = rng.choice(TITLE_ADJECTIVES), rng.choice(TITLE_NOUNS)
        # Benchmark titles always start with "The", background titles never do.
        title = f"A {adj} {noun}" if background else f"The {adj} {noun}"
        if title not in seen:
            seen.add(title)
            return title
    raise ValueError("ran out of unique book titles; generate fewer books")


def _passage_facts(
    rng: random.Random,
    hero: str,
    home: str,
    place: str,
    year: int,
    companion: str,
) -> dict[str, str]:
    occupation = rng.choice(OCCUPATIONS)
    return {
        "hero": hero,
        "first": hero.split()[0],
        "home": home,
        "place": place,
        "year": str(year),
        "colour": rng.choice(COLOURS),
        "object": rng.choice(OBJECTS),
        "animal": rng.choice(ANIMALS),
        "road": rng.choice(ROADS),
        "companion": companion,
        "companion_first": companion.split()[0],
        "occupation": occupation,
        "trait": rng.choice(TRAITS),
        "gift": rng.choice(GIFTS),
        "danger": rng.choice(DANGERS),
        "season": rng.choice(SEASONS),
    }


def _passage_text(rng: random.Random, facts: dict[str, str]) -> str:
    sentences = [rng.choice(variants).format(**facts) for variants in _SENTENCES]
    return " ".join(sentences)


def _book(
    rng: random.Random,
    names: set[str],
    titles: set[str],
    onsets: Sequence[str],
    num_passages: int,
    background: bool,
) -> tuple[str, list[dict[str, str]], list[str]]:
    """``(title, facts per passage, passage texts)`` of one invented book."""
    if num_passages > len(CITIES) - 1:
        raise ValueError(f"passages_per_book must be <= {len(CITIES) - 1}, got {num_passages}")
    title = _unique_title(rng, titles, background)
    heroes = [_unique_name(rng, onsets, names) for _ in range(rng.choice((2, 3)))]
    home, *places = rng.sample(CITIES, num_passages + 1)
    year = rng.randint(1700, 1950)
    facts, texts = [], []
    for i in range(num_passages):
        year += rng.randint(1, 4)  # strictly increasing: (hero, year) names one passage
        fact = _passage_facts(
            rng, heroes[i % len(heroes)], home, places[i], year, _unique_name(rng, onsets, names)
        )
        facts.append(fact)
        texts.append(_passage_text(rng, fact))
    return title, facts, texts


@dataclass
class MuseData:
    """One MUSE-style benchmark: passages per split, QA about them and verbatim probes.

    Passage records are ``{"text", "book", "split"}`` with ``split`` in ``forget`` /
    ``retain`` / ``holdout``; QA records ``{"question", "answer", "book"}``; verbatim probes
    ``{"prompt", "gt"}``. :meth:`text_records` is the one index space clients draw from.

    ``privleak_forget`` / ``privleak_holdout`` optionally hold the member / non-member texts of
    the PrivLeak test (the published ``privleak`` config); when empty (always, for generated
    data), the forget and holdout passages are used (see :meth:`privleak_texts`).
    ``privleak_retain`` holds the published ``privleak`` retain texts (articles the target
    model was trained on and keeps; not part of the PrivLeak score).
    """

    forget_passages: list[dict[str, Any]]
    retain_passages: list[dict[str, Any]]
    holdout_passages: list[dict[str, Any]]
    forget_qa: list[dict[str, Any]]
    retain_qa: list[dict[str, Any]]
    verbmem: list[dict[str, Any]]
    seed: int
    privleak_forget: list[str] = field(default_factory=list)
    privleak_holdout: list[str] = field(default_factory=list)
    privleak_retain: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name, split in (
            ("forget_passages", "forget"),
            ("retain_passages", "retain"),
            ("holdout_passages", "holdout"),
        ):
            wrong = [r.get("split") for r in getattr(self, name) if r.get("split") != split]
            if wrong:
                raise ValueError(f"{name} holds records with split {wrong[0]!r}, not {split!r}")

    def text_records(self) -> list[dict[str, Any]]:
        """The fixed index space of trainable texts: forget passages, then retain passages.

        Index ``i < len(forget_passages)`` is forget passage ``i``; the rest are the retain
        passages in order. Holdout passages are never included (they must stay unseen).
        """
        return [*self.forget_passages, *self.retain_passages]

    def privleak_texts(self) -> tuple[list[str], list[str]]:
        """``(members, non-members)`` of the PrivLeak test: forget vs holdout texts."""
        members = self.privleak_forget or [r["text"] for r in self.forget_passages]
        nonmembers = self.privleak_holdout or [r["text"] for r in self.holdout_passages]
        return list(members), list(nonmembers)


def verbmem_probe(text: str, prefix_words: int = VERBMEM_PREFIX_WORDS) -> dict[str, str]:
    """``{"prompt": first prefix_words words, "gt": the remaining words}`` of ``text``."""
    words = text.split()
    if len(words) <= prefix_words:
        raise ValueError(f"passage of {len(words)} words is too short for a verbmem probe")
    return {"prompt": " ".join(words[:prefix_words]), "gt": " ".join(words[prefix_words:])}


@register_benchmark("muse")
def generate_muse(
    seed: int = 0,
    *,
    num_books: int = 20,
    passages_per_book: int = 8,
    qa_per_passage: int = 2,
    num_forget_books: int = 4,
    num_holdout_books: int = 4,
) -> MuseData:
    """Build the synthetic benchmark (see the module docstring for the splits).

    Each passage gets ``qa_per_passage`` distinct questions (a seeded sample of
    :data:`QA_TEMPLATES`, kept in template order). Character names and book titles are
    unique across the whole benchmark.
    """
    if num_forget_books < 1 or num_holdout_books < 1:
        raise ValueError("num_forget_books and num_holdout_books must be >= 1")
    if num_books < num_forget_books + num_holdout_books + 1:
        raise ValueError(
            f"num_books={num_books} leaves no retain book after {num_forget_books} forget and "
            f"{num_holdout_books} holdout books"
        )
    if passages_per_book < 1:
        raise ValueError(f"passages_per_book must be >= 1, got {passages_per_book}")
    if not 1 <= qa_per_passage <= len(QA_TEMPLATES):
        raise ValueError(
            f"qa_per_passage must be in [1, {len(QA_TEMPLATES)}], got {qa_per_passage}"
        )
    rng = random.Random(seed)
    names: set[str] = set()
    titles: set[str] = set()
    passages: dict[str, list[dict[str, Any]]] = {"forget": [], "retain": [], "holdout": []}
    qa: dict[str, list[dict[str, Any]]] = {"forget": [], "retain": []}
    for b in range(num_books):
        if b < num_forget_books:
            split = "forget"
        elif b >= num_books - num_holdout_books:
            split = "holdout"
        else:
            split = "retain"
        title, facts, texts = _book(rng, names, titles, _BENCH_ONSETS, passages_per_book, False)
        for fact, text in zip(facts, texts, strict=True):
            passages[split].append({"text": text, "book": title, "split": split})
            template_ids = sorted(rng.sample(range(len(QA_TEMPLATES)), qa_per_passage))
            if split == "holdout":
                continue
            for t in template_ids:
                _, question, answer = QA_TEMPLATES[t]
                qa[split].append(
                    {
                        "question": question.format(**fact),
                        "answer": answer.format(**fact),
                        "book": title,
                    }
                )
    return MuseData(
        forget_passages=passages["forget"],
        retain_passages=passages["retain"],
        holdout_passages=passages["holdout"],
        forget_qa=qa["forget"],
        retain_qa=qa["retain"],
        verbmem=[verbmem_probe(r["text"]) for r in passages["forget"]],
        seed=seed,
    )


def generate_muse_background(seed: int = 0, num_documents: int = 2000) -> list[str]:
    """Texts about *other* invented books, for tokenizer training and pre-training.

    Same pools and sentence templates as :func:`generate_muse`, but character names come from
    a disjoint set of onset letters (so no benchmark name, nor any word of one, appears). About
    two thirds of the documents are passages; the rest are one question and its answer in the
    evaluation format (:func:`~fedunlearn.qa_format.format_prompt` + ``format_answer``), so a
    pre-trained model already knows the QA layout.
    """
    rng = random.Random(f"muse-background-{seed}")
    names: set[str] = set()
    docs: list[str] = []
    while len(docs) < num_documents:
        # Background titles never appear in a text, so they need not be unique.
        _, facts, texts = _book(rng, names, set(), _BACKGROUND_ONSETS, 6, True)
        for fact, text in zip(facts, texts, strict=True):
            if len(docs) >= num_documents:
                break
            if rng.random() < 2 / 3:
                docs.append(text)
            else:
                _, question, answer = rng.choice(QA_TEMPLATES)
                docs.append(
                    format_prompt(question.format(**fact)) + format_answer(answer.format(**fact))
                )
    return docs


def muse_training_texts(data: MuseData, *, include_forget: bool = True) -> list[str]:
    """Texts a model is trained on to know the corpus.

    ``include_forget=True`` (the knowledgeable model): forget passages, retain passages, then
    every forget and retain QA as ``format_prompt(q) + format_answer(a)`` (the exact evaluation
    format; a tiny model does not learn to answer questions from raw text alone).
    ``include_forget=False`` (the retrain reference): the same without anything from the forget
    split. Holdout passages are never included.
    """
    passages = data.text_records() if include_forget else list(data.retain_passages)
    qa = [*data.forget_qa, *data.retain_qa] if include_forget else list(data.retain_qa)
    return [r["text"] for r in passages] + [
        format_prompt(r["question"]) + format_answer(r["answer"]) for r in qa
    ]
