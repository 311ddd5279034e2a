"""A client's own data: the scenario rebuilt from the message, and its shard of records."""

from __future__ import annotations

import dataclasses
import functools
import json

from flwr.app import ConfigRecord, Context

from fedunlearn.scenarios import Scenario, ScenarioParams, get_scenario


@functools.lru_cache(maxsize=4)
def _scenario(name: str, params: ScenarioParams) -> Scenario:
    return get_scenario(name)(params)


def client_scenario(config: ConfigRecord, context: Context) -> Scenario:
    """The scenario rebuilt from the message (the client's local copy of the benchmark).

    A ``data-path`` in the node config (deployment: each machine's own files) takes
    precedence over the one in the message.
    """
    params = ScenarioParams(**json.loads(str(config["scenario-params-json"])))
    data_path = str(context.node_config.get("data-path", params.data_path))
    return _scenario(str(config["scenario"]), dataclasses.replace(params, data_path=data_path))


def shard(records: list[dict], indices: list[int], what: str) -> list[dict]:
    """``records[i]`` for every index, with a clear error for indices out of range."""
    bad = [i for i in indices if not 0 <= i < len(records)]
    if bad:
        raise IndexError(f"{what} indices {bad[:5]} are outside the {len(records)} records")
    return [records[i] for i in indices]
