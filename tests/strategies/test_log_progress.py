"""tqdm's bars inside the ServerApp reach the Flower log, throttled, with their final state."""

import logging
import sys

from tqdm import tqdm

from strategies.log_progress import _BarsToLog, progress_in_log


def _drive(stream: _BarsToLog, steps: int) -> None:
    for _ in tqdm(range(steps), desc="pre-training", file=stream, mininterval=0, unit="step"):
        pass


def test_every_state_when_not_throttled_and_only_first_and_last_when_throttled():
    lines: list[str] = []
    _drive(_BarsToLog(lines.append, every_s=0.0), 5)
    assert [line.split("|")[0].strip() for line in lines] == [
        f"pre-training: {p:>3}%" for p in (0, 20, 40, 60, 80, 100)
    ]
    lines.clear()
    _drive(_BarsToLog(lines.append, every_s=1e6), 5)
    assert len(lines) == 2  # the first state and the finished bar (redrawn once, logged once)
    assert lines[0].startswith("pre-training:   0%") and "| 5/5 [" in lines[1]


def test_stderr_goes_to_the_flower_log_inside_the_block_only(caplog):
    caplog.set_level(logging.INFO, logger="flwr")
    before = sys.stderr
    with progress_in_log(every_s=1e6):
        assert sys.stderr is not before
        for _ in tqdm(range(3), desc="knowledge fine-tune", mininterval=0):
            pass
        print("a warning on stderr", file=sys.stderr)
    assert sys.stderr is before
    messages = [r.getMessage() for r in caplog.records if r.name == "flwr"]
    assert any(m.startswith("knowledge fine-tune: 100%") for m in messages)
    assert "a warning on stderr" in messages
