"""The ``server`` option group: waiting for clients, and what the server accepts from them."""

from __future__ import annotations

from dataclasses import dataclass

from fedunlearn.options import (
    COUNT,
    NON_NEGATIVE,
    OFF_OR_AT_LEAST_ONE,
    POSITIVE,
    option,
    option_group,
)


@option_group("server")
@dataclass(frozen=True)
class ServerOptions:
    """Timeouts, reply validation and the robust options (``[tool.flwr.app.config.server]``)."""

    round_timeout: float = option(3600.0, "seconds to wait for a round's replies", POSITIVE)
    node_wait_timeout: float = option(120.0, "seconds to wait for the nodes to connect", POSITIVE)
    max_in_flight: int = option(
        0,
        "with upload.stream, at most this many nodes hold a round's message at a time (the "
        "next node's message is built and sent when a reply arrives): bounds the server's "
        "memory for MPU's per-node copies; 0 = every node at once",
        COUNT,
    )
    min_replies: int = option(
        0,
        "valid updates a round needs; 0 = one valid forget update per assigned forget domain",
        COUNT,  # its upper end (the run's clients) is checked by RunSettings
    )
    max_upload_mb: float = option(
        0.0,
        "upload limit per reply (MiB); 0 = the largest honest reply (a float64 task vector "
        "and Fisher for every weight, per MPU copy, plus 1 MiB of metadata)",
        NON_NEGATIVE,
    )
    robust_norm_bound: float = option(
        0.0,
        "clip each task vector to this × the median norm of its role's clients (>= 1; 0 = off)",
        OFF_OR_AT_LEAST_ONE,
    )
    fisher_cap: float = option(
        0.0,
        "cap a client's Fisher mass per tensor at this × its role's median (>= 1; 0 = off)",
        OFF_OR_AT_LEAST_ONE,
    )
    client_norm_ratio: float = option(
        100.0,
        "exclude a task vector whose norm is above this × its role's median (>= 1; 0 = off)",
        OFF_OR_AT_LEAST_ONE,
    )
    max_update_ratio: float = option(
        100.0,
        "fail a round whose merged update's norm exceeds this × the norm of the weights it "
        "changes (>= 1; 0 = off)",
        OFF_OR_AT_LEAST_ONE,
    )
