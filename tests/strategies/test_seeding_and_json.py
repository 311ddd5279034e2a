"""The one client-seed rule and the one JSON conversion the server and the tools share."""

import json
import math

import numpy as np
import pytest
import torch

from strategies.results import json_safe
from strategies.seeding import client_seed


def test_client_seeds_are_distinct_over_positions_and_rounds() -> None:
    assert client_seed(7, 0, 1) == 7000 and client_seed(7, 3, 1) == 7003
    assert client_seed(7, 0, 2) == 7000 + 1_000_003
    seeds = {client_seed(0, p, r) for p in range(1000) for r in range(1, 20)}
    assert len(seeds) == 1000 * 19
    with pytest.raises(ValueError, match="round >= 1"):
        client_seed(0, 0, 0)


def test_json_safe_names_non_finite_floats_or_nulls_them() -> None:
    value = {
        "epsilon": math.inf,
        1: [float("nan"), torch.tensor([1.5, -math.inf]), np.float32(2.0), (3, "x")],
    }
    assert json_safe(value) == {"epsilon": "inf", "1": ["nan", [1.5, "-inf"], 2.0, [3, "x"]]}
    nulled = json_safe(value, non_finite_as_null=True)
    assert nulled == {"epsilon": None, "1": [None, [1.5, None], 2.0, [3, "x"]]}
    json.dumps(nulled, allow_nan=False)
