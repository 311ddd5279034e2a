"""The wire format: a client rebuilds exactly the model and tokenizer the server holds."""

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

from fedunlearn.models.llama import load_local_causal_lm
from wire.messages import (
    decode_client_reply,
    describe_model,
    encode_client_reply,
    rebuild_model,
    rebuild_tokenizer,
)


def test_rebuilt_model_and_tokenizer_are_identical(tiny_model, tiny_tokenizer):
    config = ConfigRecord(describe_model(tiny_model, tiny_tokenizer))
    arrays = ArrayRecord(tiny_model.state_dict())
    model = rebuild_model(config, arrays)
    tokenizer = rebuild_tokenizer(config)
    text = "Question: Who wrote Hamlet?\nAnswer:"
    ids = tiny_tokenizer(text)["input_ids"]
    assert tokenizer(text)["input_ids"] == ids
    assert tokenizer.eos_token_id == tiny_tokenizer.eos_token_id
    assert tokenizer.pad_token_id == tiny_tokenizer.pad_token_id
    x = torch.tensor([ids])
    with torch.no_grad():
        assert torch.equal(model(x).logits, tiny_model(x).logits)


def test_rebuild_refuses_weights_of_another_shape(tiny_model, tiny_tokenizer):
    config = ConfigRecord(describe_model(tiny_model, tiny_tokenizer))
    state = tiny_model.state_dict()
    state["model.extra.weight"] = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="unexpected.*model.extra.weight"):
        rebuild_model(config, ArrayRecord(state))


def test_reply_roundtrip():
    tv = {"a.weight": torch.randn(3, 4), "b.weight": torch.randn(2, 2)}
    fisher = {k: v.abs() for k, v in tv.items()}
    content = encode_client_reply(
        role="forget",
        domain="tofu-forget",
        objective="ga",
        num_examples=4,
        task_vector=tv,
        fisher=fisher,
        metrics={"bytes-sent": 10.0},
    )
    update, metrics = decode_client_reply(42, content)
    assert update.node_id == 42 and update.role == "forget" and update.domain == "tofu-forget"
    assert update.num_examples == 4 and metrics["bytes-sent"] == 10.0
    assert all(torch.equal(update.task_vector[k], tv[k]) for k in tv)
    assert all(torch.equal(update.fisher[k], fisher[k]) for k in tv)


def test_reply_with_nan_names_client_and_tensor():
    tv = {"a.weight": torch.tensor([[1.0, float("nan")]])}
    content = encode_client_reply(
        role="retain",
        domain="retain",
        objective="nll",
        num_examples=1,
        task_vector=tv,
        fisher={"a.weight": torch.ones(1, 2)},
        metrics={},
    )
    with pytest.raises(ValueError, match="7.*a.weight"):
        decode_client_reply(7, content)


def test_local_checkpoint_loads_and_travels(tmp_path, tiny_model, tiny_tokenizer):
    """model.path: a checkpoint saved by the test loads offline and crosses the wire intact."""
    tiny_model.save_pretrained(tmp_path / "ckpt")
    tiny_tokenizer.save_pretrained(tmp_path / "ckpt")
    model, tokenizer = load_local_causal_lm(tmp_path / "ckpt")
    x = torch.tensor([tokenizer("Question: hi\nAnswer:")["input_ids"]])
    with torch.no_grad():
        assert torch.allclose(model(x).logits, tiny_model(x).logits, atol=1e-6)
    config = ConfigRecord(describe_model(model, tokenizer))
    rebuilt = rebuild_model(config, ArrayRecord(model.state_dict()))
    with torch.no_grad():
        assert torch.equal(rebuilt(x).logits, model(x).logits)


def test_local_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a folder"):
        load_local_causal_lm(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_local_causal_lm(tmp_path / "empty")


def test_training_statistics_travel_with_dashes_and_are_reported_with_underscores() -> None:
    """One spelling per side: ``wire_metrics`` names a client's statistics as they travel,
    the server's rules report them under the snake-case names of results.json."""
    from strategies.reply_fields import REPLY_METRICS, parse_metrics
    from wire.messages import wire_metrics

    stats = {"train_seconds": 1.5, "loss_first": 2.0, "loss_last": 1.0}
    sent = wire_metrics(stats)
    assert sent == {"train-seconds": 1.5, "loss-first": 2.0, "loss-last": 1.0}
    assert all("_" not in name for name in REPLY_METRICS)
    reported = parse_metrics(7, {"num-examples": 3, **sent}, REPLY_METRICS)
    assert {k: reported[k] for k in stats} == stats
