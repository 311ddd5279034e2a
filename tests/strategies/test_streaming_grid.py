"""StreamingGrid: replies handed over as they arrive, and at most ``max_in_flight`` messages
taken from the strategy's iterator before their replies came back."""

from types import SimpleNamespace

import pytest

from strategies.streaming_grid import StreamingGrid


class EchoGrid:
    """A grid whose nodes answer every pushed message at the next pull."""

    def __init__(self) -> None:
        self.unanswered: list[str] = []
        self.most_unanswered = 0

    def push_messages(self, messages):
        ids = [str(m) for m in messages]
        self.unanswered += ids
        self.most_unanswered = max(self.most_unanswered, len(self.unanswered))
        return ids

    def pull_messages(self, pending):
        answered = [i for i in self.unanswered if i in pending]
        self.unanswered = [i for i in self.unanswered if i not in pending]
        return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=i)) for i in answered]


@pytest.mark.parametrize("limit, most", [(0, 5), (1, 1), (2, 2), (7, 5)])
def test_at_most_max_in_flight_messages_are_taken_before_their_replies(limit, most):
    grid, seen, built = EchoGrid(), [], []

    def messages():
        for k in range(5):
            built.append((k, len(seen)))  # message k is built after len(seen) replies
            yield f"m{k}"

    stream = StreamingGrid(grid, seen.append, pull_interval=0.0, max_in_flight=limit)
    replies = stream.send_and_receive(messages(), timeout=10)
    assert [r.metadata.reply_to_message_id for r in replies] == [f"m{k}" for k in range(5)]
    assert seen == replies and grid.most_unanswered == most
    if limit:  # message k waits for the replies of all but `limit - 1` earlier ones
        assert all(answered >= k - limit + 1 for k, answered in built)


def test_a_timeout_returns_the_replies_so_far():
    class SilentGrid(EchoGrid):
        def pull_messages(self, pending):
            return []

    stream = StreamingGrid(SilentGrid(), lambda reply: None, pull_interval=0.0, max_in_flight=1)
    assert stream.send_and_receive(iter(["a", "b"]), timeout=0.05) == []
