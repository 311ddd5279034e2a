"""The one rule by which the server derives every client's seed from the run's ``seed``."""

from __future__ import annotations

#: a prime stride between rounds, far above any client position, so no two (position, round)
#: pairs of a run share a seed
ROUND_STRIDE = 1_000_003


def client_seed(run_seed: int, position: int, server_round: int) -> int:
    """Seed of the client at ``position`` (0-based, in the round's node order) in
    ``server_round`` (1-based): ``run_seed·1000 + position + 1_000_003·(round − 1)``, so round 1
    gives ``run_seed·1000 + position``."""
    if position < 0 or server_round < 1:
        raise ValueError(f"position must be >= 0 and round >= 1, got {position}, {server_round}")
    return int(run_seed) * 1000 + position + ROUND_STRIDE * (server_round - 1)
