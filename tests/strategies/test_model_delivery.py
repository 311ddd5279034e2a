"""A node that holds the base checkpoint is sent only the weights that differ from it."""

from collections.abc import Iterable

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from safetensors.torch import save_file

from clients.base_checkpoint import load_base, received_model
from clients.client_app import app as client_app
from fedunlearn.models.llama import new_tiny_llama
from fedunlearn.scenarios import ClientAssignment
from strategies.merge_strategy import MergeStrategy
from strategies.node_roles import declaration_from_record
from wire.delivery import (
    BASE_OFFER_KEY,
    BASE_SHA_KEY,
    DELIVERY_KEY,
    DELTA,
    MODEL_FILE_KEY,
    MODEL_SHA_KEY,
    model_digests,
    record_digests,
    state_sha256,
)
from wire.messages import describe_model, wire_state

ASSIGNMENTS = [ClientAssignment("forget", "d", (0, 1)), ClientAssignment("retain", "r", (2,))]
CHANGED = ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.v_proj.weight")


class ClientAppGrid:
    """Delivers QUERY messages to the real ClientApp, one node config and state per node."""

    def __init__(self, node_configs: dict[int, dict]) -> None:
        self.contexts = {
            node_id: Context(
                run_id=1, node_id=node_id, node_config=cfg, state=RecordDict(), run_config={}
            )
            for node_id, cfg in node_configs.items()
        }

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None):
        return [client_app(m, self.contexts[m.metadata.dst_node_id]) for m in messages]


@pytest.fixture()
def server_identity(monkeypatch):
    """Messages can only be created inside a Flower task: pretend to be the ServerApp."""
    for name in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, name, 1)


@pytest.fixture()
def checkpoints(tmp_path, tiny_model):
    """The server's base checkpoint and another model of the same shapes."""
    base, other = tmp_path / "base", tmp_path / "other"
    tiny_model.save_pretrained(base)
    new_tiny_llama(tiny_model.config, seed=1).save_pretrained(other)
    return base, other


def _strategy(tiny_model, tiny_tokenizer) -> MergeStrategy:
    return MergeStrategy(
        merge="sum",
        assignments=ASSIGNMENTS,
        client_config=describe_model(tiny_model, tiny_tokenizer),
    )


def _round_two(arrays: ArrayRecord) -> ArrayRecord:
    state = arrays.to_torch_state_dict()
    for key in CHANGED:
        state[key] = state[key] + 1e-3 * torch.randn_like(state[key])
    return ArrayRecord(state)


def test_node_hash_equals_the_servers_hash_of_its_initial_weights(checkpoints, tiny_model):
    base, _ = checkpoints
    assert load_base(base).sha256 == state_sha256(record_digests(wire_state(tiny_model)))


def test_only_changed_weights_go_to_the_node_holding_the_base(
    server_identity, checkpoints, tiny_model, tiny_tokenizer, caplog
):
    base, other = checkpoints
    grid = ClientAppGrid({5: {"base-checkpoint": str(base)}, 6: {"base-checkpoint": str(other)}})
    strategy = _strategy(tiny_model, tiny_tokenizer)
    arrays = wire_state(tiny_model)
    first = {
        m.metadata.dst_node_id: m for m in strategy.configure_train(1, arrays, ConfigRecord(), grid)
    }
    assert len(first[5].content["arrays"]) == 0  # round 1: nothing but the hash
    assert first[5].content["config"][DELIVERY_KEY] == DELTA
    assert len(first[6].content["arrays"]) == len(arrays)  # another base: the full model
    assert "node 6 gets the full model: its base-checkpoint has sha256" in caplog.text
    full, delta = strategy.delivery.report(6), strategy.delivery.report(5)
    assert full["model_delivery"] == "full" and delta["model_delivery"] == DELTA
    numel = sum(v.numel() for v in tiny_model.state_dict().values())
    assert delta["bytes_received_model"] == 0 and full["bytes_received_model"] >= 4 * numel
    # the delta node's config holds two more keys and hashes, nothing else
    assert 0 < delta["bytes_received_config"] - full["bytes_received_config"] < 300

    node = grid.contexts[5]
    rebuilt = received_model(first[5].content["config"], first[5].content["arrays"], node)
    assert all(torch.equal(v, tiny_model.state_dict()[k]) for k, v in rebuilt.state_dict().items())

    second_arrays = _round_two(arrays)
    second = {
        m.metadata.dst_node_id: m
        for m in strategy.configure_train(2, second_arrays, ConfigRecord(), grid)
    }
    sent = second[5].content["arrays"]
    assert sorted(sent) == sorted(CHANGED)
    rebuilt = received_model(second[5].content["config"], sent, node)
    expected = second_arrays.to_torch_state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in rebuilt.state_dict().items())
    by_round = strategy.delivery.report(5)["bytes_received_model_by_round"]
    changed_bytes = sum(4 * expected[k].numel() for k in CHANGED)
    assert by_round[0] == 0 and by_round[1] == pytest.approx(changed_bytes, abs=2 * 200)


def test_a_rebuilt_model_that_does_not_match_is_a_clear_error(
    server_identity, checkpoints, tiny_model, tiny_tokenizer
):
    base, _ = checkpoints
    grid = ClientAppGrid({5: {"base-checkpoint": str(base)}, 6: {}})
    strategy = _strategy(tiny_model, tiny_tokenizer)
    arrays = wire_state(tiny_model)
    messages = list(strategy.configure_train(1, arrays, ConfigRecord(), grid))
    message = next(m for m in messages if m.metadata.dst_node_id == 5)
    config, sent = message.content["config"], message.content["arrays"]
    wrong = ConfigRecord({**dict(config), MODEL_SHA_KEY: "0" * 64})
    with pytest.raises(ValueError, match=f"node 5: the model rebuilt from base checkpoint {base}"):
        received_model(wrong, sent, grid.contexts[5])
    wrong = ConfigRecord({**dict(config), BASE_SHA_KEY: "1" * 64})
    with pytest.raises(ValueError, match=f"node 5: base checkpoint {base} has sha256"):
        received_model(wrong, sent, grid.contexts[5])
    with pytest.raises(ValueError, match="node 6: .* declares no base-checkpoint"):
        received_model(config, sent, grid.contexts[6])


def test_unreadable_or_malformed_bases_get_the_full_model_and_keep_their_role(
    server_identity, checkpoints, tiny_model, tiny_tokenizer, tmp_path, caplog
):
    base, _ = checkpoints
    grid = ClientAppGrid(
        {5: {"base-checkpoint": str(tmp_path / "missing")}, 6: {"base-checkpoint": str(base)}}
    )
    strategy = _strategy(tiny_model, tiny_tokenizer)
    messages = list(strategy.configure_train(1, wire_state(tiny_model), ConfigRecord(), grid))
    assert [
        strategy.delivery.report(m.metadata.dst_node_id)["model_delivery"] for m in messages
    ] == [
        "full",
        DELTA,
    ]
    assert "node 5 gets the full model: its base-checkpoint cannot be used" in caplog.text
    assert "no config.json" in caplog.text
    declaration = declaration_from_record(7, ConfigRecord({"role": "forget", BASE_SHA_KEY: "x"}))
    assert declaration.role == "forget" and declaration.base_sha256 is None
    assert "is no sha256" in declaration.base_problem


def test_a_resumed_run_sends_the_full_model_and_says_why(
    server_identity, checkpoints, tiny_model, tiny_tokenizer, caplog
):
    base, _ = checkpoints
    grid = ClientAppGrid({5: {"base-checkpoint": str(base)}, 6: {}})
    strategy = _strategy(tiny_model, tiny_tokenizer)
    strategy.round_offset = 1
    messages = list(strategy.configure_train(1, wire_state(tiny_model), ConfigRecord(), grid))
    assert all(len(m.content["arrays"]) == len(tiny_model.state_dict()) for m in messages)
    assert "node 5 gets the full model: the strategy starts at round 2 (a resumed" in caplog.text
    assert "node 6 gets the full model: it declares no base-checkpoint" in caplog.text


def test_a_later_strategy_given_the_runs_initial_digests_sends_only_what_changed(
    server_identity, checkpoints, tiny_model, tiny_tokenizer
):
    """A resumed run or a schedule's next round: the new strategy compares with θ_base too."""
    base, _ = checkpoints
    grid = ClientAppGrid({5: {"base-checkpoint": str(base)}, 6: {}})
    strategy = MergeStrategy(
        merge="sum",
        assignments=ASSIGNMENTS,
        client_config=describe_model(tiny_model, tiny_tokenizer),
        round_offset=1,
        base_digests=model_digests(tiny_model),
    )
    round_two = _round_two(wire_state(tiny_model))
    sent = {
        m.metadata.dst_node_id: m.content
        for m in strategy.configure_train(1, round_two, ConfigRecord(), grid)
    }
    assert sorted(sent[5]["arrays"]) == sorted(CHANGED)
    assert len(sent[6]["arrays"]) == len(round_two)  # declares no base: the full model
    rebuilt = received_model(sent[5]["config"], sent[5]["arrays"], grid.contexts[5])
    expected = round_two.to_torch_state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in rebuilt.state_dict().items())


def test_without_any_base_one_line_says_so(server_identity, tiny_model, tiny_tokenizer, caplog):
    strategy = _strategy(tiny_model, tiny_tokenizer)
    grid = ClientAppGrid({5: {}, 6: {}})
    for server_round in (1, 2):
        list(strategy.configure_train(server_round, wire_state(tiny_model), ConfigRecord(), grid))
    assert caplog.text.count("full model") == 1
    assert "every node gets the full model: none declares a base-checkpoint" in caplog.text


def test_float32_deltas_are_not_always_exact_so_values_are_sent():
    """θ_base + (θ_round − θ_base) in float32 is θ_round for most entries but not all (an
    update that nearly cancels a weight loses the rest): the delivery sends the changed
    weights' values, the same bytes as a float32 delta, and exact."""
    base, new = torch.tensor([0.5, 0.02]), torch.tensor([1e-9, 0.0201])
    assert torch.equal(base + (new - base), torch.tensor([0.0, 0.0201]))


SIMULATED = {"partition-id": 0, "num-partitions": 2}


def _offering_strategy(tiny_model, tiny_tokenizer, offer, delivery="auto") -> MergeStrategy:
    return MergeStrategy(
        merge="sum",
        assignments=ASSIGNMENTS,
        client_config=describe_model(tiny_model, tiny_tokenizer),
        base_offer=str(offer),
        delivery=delivery,
    )


def test_simulated_nodes_take_the_servers_checkpoint_and_deployed_nodes_do_not(
    server_identity, checkpoints, tiny_model, tiny_tokenizer, caplog
):
    base, _ = checkpoints
    # node 5: a virtual node of a simulation; node 6: a SuperNode with its own node config
    grid = ClientAppGrid({5: dict(SIMULATED), 6: {"partition-id": 1, "zone": "eu"}})
    strategy = _offering_strategy(tiny_model, tiny_tokenizer, base)
    arrays = wire_state(tiny_model)
    sent = {
        m.metadata.dst_node_id: m for m in strategy.configure_train(1, arrays, ConfigRecord(), grid)
    }
    assert strategy.delivery.report(5)["model_delivery"] == DELTA
    assert strategy.delivery.report(5)["bytes_received_model"] == 0
    assert strategy.delivery.report(6)["model_delivery"] == "full"  # deployment: opt-in only
    assert "node 6 gets the full model: it declares no base-checkpoint" in caplog.text
    config = sent[5].content["config"]
    assert config[BASE_OFFER_KEY] == str(base)
    rebuilt = received_model(config, sent[5].content["arrays"], grid.contexts[5])
    assert all(torch.equal(v, tiny_model.state_dict()[k]) for k, v in rebuilt.state_dict().items())


def test_an_offer_the_node_cannot_read_gets_the_full_model(
    server_identity, tiny_model, tiny_tokenizer, tmp_path, caplog
):
    grid = ClientAppGrid({5: dict(SIMULATED), 6: dict(SIMULATED)})
    strategy = _offering_strategy(tiny_model, tiny_tokenizer, tmp_path / "not-here")
    list(strategy.configure_train(1, wire_state(tiny_model), ConfigRecord(), grid))
    assert {strategy.delivery.report(n)["model_delivery"] for n in (5, 6)} == {"full"}
    assert "node 5 gets the full model: its base-checkpoint cannot be used" in caplog.text
    assert "not-here is not a checkpoint folder (no config.json)" in caplog.text


def test_delivery_full_sends_the_whole_model_to_nodes_holding_the_base(
    server_identity, checkpoints, tiny_model, tiny_tokenizer, caplog
):
    base, _ = checkpoints
    grid = ClientAppGrid({5: dict(SIMULATED), 6: {"base-checkpoint": str(base)}})
    strategy = _offering_strategy(tiny_model, tiny_tokenizer, base, delivery="full")
    arrays = wire_state(tiny_model)
    messages = list(strategy.configure_train(1, arrays, ConfigRecord(), grid))
    assert all(len(m.content["arrays"]) == len(arrays) for m in messages)
    assert {strategy.delivery.report(n)["model_delivery"] for n in (5, 6)} == {"full"}
    assert "every node gets the full model: model.delivery='full'" in caplog.text


def test_a_simulated_node_rebuilds_its_model_from_a_file_and_refuses_a_damaged_one(
    checkpoints, tiny_model, tmp_path
):
    """``model-file``: the weights that differ from θ_base lie in a file the server wrote. A
    simulated node rebuilds the server's model from it; a deployed node never reads a file a
    message names; a file changed on disk fails the hash check, naming the node and the file."""
    base, _ = checkpoints
    round_two = _round_two(wire_state(tiny_model))
    state = round_two.to_torch_state_dict()
    path = tmp_path / "copy.safetensors"
    save_file({key: state[key] for key in CHANGED}, str(path))
    config = ConfigRecord(
        {
            DELIVERY_KEY: DELTA,
            BASE_SHA_KEY: load_base(base).sha256,
            MODEL_SHA_KEY: state_sha256(record_digests(round_two)),
            MODEL_FILE_KEY: str(path),
            BASE_OFFER_KEY: str(base),
        }
    )

    def context(node_id: int, node_config: dict) -> Context:
        return Context(
            run_id=1, node_id=node_id, node_config=node_config, state=RecordDict(), run_config={}
        )

    rebuilt = received_model(config, ArrayRecord(), context(5, dict(SIMULATED)))
    assert all(torch.equal(v, state[k]) for k, v in rebuilt.state_dict().items())
    deployed = context(6, {"partition-id": 1, "base-checkpoint": str(base)})
    with pytest.raises(ValueError, match=r"node 6: the server named a file \(.*copy"):
        received_model(config, ArrayRecord(), deployed)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40  # one bit of the last weight
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"node 5: the model rebuilt .* \(file .*copy"):
        received_model(config, ArrayRecord(), context(5, dict(SIMULATED)))
    path.unlink()
    with pytest.raises(ValueError, match=r"node 5: cannot read the model file .*copy"):
        received_model(config, ArrayRecord(), context(5, dict(SIMULATED)))
