"""A Grid that hands every reply to the strategy the moment it is pulled from the SuperLink.

Flower's ``Grid.send_and_receive`` collects every reply of a round before the strategy sees
any, so a server holds all uploads in memory at once. :class:`StreamingGrid` runs the same
push-then-pull loop but calls ``on_reply(message)`` for each reply as it arrives: the merge
strategy validates it, writes it to its spool on disk and drops its arrays
(``MergeStrategy.receive_reply``), so at most the replies of one pull are in memory.
Everything else is the wrapped grid's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from flwr.app import Message
from flwr.serverapp import Grid


class StreamingGrid:
    """``grid`` with a ``send_and_receive`` that streams replies to ``on_reply``."""

    def __init__(
        self, grid: Grid, on_reply: Callable[[Message], None], pull_interval: float = 0.2
    ) -> None:
        self._grid = grid
        self._on_reply = on_reply
        self._pull_interval = pull_interval

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> list[Message]:
        """Push ``messages``, then pull replies until all arrived or ``timeout`` seconds
        passed (as Flower's own), handing each to ``on_reply`` as soon as it is pulled."""
        pending = set(self._grid.push_messages(messages))
        end = time.time() + (timeout if timeout is not None else 0.0)
        replies: list[Message] = []
        while timeout is None or time.time() < end:
            for reply in self._grid.pull_messages(pending):
                self._on_reply(reply)
                replies.append(reply)
                pending.discard(reply.metadata.reply_to_message_id)
            if not pending:
                break
            time.sleep(self._pull_interval)
        return replies
