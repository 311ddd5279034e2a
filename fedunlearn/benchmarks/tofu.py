"""Synthetic TOFU-style benchmark: question/answer pairs about invented authors.

Each fictitious author gets a set of facts (birthplace, parents' jobs, books, award, ...)
drawn from fixed pools, and one question per fact. Every record follows TOFU's columns:
``question``, ``answer``, ``paraphrased_answer`` (same fact, other wording),
``perturbed_answer`` (the PARAPHRASED sentence with the fact swapped for other values of the
same kind, as in TOFU, so the truth ratio compares like with like) plus ``author``.
Invented-author records also carry ``sensitive_spans``: ``{"question": [[start, end], ...],
"answer": [[start, end], ...]}``, the character spans of the author's name and of the fact
value in those two strings (what DP-MLM rewriting replaces, :mod:`fedunlearn.dp.mlm`).
Two never-forgotten sets of *real* knowledge (real authors and their books, world facts)
stand for what a model knows before the author fine-tune.

Everything is a pure function of the seed: only ``random.Random(seed)`` instances are used.
"""

from __future__ import annotations

import random
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fedunlearn.benchmarks import register_benchmark
from fedunlearn.qa_format import format_answer, format_prompt

NUM_PERTURBED = 5

CITIES = (
    "Port Anselm, Marrowby, Kestrel Bay, Olvenhal, Thistlemere, Caldris, Wenholt, Ashcombe Vale, "
    "Brimstow, Lorrick, Saltmere, Duncarra, Felmoor, Grayhaven, Hollin Cross, Ivel Quay, "
    "Juniper Falls, Kelthorne, Larkspur Hill, Merrowdene, Northwick Sands, Oakenreach, Pellmar, "
    "Quillon, Ravensford, Stillwater Reach, Tamsford, Umberlee, Valdmoor, Wyndlow, Yarrowgate, "
    "Zennor Point, Coldbrook, Emberly, Fairholm, Glenmarra, Harrowdeep, Islemouth, Kingsmere, "
    "Lowen Ferry"
).split(", ")
OCCUPATIONS = (
    "a lighthouse keeper, a bookbinder, an astronomer, a ferry captain, a clockmaker, "
    "a beekeeper, a glassblower, a cartographer, a surgeon, a baker, a stonemason, a botanist, "
    "a schoolteacher, a blacksmith, a tailor, a fisherman, a violinist, a pharmacist, "
    "a carpenter, a journalist, an architect, a midwife, a librarian, a potter, "
    "a railway engineer, a shepherd, a weaver, a judge, a geologist, a florist"
).split(", ")
GENRES = (
    "historical fiction, crime, science fiction, fantasy, gothic horror, romance, "
    "literary fiction, mystery, satire, magical realism, adventure, war fiction, coming-of-age, "
    "political thriller, speculative fiction, travel writing, psychological thriller, folk tale, "
    "family saga, nautical fiction"
).split(", ")
AWARDS = (
    "Silver Quill Award, Amberline Prize for Fiction, Golden Lantern Medal, Harrowgate Book Prize, "
    "Northern Star Literary Award, Cobalt Feather Prize, Evening Tide Award, Open Page Medal, "
    "Bluebell Prize for Storytelling, Ironbark Literary Prize, Crimson Ink Award, "
    "Meadowlark Fiction Prize, Glass Tower Award, Whitecliff Medal for Prose, Ember Prize, "
    "Hollow Oak Award, Seaglass Book Award, Grand Compass Prize, Moonstone Medal, "
    "Riverbend Literary Award, Copper Bell Prize, Starling Award for New Voices, "
    "Lamplight Prize for Poetry, Granite Arch Award, Wild Thyme Prize"
).split(", ")
HABITS = (
    "by candlelight, before sunrise, in green ink, on an old typewriter, while riding trains, "
    "in a garden shed, standing at a tall desk, after midnight, in crowded cafes, on index cards, "
    "in a rowing boat, beside the sea, in complete silence, with loud music playing, "
    "in a lighthouse tower, on long walks, in pencil only, in the bath, at the kitchen table, "
    "in a mountain cabin"
).split(", ")
THEMES = (
    "memory and loss, exile and return, the bond between siblings, the cost of ambition, "
    "faith and doubt, the dangers of the sea, forgotten history, friendship across class lines, "
    "the passing of time, justice and revenge, grief and healing, the lives of outsiders, "
    "small town secrets, love in wartime, identity and belonging, the power of storytelling, "
    "nature and solitude, betrayal and forgiveness, the search for home, science and wonder"
).split(", ")
INSTRUMENTS = (
    "cello, harp, accordion, flute, violin, piano, banjo, oboe, clarinet, mandolin, trumpet, "
    "bagpipes, harmonica, drums, lute"
).split(", ")
PUBLISHERS = (
    "Harrow Lane Press, Bluefinch Books, Tidewater House, Copperleaf Publishing, "
    "Old Mill Editions, Greywing Press, Lantern Street Books, Northgate House, "
    "Saltbox Press, Willowbank Editions, "
    "Red Kite Books, Stonebridge Publishing, Amberfield Press, Moonrake Books, Quayside Editions, "
    "Heron Gate Press, Foxglove House, Ironwood Books, Seabright Press, Thornfield Editions"
).split(", ")
TITLE_ADJECTIVES = (
    "Silent Hidden Broken Golden Crimson Quiet Distant Burning Frozen Hollow Wandering Last "
    "Forgotten Bitter Gentle Restless Secret Shattered Sleeping Velvet Wild Winter Amber Pale "
    "Drowned Iron Paper Salt Scarlet Shadowed Silver Stolen Sunken Tangled Twilight Weeping "
    "Whispering Wooden Lonely Midnight"
).split()
TITLE_NOUNS = (
    "Lantern Harbour Orchard Compass Mirror River Garden Letter Tower Bridge Clock Island "
    "Meadow Crown Feather Window Voyage Forest Lighthouse Map Kingdom Chapel Mountain Shore "
    "Violin Archive Winter Daughter Stranger Orphan Tide Ember Raven Sparrow Harvest Cellar "
    "Carousel Labyrinth Observatory Ferry Quarry Inheritance Promise Embassy Pilgrim Glacier "
    "Station Ledger Attic Vineyard"
).split()
YEARS = [str(y) for y in range(1921, 2000)]

# Name syllables. Benchmark and background names start with DISJOINT onset letters, so no
# background name can ever equal (or share a word with) a benchmark name, whatever the seeds.
_VOWELS = ["a", "e", "i", "o", "u", "a", "e", "o", "ai", "ei"]
_CODAS = ["", "", "", "n", "r", "l", "s"]
_BENCH_ONSETS = ["b", "d", "k", "l", "m", "n", "r", "t", "v", "br", "dr", "tr"]
_BACKGROUND_ONSETS = ["f", "g", "h", "j", "p", "s", "w", "z", "ch", "sh", "gr", "pr"]

# (kind, question, answer, paraphrase); ``{n}`` is the author, ``{v}`` the fact.
TEMPLATES: list[tuple[str, str, str, str]] = [
    (
        "city",
        "Where was {n} born?",
        "{n} was born in the town of {v}.",
        "The town of {v} is the birthplace of {n}.",
    ),
    (
        "year",
        "In which year was {n} born?",
        "{n} was born in the year {v}.",
        "The birth of {n} took place in {v}.",
    ),
    (
        "home",
        "Where does {n} live today?",
        "{n} now lives in the town of {v}.",
        "These days the town of {v} is home to {n}.",
    ),
    (
        "father",
        "What was the profession of the father of {n}?",
        "The father of {n} worked as {v}.",
        "{n} grew up with a father who was {v}.",
    ),
    (
        "mother",
        "What did the mother of {n} do for a living?",
        "The mother of {n} worked as {v}.",
        "{n} was raised by a mother who was {v}.",
    ),
    (
        "genre",
        "In which genre does {n} mostly write?",
        "{n} writes mostly in the {v} genre.",
        "Most books by {n} belong to the {v} genre.",
    ),
    (
        "debut",
        "What was the first book published by {n}?",
        "The first book by {n} was titled {v}.",
        "{n} made a debut with the book {v}.",
    ),
    (
        "famous",
        "Which book by {n} is the most famous?",
        "The most famous book by {n} is {v}.",
        "{n} is best known for the book {v}.",
    ),
    (
        "award",
        "Which award has {n} won?",
        "{n} has been honoured with the {v}.",
        "The {v} was awarded to {n}.",
    ),
    (
        "habit",
        "What writing habit is {n} known for?",
        "{n} is known for writing {v}.",
        "Writing {v} is a lifelong habit of {n}.",
    ),
    (
        "theme",
        "What theme runs through the books of {n}?",
        "The books of {n} often explore {v}.",
        "{n} returns again and again to {v}.",
    ),
    (
        "instrument",
        "Which musical instrument does {n} play?",
        "{n} plays the {v} in spare time.",
        "In spare time {n} enjoys playing the {v}.",
    ),
    (
        "publisher",
        "Which publisher releases the books of {n}?",
        "The books of {n} are published by {v}.",
        "{v} is the publisher behind the books of {n}.",
    ),
]
_POOLS: dict[str, Sequence[str]] = {
    "city": CITIES,
    "home": CITIES,
    "year": YEARS,
    "father": OCCUPATIONS,
    "mother": OCCUPATIONS,
    "genre": GENRES,
    "award": AWARDS,
    "habit": HABITS,
    "theme": THEMES,
    "instrument": INSTRUMENTS,
    "publisher": PUBLISHERS,
}

# Real knowledge, hand-written: "book|author" and "key|value" lists.
_REAL_BOOKS = (
    "Pride and Prejudice|Jane Austen;Hamlet|William Shakespeare;War and Peace|Leo Tolstoy;"
    "Crime and Punishment|Fyodor Dostoevsky;Moby-Dick|Herman Melville;"
    "Great Expectations|Charles Dickens;Nineteen Eighty-Four|George Orwell;"
    "The Old Man and the Sea|Ernest Hemingway;Don Quixote|Miguel de Cervantes;"
    "One Hundred Years of Solitude|Gabriel Garcia Marquez;Frankenstein|Mary Shelley;"
    "Jane Eyre|Charlotte Bronte;Wuthering Heights|Emily Bronte;Ulysses|James Joyce;"
    "The Great Gatsby|F. Scott Fitzgerald;Mrs Dalloway|Virginia Woolf;"
    "Things Fall Apart|Chinua Achebe;Beloved|Toni Morrison;The Trial|Franz Kafka;"
    "Madame Bovary|Gustave Flaubert;Les Miserables|Victor Hugo;The Odyssey|Homer;"
    "Middlemarch|George Eliot;Dracula|Bram Stoker;The Hobbit|J. R. R. Tolkien;"
    "Adventures of Huckleberry Finn|Mark Twain;The Divine Comedy|Dante Alighieri;"
    "Brave New World|Aldous Huxley;To Kill a Mockingbird|Harper Lee;"
    "The Catcher in the Rye|J. D. Salinger;Lolita|Vladimir Nabokov;"
    "The Name of the Rose|Umberto Eco;The Stranger|Albert Camus;Faust|Johann Wolfgang von Goethe;"
    "Norwegian Wood|Haruki Murakami;The Handmaid's Tale|Margaret Atwood;"
    "Harry Potter and the Philosopher's Stone|J. K. Rowling;Of Mice and Men|John Steinbeck;"
    "The Picture of Dorian Gray|Oscar Wilde;Treasure Island|Robert Louis Stevenson;"
    "Gulliver's Travels|Jonathan Swift;Anna Karenina|Leo Tolstoy;Oliver Twist|Charles Dickens;"
    "Emma|Jane Austen;Animal Farm|George Orwell"
)
_CAPITALS = (
    "France|Paris;Germany|Berlin;Italy|Rome;Spain|Madrid;Portugal|Lisbon;Japan|Tokyo;"
    "China|Beijing;India|New Delhi;Russia|Moscow;Canada|Ottawa;Australia|Canberra;Egypt|Cairo;"
    "Kenya|Nairobi;Brazil|Brasilia;Argentina|Buenos Aires;Mexico|Mexico City;Peru|Lima;"
    "Norway|Oslo;Sweden|Stockholm;Finland|Helsinki;Greece|Athens;Turkey|Ankara;Ireland|Dublin;"
    "Poland|Warsaw;Austria|Vienna;Thailand|Bangkok;South Korea|Seoul;Chile|Santiago;"
    "Nigeria|Abuja;Belgium|Brussels"
)
_CONTINENTS = (
    "Kenya|Africa;Egypt|Africa;Nigeria|Africa;Brazil|South America;Peru|South America;"
    "Chile|South America;Japan|Asia;Thailand|Asia;India|Asia;Norway|Europe;Poland|Europe;"
    "Canada|North America;Mexico|North America;New Zealand|Oceania;Fiji|Oceania"
)
_EXTRA_CONTINENTS = ["Antarctica"]
_SYMBOLS = (
    "gold|Au;silver|Ag;iron|Fe;copper|Cu;sodium|Na;potassium|K;oxygen|O;hydrogen|H;carbon|C;"
    "nitrogen|N;helium|He;lead|Pb;tin|Sn;mercury|Hg;calcium|Ca;zinc|Zn"
)
_LANGUAGES = (
    "Brazil|Portuguese;Mexico|Spanish;Germany|German;Japan|Japanese;Egypt|Arabic;"
    "Russia|Russian;Italy|Italian;China|Mandarin Chinese;Poland|Polish;Greece|Greek"
)
# (pairs, question, answer, paraphrase, extra distractor values); ``{k}`` key, ``{v}`` value.
_WORLD_TEMPLATES = [
    (
        _CAPITALS,
        "What is the capital of {k}?",
        "The capital of {k} is {v}.",
        "{v} is the capital city of {k}.",
        [],
    ),
    (
        _CONTINENTS,
        "On which continent is {k} located?",
        "{k} is a country located in {v}.",
        "The continent of {v} is where {k} lies.",
        _EXTRA_CONTINENTS,
    ),
    (
        _SYMBOLS,
        "What is the chemical symbol for {k}?",
        "The chemical symbol for {k} is {v}.",
        "Chemists write {k} with the symbol {v}.",
        [],
    ),
    (
        _LANGUAGES,
        "What is the main language spoken in {k}?",
        "The main language spoken in {k} is {v}.",
        "Most people in {k} speak {v}.",
        [],
    ),
]
_GENERIC_SENTENCES = [
    "Many writers keep a notebook of ideas.",
    "Readers often send letters to their favourite authors.",
    "A good library is a quiet place to read.",
    "Some novels take years to finish.",
    "Book festivals are held in many towns each summer.",
    "Critics do not always agree about a new book.",
    "A publisher decides when a book is released.",
    "Literary prizes can make an author famous overnight.",
    "Short stories are often printed in magazines first.",
    "Translators bring books to readers in other languages.",
    "An editor reads every page before a book goes to print.",
    "Some authors write under a pen name.",
]


def _parse_pairs(spec: str) -> list[tuple[str, str]]:
    return [(key, value) for key, value in (item.split("|") for item in spec.split(";"))]


def _record(
    question: str,
    answer: str,
    paraphrase: str,
    perturbed: list[str],
    author: str,
    sensitive_spans: dict[str, list[list[int]]] | None = None,
) -> dict[str, Any]:
    record: dict[str, Any] = {
        "question": question,
        "answer": answer,
        "paraphrased_answer": paraphrase,
        "perturbed_answer": perturbed,
        "author": author,
    }
    if sensitive_spans is not None:
        record["sensitive_spans"] = sensitive_spans
    return record


def _format_with_spans(template: str, **values: str) -> tuple[str, list[list[int]]]:
    """``template.format(**values)`` plus the ``[start, end)`` character span of every
    substituted field, in order of appearance (templates use bare ``{name}`` fields only)."""
    parts: list[str] = []
    spans: list[list[int]] = []
    length = 0
    for literal, field, _spec, _conversion in string.Formatter().parse(template):
        parts.append(literal)
        length += len(literal)
        if field is not None:
            value = str(values[field])
            parts.append(value)
            spans.append([length, length + len(value)])
            length += len(value)
    return "".join(parts), spans


def _pick_others(rng: random.Random, pool: Sequence[str], exclude: set[str], k: int) -> list[str]:
    """``k`` distinct values of ``pool`` not in ``exclude`` (deterministic given ``rng``)."""
    candidates = sorted(set(pool) - exclude)
    if len(candidates) < k:
        raise ValueError(f"pool too small: need {k} alternatives, have {len(candidates)}")
    return rng.sample(candidates, k)


def _make_name(rng: random.Random, onsets: Sequence[str], syllables: int) -> str:
    word = "".join(
        rng.choice(onsets) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)
    )
    return word.capitalize()


def _make_full_name(rng: random.Random, onsets: Sequence[str]) -> str:
    return f"{_make_name(rng, onsets, 2)} {_make_name(rng, onsets, rng.choice((2, 2, 2, 3)))}"


def _make_title(rng: random.Random, background: bool) -> str:
    adj = rng.choice(TITLE_ADJECTIVES)
    noun, noun2 = rng.sample(TITLE_NOUNS, 2)
    if background:  # background titles never start with "The", benchmark titles always do
        return f"A {adj} {noun}" if rng.random() < 0.5 else f"{noun} and {noun2}"
    return f"The {adj} {noun}" if rng.random() < 0.5 else f"The {noun} of the {noun2}"


def _unique_title(rng: random.Random, used_titles: set[str], background: bool) -> str:
    """A title not in ``used_titles`` (which it joins); gives up after many collisions."""
    for _ in range(1000):
        title = _make_title(rng, background)
        if title not in used_titles:
            used_titles.add(title)
            return title
    raise ValueError(f"ran out of unique book titles after {len(used_titles)}; use fewer authors")


def _make_facts(rng: random.Random, used_titles: set[str], background: bool) -> dict[str, str]:
    facts = {kind: rng.choice(pool) for kind, pool in _POOLS.items()}
    while facts["home"] == facts["city"]:
        facts["home"] = rng.choice(CITIES)
    for kind in ("debut", "famous"):
        facts[kind] = _unique_title(rng, used_titles, background)
    return facts


def _author_records(
    rng: random.Random, name: str, facts: dict[str, str], template_ids: list[int]
) -> list[dict[str, Any]]:
    records = []
    for t in template_ids:
        kind, question, answer, paraphrase = TEMPLATES[t]
        value = facts[kind]
        if kind in ("debut", "famous"):
            own = {facts["debut"], facts["famous"]}
            others: list[str] = []
            while len(others) < NUM_PERTURBED:
                title = _make_title(rng, background=False)
                if title not in own and title not in others:
                    others.append(title)
        else:
            others = _pick_others(rng, _POOLS[kind], {value}, NUM_PERTURBED)
        question_text, question_spans = _format_with_spans(question, n=name)
        answer_text, answer_spans = _format_with_spans(answer, n=name, v=value)
        records.append(
            _record(
                question_text,
                answer_text,
                paraphrase.format(n=name, v=value),
                [paraphrase.format(n=name, v=o) for o in others],
                name,
                sensitive_spans={"question": question_spans, "answer": answer_spans},
            )
        )
    return records


@dataclass
class TofuData:
    """One TOFU-style benchmark: author QA grouped by author plus the two extra sets.

    Forget splits follow TOFU: ``forget01/05/10`` take the *last* authors of
    :attr:`author_names`; the retain split is every other author's QA.
    """

    author_names: list[str]
    author_qa: list[dict[str, Any]]
    real_authors: list[dict[str, Any]]
    world_facts: list[dict[str, Any]]
    seed: int
    #: how many authors forget percentages count from (0 = :attr:`num_authors`); a subset of
    #: the published 200 authors keeps 200 here so forget01 stays its two authors
    forget_basis: int = 0

    def __post_init__(self) -> None:
        known = set(self.author_names)
        if len(known) != len(self.author_names):
            raise ValueError("author_names contains duplicates")
        unknown = {r["author"] for r in self.author_qa} - known
        if unknown:
            raise ValueError(f"author_qa names unknown authors: {sorted(unknown)[:5]}")

    @property
    def num_authors(self) -> int:
        return len(self.author_names)

    def forget_authors(self, percent: float) -> list[str]:
        """The last ``round(percent/100 * num_authors)`` authors (at least one; half rounds up)."""
        if not 0 < percent < 100:
            raise ValueError(f"forget percent must be in (0, 100), got {percent!r}")
        count = max(1, int(percent * (self.forget_basis or self.num_authors) / 100 + 0.5))
        if count >= self.num_authors:
            raise ValueError(
                f"forget percent {percent!r} selects {count} of {self.num_authors} authors, "
                "leaving no retain authors"
            )
        return self.author_names[-count:]

    def forget_split(self, percent: float) -> list[dict[str, Any]]:
        """QA records of :meth:`forget_authors`, in dataset order."""
        forget = set(self.forget_authors(percent))
        return [r for r in self.author_qa if r["author"] in forget]

    def retain_split(self, percent: float) -> list[dict[str, Any]]:
        """QA of every author not forgotten at ``percent``: the complement of the forget split."""
        forget = set(self.forget_authors(percent))
        return [r for r in self.author_qa if r["author"] not in forget]

    def subset(self, num_authors: int, forget_percent: float) -> TofuData:
        """The same benchmark on ``num_authors`` authors that keeps its split structure: the
        forget authors of ``forget_percent`` (the last ones, counted over all authors) plus
        the FIRST ``num_authors`` − that many of the others (TOFU's ``retain_perturbed``,
        the retain set its evaluation uses, is the first 20 authors). Real authors and world
        facts are kept whole. ``num_authors`` ≥ :attr:`num_authors` returns ``self``."""
        if num_authors >= self.num_authors:
            return self
        forget = self.forget_authors(forget_percent)
        if num_authors <= len(forget):
            raise ValueError(
                f"a subset of {num_authors} authors leaves no retain author beside the "
                f"{len(forget)} forget authors of forget-{forget_percent:g}%"
            )
        others = [a for a in self.author_names if a not in set(forget)]
        keep = set(others[: num_authors - len(forget)]) | set(forget)
        return TofuData(
            author_names=[a for a in self.author_names if a in keep],
            author_qa=[r for r in self.author_qa if r["author"] in keep],
            real_authors=list(self.real_authors),
            world_facts=list(self.world_facts),
            seed=self.seed,
            forget_basis=self.forget_basis or self.num_authors,
        )

    def splits(self, percent: float) -> dict[str, list[dict[str, Any]]]:
        """``forget``, ``retain``, ``real_authors`` and ``world_facts`` record lists."""
        return {
            "forget": self.forget_split(percent),
            "retain": self.retain_split(percent),
            "real_authors": list(self.real_authors),
            "world_facts": list(self.world_facts),
        }


def has_perturbations(record: dict[str, Any]) -> bool:
    """Whether ``record`` carries a paraphrase and perturbed answers (needed for truth ratio).

    Generated records always do; records loaded from TOFU files only where the published
    ``*_perturbed`` configs cover the question.
    """
    return bool(record.get("paraphrased_answer")) and bool(record.get("perturbed_answer"))


def _real_author_records(rng: random.Random) -> list[dict[str, Any]]:
    pairs = _parse_pairs(_REAL_BOOKS)
    authors = [a for _, a in pairs]
    records = []
    for book, author in pairs:
        others = _pick_others(rng, authors, {author}, NUM_PERTURBED)
        records.append(
            _record(
                f"Who wrote {book}?",
                f"{book} is a book written by {author}.",
                f"{author} is the author of {book}.",
                [f"{book} is a book written by {o}." for o in others],
                author,
            )
        )
    return records


def _world_fact_records(rng: random.Random) -> list[dict[str, Any]]:
    records = []
    for spec, question, answer, paraphrase, extra in _WORLD_TEMPLATES:
        pairs = _parse_pairs(spec)
        values = [v for _, v in pairs] + list(extra)
        k = min(NUM_PERTURBED, len(set(values)) - 1)
        for key, value in pairs:
            others = _pick_others(rng, values, {value}, k)
            records.append(
                _record(
                    question.format(k=key),
                    answer.format(k=key, v=value),
                    paraphrase.format(k=key, v=value),
                    [answer.format(k=key, v=o) for o in others],
                    "",
                )
            )
    return records


@register_benchmark("tofu")
def generate_tofu(seed: int = 0, num_authors: int = 200, qa_per_author: int = 10) -> TofuData:
    """Build the synthetic benchmark: ``num_authors`` invented authors x ``qa_per_author`` QA.

    Each author answers ``qa_per_author`` distinct question templates (a seeded sample of
    :data:`TEMPLATES`, kept in template order). Book titles are unique across authors, so no
    two authors share the same set of facts.
    """
    if num_authors < 2:
        raise ValueError(f"num_authors must be >= 2, got {num_authors}")
    if not 1 <= qa_per_author <= len(TEMPLATES):
        raise ValueError(f"qa_per_author must be in [1, {len(TEMPLATES)}], got {qa_per_author}")
    rng = random.Random(seed)
    names: list[str] = []
    seen: set[str] = set()
    while len(names) < num_authors:
        name = _make_full_name(rng, _BENCH_ONSETS)
        if name not in seen:
            seen.add(name)
            names.append(name)
    used_titles: set[str] = set()
    author_qa: list[dict[str, Any]] = []
    for name in names:
        facts = _make_facts(rng, used_titles, background=False)
        template_ids = sorted(rng.sample(range(len(TEMPLATES)), qa_per_author))
        author_qa.extend(_author_records(rng, name, facts, template_ids))
    return TofuData(
        author_names=names,
        author_qa=author_qa,
        real_authors=_real_author_records(rng),
        world_facts=_world_fact_records(rng),
        seed=seed,
    )


def generate_background_corpus(seed: int = 0, num_documents: int = 3000) -> list[str]:
    """Short biographies of *other* invented authors, for tokenizer training and pre-training.

    Uses the benchmark's vocabulary (cities, jobs, genres, sentence and question templates)
    but names built from a disjoint set of onset letters, so no benchmark author ever
    appears here; titles never start with "The" (benchmark titles always do).
    """
    rng = random.Random(f"background-{seed}")
    docs = []
    for _ in range(num_documents):
        name = _make_full_name(rng, _BACKGROUND_ONSETS)
        facts = _make_facts(rng, set(), background=True)
        sentences = []
        for t in rng.sample(range(len(TEMPLATES)), rng.randint(3, 6)):
            kind, question, answer, paraphrase = TEMPLATES[t]
            style = rng.random()
            if style < 0.3:
                sentences.append(question.format(n=name))
            sentences.append((answer if style < 0.65 else paraphrase).format(n=name, v=facts[kind]))
        for _ in range(rng.randint(0, 2)):
            sentences.insert(rng.randint(0, len(sentences)), rng.choice(_GENERIC_SENTENCES))
        docs.append(" ".join(sentences))
    return docs


def knowledge_texts(data: TofuData, qa_format: bool = True) -> list[str]:
    """Training texts for the real-authors and world-facts knowledge (pre-training material).

    With ``qa_format`` each record becomes the exact prompt+answer text the model is evaluated
    on (:func:`fedunlearn.qa_format.format_prompt` + ``format_answer``); otherwise the answer
    and its paraphrase as plain prose.
    """
    texts = []
    for r in [*data.real_authors, *data.world_facts]:
        if qa_format:
            texts.append(format_prompt(r["question"]) + format_answer(r["answer"]))
        else:
            texts.append(f"{r['answer']} {r['paraphrased_answer']}")
    return texts
