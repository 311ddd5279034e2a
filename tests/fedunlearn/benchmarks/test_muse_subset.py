"""The real MUSE-News files (shared/data) and the CPU-sized subset a pretrained model learns."""

import json
from pathlib import Path

import pytest

from fedunlearn.benchmarks.muse_files import (
    PRIVLEAK_WORDS,
    VERBMEM_GT_WORDS,
    VERBMEM_PROMPT_WORDS,
    head_words,
    join_probe,
    load_muse_files,
    muse_subset,
    tail_words,
)
from fedunlearn.models.finetuned import FinetuneRecipe, finetuned_folder
from fedunlearn.scenarios import ScenarioParams, get_scenario
from tests.shared_paths import shared_data


def _published(*parts: str) -> list:
    return json.loads(shared_data("muse-news", *parts).read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def news(tmp_path_factory):
    cache = tmp_path_factory.mktemp("datasets-cache")
    return load_muse_files(shared_data("muse-news"), cache_dir=str(cache))


def test_real_muse_news_layout_loads_every_published_list(news):
    raw = _published("raw", "forget.json")
    assert len(raw) == 889 and [i for i, t in enumerate(raw) if not t.strip()] == [821]
    assert [r["text"] for r in news.forget_passages] == [t for t in raw if t.strip()]
    # raw retain / holdout are not in the offline copy
    assert news.retain_passages == [] and news.holdout_passages == []
    assert news.forget_qa == [
        {**r, "book": "forget"} for r in _published("knowmem", "forget_qa.json")
    ]
    retain_qa = _published("knowmem", "retain2_qa.json")
    assert news.retain_qa == [{**r, "book": "retain2"} for r in retain_qa]
    assert news.verbmem == _published("verbmem", "forget.json")
    assert set(news.verbmem[0]) == {"prompt", "gt"} and len(news.verbmem) == 100
    assert news.privleak_forget == _published("privleak", "forget.json")
    assert news.privleak_holdout == _published("privleak", "holdout.json")
    assert news.privleak_retain == _published("privleak", "retain2.json")
    assert [len(x) for x in (news.privleak_forget, news.privleak_holdout)] == [100, 100]


def test_word_cuts_keep_the_whitespace_inside():
    text = "  one two\n\nthree  four five "
    assert head_words(text, 3) == "  one two\n\nthree"
    assert tail_words(text, 3) == "three  four five "
    assert head_words(text, 9) == tail_words(text, 9) == text


def test_probes_are_joined_as_the_articles_have_them():
    articles = "the co-leader said\nand they saw but down it went"
    assert join_probe("the co", "-leader said", articles) == "the co-leader said"
    assert join_probe("saw but", "down it", articles) == "saw but down it"
    assert join_probe("not in", "the text", articles) == "not in the text"
    assert join_probe("not in\n", "the text", articles) == "not in\nthe text"


def test_subset_cuts_the_first_items_of_each_list(news):
    subset = muse_subset(news, 16)
    verbmem = _published("verbmem", "forget.json")
    for probe, published in zip(subset.verbmem, verbmem, strict=False):
        assert published["prompt"].endswith(probe["prompt"])
        assert published["gt"].lstrip().startswith(probe["gt"])
        assert len(probe["prompt"].split()) == VERBMEM_PROMPT_WORDS
        assert len(probe["gt"].split()) == VERBMEM_GT_WORDS
    assert len(subset.verbmem) == 16
    excerpts = [r["text"] for r in subset.forget_passages if r["book"] == "verbmem"]
    for text, probe in zip(excerpts, subset.verbmem, strict=True):
        prompt = probe["prompt"].strip()
        assert text.startswith(prompt) and text.endswith(probe["gt"])
        assert text[len(prompt) : len(text) - len(probe["gt"])].strip() == ""  # only a joint
    # probe 0 ends "... up 8% from last year but" and goes on "down on his net worth ..."
    assert "from last year but down on his net worth" in excerpts[0]
    for name, texts, kept in (
        ("forget.json", subset.privleak_forget, subset.privleak_forget),
        ("holdout.json", subset.privleak_holdout, [r["text"] for r in subset.holdout_passages]),
        ("retain2.json", subset.privleak_retain, [r["text"] for r in subset.retain_passages]),
    ):
        published = _published("privleak", name)[:16]
        assert texts == kept and len(texts) == 16
        assert all(p.strip().startswith(t) for p, t in zip(published, texts, strict=True))
        assert all(len(t.split()) == PRIVLEAK_WORDS for t in texts)
    assert [r["text"] for r in subset.forget_passages[16:]] == subset.privleak_forget
    assert subset.forget_qa == news.forget_qa[:16] and subset.retain_qa == news.retain_qa[:16]


def test_subset_is_deterministic_and_nested(news):
    small, large = muse_subset(news, 8), muse_subset(news, 16)
    assert muse_subset(news, 8) == small
    assert (
        small.verbmem == large.verbmem[:8] and small.privleak_holdout == large.privleak_holdout[:8]
    )
    everything = muse_subset(news)
    assert muse_subset(news, 1000) == everything
    assert [
        len(x) for x in (everything.verbmem, everything.forget_qa, everything.privleak_retain)
    ] == [
        100,
        100,
        100,
    ]
    with pytest.raises(ValueError, match="n >= 1"):
        muse_subset(news, 0)


def _scenario(subset_texts: int):
    params = ScenarioParams(
        data_path=str(shared_data("muse-news")),
        subset_texts=subset_texts,
        num_forget_clients=2,
        num_retain_clients=1,
        retain_samples=40,
    )
    return get_scenario("muse")(params)


def test_real_muse_scenario_trains_and_shards_the_subset():
    scenario = _scenario(8)
    data = scenario.data
    knowledge = scenario.knowledge_records(include_forget=True)
    reference = scenario.knowledge_records(include_forget=False)
    assert knowledge == scenario.records() and len(knowledge) == 5 * 8
    assert reference == data.retain_passages + data.retain_qa and len(reference) == 16
    forget_texts = {r["text"] for r in data.forget_passages}
    assert forget_texts.isdisjoint(r.get("text") for r in reference)
    assert {r["question"] for r in data.forget_qa}.isdisjoint(r.get("question") for r in reference)
    clients = scenario.assignments()
    assert [(c.role, len(c.indices)) for c in clients] == [
        ("forget", 12),
        ("forget", 12),
        ("retain", 16),
    ]
    records = scenario.records()
    shards = [[records[i] for i in c.indices] for c in clients]
    # forget shards, in order: the 8 VerbMem excerpts, the 8 PrivLeak texts, the 8 forget QA
    assert [r["text"] for r in shards[0]] == [r["text"] for r in data.forget_passages[:12]]
    assert shards[1][:4] == data.forget_passages[12:] and shards[1][4:] == data.forget_qa
    assert sorted(map(str, shards[2])) == sorted(map(str, reference))


def test_the_fine_tuned_cache_entry_depends_on_the_subset(tmp_path: Path):
    base, recipe = tmp_path / "base", FinetuneRecipe()
    folders = {finetuned_folder(base, _scenario(n), recipe, tmp_path) for n in (8, 16)}
    assert len(folders) == 2
