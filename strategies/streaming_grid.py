"""A Grid that hands every reply to the strategy the moment it is pulled from the SuperLink.

Flower's ``Grid.send_and_receive`` collects every reply of a round before the strategy sees
any, so a server holds all uploads in memory at once. :class:`StreamingGrid` runs the same
push-then-pull loop but calls ``on_reply(message)`` for each reply as it arrives: the merge
strategy validates it, writes it to its spool on disk and drops its arrays
(``MergeStrategy.receive_reply``), so at most the replies of one pull are in memory.
With ``max_in_flight`` = k > 0 it pushes at most k messages at a time and the next one when a
reply arrives, taking each from the strategy's message iterator only then: a message that is
built when it is sent (MPU's per-node copies) is in memory for at most k nodes at once.
Everything else is the wrapped grid's.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from typing import Any

from flwr.app import Message
from flwr.serverapp import Grid


class StreamingGrid:
    """``grid`` with a ``send_and_receive`` that streams replies to ``on_reply``."""

    def __init__(
        self,
        grid: Grid,
        on_reply: Callable[[Message], None],
        pull_interval: float = 0.2,
        max_in_flight: int = 0,
    ) -> None:
        self._grid = grid
        self._on_reply = on_reply
        self._pull_interval = pull_interval
        self._max_in_flight = max_in_flight

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> list[Message]:
        """Push ``messages`` (at most ``max_in_flight`` unanswered at a time, 0 = all), then
        pull replies until all arrived or ``timeout`` seconds passed (as Flower's own),
        handing each to ``on_reply`` as soon as it is pulled."""
        waiting = iter(messages)
        limit = self._max_in_flight
        exhausted = False
        pending: set[str] = set()
        end = time.time() + (timeout if timeout is not None else 0.0)
        replies: list[Message] = []
        while True:
            room = limit - len(pending) if limit else None  # None: every message
            if not exhausted and (room is None or room > 0):
                batch = list(itertools.islice(waiting, room))
                exhausted = room is None or len(batch) < room
                if batch:
                    pending.update(self._grid.push_messages(batch))
            for reply in self._grid.pull_messages(pending):
                self._on_reply(reply)
                replies.append(reply)
                pending.discard(reply.metadata.reply_to_message_id)
            if exhausted and not pending:
                break
            if timeout is not None and time.time() >= end:
                break
            time.sleep(self._pull_interval)
        return replies
