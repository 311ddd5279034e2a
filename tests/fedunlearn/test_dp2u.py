"""DP2Unlearning core: data shards, the digest of what reached a training loop."""

import pytest

from fedunlearn.benchmarks.tofu import generate_tofu
from fedunlearn.dp2u import (
    ForgetRequest,
    apply_forget_request,
    data_shards,
    examples_digest,
    parse_forget_request,
)


@pytest.fixture(scope="module")
def data():
    return generate_tofu(seed=0, num_authors=20, qa_per_author=4)


def test_shards_hold_whole_authors_and_mark_the_forget_request(data):
    shards = data_shards(data, num_clients=3, forget_percent=10.0)
    assert sorted(i for s in shards for i in s.indices) == list(range(len(data.author_qa)))
    owners = {}
    for k, shard in enumerate(shards):
        for i in shard.indices:
            owners.setdefault(data.author_qa[i]["author"], set()).add(k)
    assert all(len(v) == 1 for v in owners.values())  # every author on exactly one client
    forget_authors = set(data.forget_authors(10.0))
    forget = [i for s in shards for i in s.forget]
    assert {data.author_qa[i]["author"] for i in forget} == forget_authors
    assert len(forget) == 2 * 4 and shards[-1].forget and not shards[0].forget
    for shard in shards:
        assert set(shard.retained) == set(shard.indices) - set(shard.forget)
    with pytest.raises(ValueError, match="dp2u.clients"):
        data_shards(data, num_clients=0, forget_percent=10.0)


def test_digest_is_order_free_and_content_sensitive():
    ex = [([1, 2, 3], [-100, 2, 3]), ([4, 5], [-100, 5])]
    assert examples_digest(ex) == examples_digest(list(reversed(ex)))
    assert examples_digest(ex) != examples_digest(ex[:1])
    assert examples_digest(ex) != examples_digest([([1, 2, 3], [-100, 2, 3]), ([4, 6], [-100, 6])])


def test_public_records_are_trained_everywhere_and_never_forgotten(data):
    public = (1000, 1001)
    shards = data_shards(data, num_clients=2, forget_percent=10.0, public=public)
    for shard in shards:
        assert shard.training == shard.indices + public
        assert set(public) <= set(shard.retained)
        assert not set(shard.forget) & set(shard.retained)


def test_named_forget_request_replaces_the_percent_split(data):
    shards = data_shards(data, num_clients=2, forget_percent=10.0)
    first_author = data.author_qa[shards[0].indices[0]]["author"]
    record = shards[1].indices[5]
    request = parse_forget_request(
        f'{{"1": {{"records": [{record}]}}, "0": {{"authors": ["{first_author}"]}}}}'
    )
    assert request == [ForgetRequest(0, (first_author,)), ForgetRequest(1, (), (record,))]
    out = apply_forget_request(data, shards, request)
    assert {data.author_qa[i]["author"] for i in out[0].forget} == {first_author}
    assert len(out[0].forget) == 4  # all of the author's QA
    assert out[1].forget == (record,)  # one record, not its author's others, not forget-10 %
    assert record not in out[1].retained and len(out[1].retained) == len(out[1].indices) - 1
    assert [sh.indices for sh in out] == [sh.indices for sh in shards]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("not json", "not valid JSON"),
        ("{}", "non-empty JSON object"),
        ('{"a": {"records": [1]}}', "not a client index"),
        ('{"0": {"rows": [1]}}', "'authors'"),
        ('{"0": {"records": ["1"]}}', "'records' must be indices"),
        ('{"0": {}}', "names nothing"),
    ],
)
def test_malformed_forget_requests_are_refused(text, problem):
    with pytest.raises(ValueError, match=problem):
        parse_forget_request(text)


def test_forget_request_names_must_sit_on_the_named_client(data):
    shards = data_shards(data, num_clients=2, forget_percent=10.0)
    author0 = data.author_qa[shards[0].indices[0]]["author"]
    cases = [
        (ForgetRequest(2, records=(0,)), "client 2 does not exist"),
        (ForgetRequest(0, authors=("Nobody Atall",)), "no author named 'Nobody Atall'"),
        (ForgetRequest(1, authors=(author0,)), f"'{author0}' is held by client 0, not client 1"),
        (ForgetRequest(1, records=(shards[0].indices[0],)), "is held by client 0"),
        (ForgetRequest(0, records=(10_000,)), "record 10000 is not an author QA index"),
    ]
    for request, problem in cases:
        with pytest.raises(ValueError, match=problem):
            apply_forget_request(data, shards, [request])
    single = data_shards(data, num_clients=1, forget_percent=10.0)
    everyone = sorted({r["author"] for r in data.author_qa})
    with pytest.raises(ValueError, match="client 0: the client would keep no records"):
        apply_forget_request(data, single, [ForgetRequest(0, authors=tuple(everyone))])
