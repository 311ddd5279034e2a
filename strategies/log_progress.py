"""Progress bars of the ServerApp's long steps in the Flower log.

``flwr run --stream`` (and ``flwr log``) show what the ServerApp logs, not its standard error,
where tqdm draws its bars: a first run that builds the substrate inside the ServerApp would sit
silent for minutes.  :func:`progress_in_log` sends what tqdm writes during the block to the
Flower log instead — each bar's first state, its latest state at most every ``every_s``
seconds, and its last state when it finishes — plus any other line written to standard error
meanwhile.
"""

from __future__ import annotations

import contextlib
import io
import math
import time
from collections.abc import Callable, Iterator
from logging import INFO

from flwr.common.logger import log

#: Seconds between two log lines of the same bar.
EVERY_S = 10.0


class _BarsToLog(io.TextIOBase):
    """A text stream for tqdm: ``\\r``-separated bar states in, throttled log lines out."""

    def __init__(self, emit: Callable[[str], None], every_s: float) -> None:
        super().__init__()
        self.emit, self.every_s = emit, every_s
        self.pending = ""  # the latest state not logged yet
        self.last_logged = -math.inf
        self.last_state = ""  # the logged line up to its timing part

    def write(self, text: str) -> int:
        for piece in text.replace("\n", "\r\n").split("\r"):
            ended = piece.endswith("\n")
            piece = piece.strip()
            if not piece:
                continue
            state = piece.split(" [")[0]  # "desc:  40%|####      | 2/5"
            if state == self.last_state:
                continue  # tqdm redraws the same state when it closes a bar
            self.pending = piece
            now = time.monotonic()
            new_bar = state.split(":")[0] != self.last_state.split(":")[0]
            if ended or new_bar or "100%" in piece or now - self.last_logged >= self.every_s:
                self.emit(piece)
                self.pending, self.last_logged, self.last_state = "", now, state
        return len(text)

    def flush(self) -> None:
        """tqdm flushes after every update; the throttling above decides what is logged."""

    def finish(self) -> None:
        """Log a state that was throttled away (the block ended in the middle of a bar)."""
        if self.pending:
            self.emit(self.pending)
            self.pending = ""


@contextlib.contextmanager
def progress_in_log(every_s: float = EVERY_S) -> Iterator[None]:
    """Inside the block, standard error (tqdm's bars) goes to the Flower log at INFO."""
    stream = _BarsToLog(lambda line: log(INFO, "%s", line), every_s)
    try:
        with contextlib.redirect_stderr(stream):
            yield
    finally:
        stream.finish()
