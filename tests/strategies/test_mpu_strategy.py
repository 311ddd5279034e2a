"""What the MPU strategy puts on the wire, and how it maps replies back."""

import math
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from safetensors.torch import load_file

from fedunlearn.mpu import (
    HarmonicAggregator,
    derive_seed,
    invert_delta,
    invert_fisher,
    layer_groups,
    layer_sigmas,
    map_back,
    noisy_copy,
    perturbed_copies,
    sigma_per_tensor,
)
from fedunlearn.scenarios import ClientAssignment
from fedunlearn.upload_codec import LowRankDelta, encode_fisher, encode_task_vector
from strategies.copy_files import CopyFiles
from strategies.mpu_copies import CopySpool
from strategies.mpu_options import MPU_PUBLISH
from strategies.mpu_strategy import MpuStrategy
from strategies.node_roles import NodeDeclaration
from strategies.reply_validation import ReplyRejected
from strategies.settings import RunConfigError, RunSettings
from strategies.upload_spool import UploadSpool
from wire.delivery import (
    BASE_SHA_KEY,
    DELIVERY_KEY,
    DELTA,
    model_file_key,
    model_sha_key,
    record_digests,
    state_sha256,
    tensor_digest,
)
from wire.messages import decoded_arrays

NODE = 17


def _strategy(model, mode, copies=2, **kwargs):
    # the method as published unless a test asks for shared noise: the tests check its
    # zero-sum cancellation, which the default's shared noise η adds to
    kwargs.setdefault("shared_kappa", 0.0)
    strategy = MpuStrategy(
        merge="sum",
        model_config=model.config,
        secret=b"server-secret-for-tests",
        mode=mode,
        copies=copies,
        kappa=0.05,
        assignments=[ClientAssignment("forget", "d", (0, 1))],
        **kwargs,
    )
    strategy.node_assignment = {NODE: strategy.assignments[0]}
    return strategy


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_mpu_copies_never_equal_the_server_weights(tiny_model):
    state = _state(tiny_model)
    strategy = _strategy(tiny_model, "mpu", copies=3)
    content = strategy.node_content(1, 0, ArrayRecord(state), ConfigRecord({"x": 1}))
    assert content["config"]["mpu-copies"] == 3
    for k in range(3):
        sent = content[f"arrays-{k}"].to_torch_state_dict()
        assert sent.keys() == state.keys()
        for name, value in state.items():
            if ".layers." in name:  # every decoder-layer tensor is perturbed and hidden
                assert not torch.equal(sent[name], value), (k, name)
            else:  # embeddings, final norm, LM head: published as they are (docs/algorithms.md,
                # "Zero-sum noise")
                assert torch.equal(sent[name], value), (k, name)
    again = strategy.node_content(1, 0, ArrayRecord(state), ConfigRecord({}))
    assert torch.equal(  # keys derive from the secret: the same round gives the same copies
        again["arrays-1"].to_torch_state_dict()["model.layers.0.mlp.up_proj.weight"],
        content["arrays-1"].to_torch_state_dict()["model.layers.0.mlp.up_proj.weight"],
    )


def test_clean_sends_the_exact_weights_and_noised_one_noisy_copy(tiny_model):
    state = _state(tiny_model)
    clean = _strategy(tiny_model, "clean").node_content(1, 0, ArrayRecord(state), ConfigRecord())
    assert "arrays-1" not in clean
    sent = clean["arrays-0"].to_torch_state_dict()
    assert all(torch.equal(sent[k], v) for k, v in state.items())
    noised = _strategy(tiny_model, "noised").node_content(1, 0, ArrayRecord(state), ConfigRecord())
    sent = noised["arrays-0"].to_torch_state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    noise = sent[name] - state[name]
    rms = state[name].pow(2).mean().sqrt()
    assert 0 < noise.abs().max() and noise.std() < 0.2 * rms  # κ = 0.05 of the layer RMS


def _reply(updates, fishers):
    content = RecordDict(
        {
            "metrics": MetricRecord({"num-examples": 2}),
            "info": ConfigRecord({"role": "forget", "domain": "d", "objective": "ga"}),
        }
    )
    for k, (u, f) in enumerate(zip(updates, fishers, strict=True)):
        content[f"task_vector-{k}"] = ArrayRecord({n: t.contiguous() for n, t in u.items()})
        content[f"fisher-{k}"] = ArrayRecord({n: t.contiguous() for n, t in f.items()})
    return content


@pytest.mark.parametrize("copies", [2, 3])
def test_replies_map_back_and_cancel_the_noise_to_first_order(tiny_model, copies):
    """A client whose update is linear in what it received (Δ = −η·θ_pub) returns, after
    T⁻¹ and harmonic aggregation, exactly the noise-free update −η·θ."""
    state = _state(tiny_model)
    strategy = _strategy(tiny_model, "mpu", copies=copies)
    content = strategy.node_content(1, 0, ArrayRecord(state), ConfigRecord())
    names = [n for n in state if n.endswith("_proj.weight")]
    eta = 0.1
    update, fields = strategy.decode_reply(1, NODE, _linear_reply(content, names, copies, eta))
    assert fields["mpu_copies"] == copies and fields["num_examples"] == 2
    for name in names:
        expected = -eta * state[name]
        assert torch.allclose(update.task_vector[name], expected, atol=1e-6), name
        assert (update.fisher[name] >= 0).all()
    published = [content[f"arrays-{k}"].to_torch_state_dict() for k in range(copies)]
    plain = {n: sum(-eta * p[n] for p in published) / copies for n in names}  # no T⁻¹, weights
    assert max((plain[n] + eta * state[n]).abs().max() for n in names) > 1e-3


def test_task_vector_sigma_uses_the_pretrained_weights(tiny_model):
    """σ_ℓ = κ·RMS(θ_ℓ − θ_pretrained,ℓ) with ``sigma_reference``; κ·RMS(θ_ℓ) without."""
    state = _state(tiny_model)
    pretrained = {k: v + 0.01 * torch.ones_like(v) for k, v in state.items()}
    kwargs = dict(
        merge="sum",
        model_config=tiny_model.config,
        secret=b"s",
        kappa=0.05,
        assignments=[ClientAssignment("forget", "d", (0,))],
    )
    by_task = MpuStrategy(sigma_reference=pretrained, **kwargs)
    by_weights = MpuStrategy(**kwargs)
    for strategy in (by_task, by_weights):
        strategy.node_assignment = {NODE: strategy.assignments[0]}
    by_task.node_content(1, 0, ArrayRecord(state), ConfigRecord())
    by_weights.node_content(1, 0, ArrayRecord(state), ConfigRecord())
    assert by_task.report()["sigma_source"] == "task-vector"
    # θ − θ_pretrained is −0.01 everywhere: RMS 0.01 in every layer
    for layer, sigma in by_task.sigma_per_layer.items():
        assert sigma == pytest.approx(0.05 * 0.01, rel=1e-6), layer
    layer0 = [v for k, v in state.items() if k.startswith("model.layers.0.")]
    rms = torch.cat([v.flatten().double() for v in layer0]).pow(2).mean().sqrt().item()
    assert by_weights.sigma_per_layer[0] == pytest.approx(0.05 * rms, rel=1e-6)


def _linear_reply(content, names, copies, eta=0.1):
    """A client whose update is linear in what it received: Δ_k = −η·θ_pub,k."""
    updates, fishers = [], []
    for k in range(copies):
        published = content[f"arrays-{k}"].to_torch_state_dict()
        updates.append({n: -eta * published[n] for n in names})
        fishers.append({n: published[n] ** 2 for n in names})
    return _reply(updates, fishers)


def test_per_round_sends_one_set_of_copies_to_every_client(tiny_model):
    """mpu.publish=per-round: the copies are built once per round and sent to every client
    (the same arrays), drawn from keys of their own (not client 0's), fresh every round, and
    every client's reply maps back with them."""
    state, arrays = _state(tiny_model), ArrayRecord(_state(tiny_model))
    assignments = [ClientAssignment("forget", "d", (i,)) for i in range(3)]
    strategy = MpuStrategy(
        merge="sum",
        model_config=tiny_model.config,
        secret=b"server-secret-for-tests",
        copies=2,
        kappa=0.05,
        shared_kappa=0.0,  # the published method: its noise cancels exactly (checked below)
        publish="per-round",
        assignments=assignments,
    )
    strategy.node_assignment = {10 + i: a for i, a in enumerate(assignments)}
    sent = [strategy.node_content(1, p, arrays, ConfigRecord({"p": p})) for p in range(3)]
    for content in sent[1:]:
        for k in range(2):
            record, first = content[f"arrays-{k}"], sent[0][f"arrays-{k}"]
            assert list(record) == list(state)
            assert all(record[name] is first[name] for name in state)
    assert [c["config"]["p"] for c in sent] == [0, 1, 2]  # each client keeps its config
    assert strategy.report()["publish"] == "per-round"
    name = "model.layers.0.mlp.up_proj.weight"

    def weight(content, k=0):
        return content[f"arrays-{k}"].to_torch_state_dict()[name]

    client_zero = _strategy(tiny_model, "mpu").node_content(1, 0, arrays, ConfigRecord())
    assert not torch.equal(weight(client_zero), weight(sent[0]))
    assert not torch.equal(
        weight(strategy.node_content(2, 0, arrays, ConfigRecord())), weight(sent[0])
    )
    names = [n for n in state if n.endswith("_proj.weight")]
    for node in (10, 12):
        update, _ = strategy.decode_reply(1, node, _linear_reply(sent[0], names, 2))
        for n in names:
            assert torch.allclose(update.task_vector[n], -0.1 * state[n], atol=1e-6), (node, n)


def test_per_client_copies_differ_between_clients_and_keys_are_drawn_once(tiny_model):
    arrays = ArrayRecord(_state(tiny_model))
    strategy = MpuStrategy(
        merge="sum",
        model_config=tiny_model.config,
        secret=b"s",
        assignments=[ClientAssignment("forget", "d", (i,)) for i in range(2)],
    )
    strategy.node_assignment = {10 + i: a for i, a in enumerate(strategy.assignments)}
    first, second = (strategy.node_content(1, p, arrays, ConfigRecord()) for p in (0, 1))
    name = "model.layers.1.self_attn.v_proj.weight"
    assert not torch.equal(
        first["arrays-0"].to_torch_state_dict()[name],
        second["arrays-0"].to_torch_state_dict()[name],
    )
    assert strategy.copy_transforms(1, 1, 0) is strategy.copy_transforms(1, 1, 0)
    assert strategy.copy_transforms(1, 1, 0) is not strategy.copy_transforms(1, 0, 0)
    with pytest.raises(ValueError, match="mpu.publish must be one of"):
        MpuStrategy(
            merge="sum",
            model_config=tiny_model.config,
            secret=b"s",
            publish="per-node",
            assignments=[ClientAssignment("forget", "d", (0,))],
        )


def test_shared_noise_survives_the_servers_denoising_and_silences_the_warning(tiny_model):
    """mpu.shared-kappa: the linear client's update, mapped back and aggregated, is −η·(θ + η_s)
    with η_s of std κ_η·RMS (not cancelled, unlike ε⁰); without it the report carries the
    alignment warning, with it not; a clean run cannot take shared noise."""
    state = _state(tiny_model)
    plain = _strategy(tiny_model, "mpu")
    assert any("aligns its m copies" in w for w in plain.report()["warnings"])
    strategy = _strategy(tiny_model, "mpu", shared_kappa=0.05)
    report = strategy.report()
    assert report["shared_kappa"] == 0.05
    assert not any("aligns its m copies" in w for w in report["warnings"])
    content = strategy.node_content(1, 0, ArrayRecord(state), ConfigRecord())
    names = [n for n in state if n.endswith("_proj.weight")]
    update, _ = strategy.decode_reply(1, NODE, _linear_reply(content, names, 2, 0.1))
    name = "model.layers.0.mlp.up_proj.weight"
    layer = [n for n in state if n.startswith("model.layers.0.")]
    rms = (
        sum(float(state[n].pow(2).sum()) for n in layer) / sum(state[n].numel() for n in layer)
    ) ** 0.5
    shared = update.task_vector[name] / -0.1 - state[name]
    assert 0.8 * 0.05 * rms < float(shared.std()) < 1.2 * 0.05 * rms
    with pytest.raises(ValueError, match="mpu.shared-kappa needs mpu.mode='mpu'"):
        MpuStrategy(
            merge="sum",
            model_config=tiny_model.config,
            secret=b"s",
            mode="clean",
            shared_kappa=0.01,
            assignments=[ClientAssignment("forget", "d", (0,))],
        )


def test_the_default_shares_noise_of_the_copies_scale(tiny_model):
    """Left on its default (-1), shared-kappa is 1.5 κ in mpu mode (no alignment warning) and 0 in
    the one-copy baselines, which take it without an error; the run config resolves it the same
    way."""
    kwargs = {"merge": "sum", "model_config": tiny_model.config, "secret": b"s"}
    assignments = [ClientAssignment("forget", "d", (0,))]
    default = MpuStrategy(kappa=0.03, assignments=assignments, **kwargs)
    assert default.shared_kappa == pytest.approx(0.045)  # 1.5 κ
    assert not any("aligns its m copies" in w for w in default.report()["warnings"])
    for mode in ("clean", "noised"):
        assert MpuStrategy(mode=mode, assignments=assignments, **kwargs).shared_kappa == 0.0
    settings = RunSettings.from_run_config({"mpu.kappa": 0.02})
    assert settings.mpu.shared_kappa == -1.0
    assert settings.mpu.shared_noise_kappa() == pytest.approx(0.03)
    published = RunSettings.from_run_config({"mpu.shared-kappa": 0.0})
    assert published.mpu.shared_noise_kappa() == 0.0
    clean = RunSettings.from_run_config({"mpu.mode": "clean"})
    assert clean.mpu.shared_noise_kappa() == 0.0
    with pytest.raises(RunConfigError, match="mpu.shared-kappa"):
        RunSettings.from_run_config({"mpu.shared-kappa": -0.5})


def _old_copies(strategy, state, server_round=1, position=0):
    """The copies as the strategy built them from a whole state dict before it streamed them
    (σ from the state, the noise generator of the same key, every copy at once)."""
    groups = layer_groups(state.keys(), strategy.num_layers)
    rms = sigma_per_tensor(groups, layer_sigmas(state, groups, 1.0))
    gen = torch.Generator().manual_seed(
        derive_seed(strategy._secret, server_round, strategy._client_key(position), "noise")
    )
    sigmas = {n: strategy.kappa * v for n, v in rms.items()}
    if strategy.mode == "noised":
        noise = {n: torch.randn(state[n].shape, generator=gen).mul_(s) for n, s in sigmas.items()}
        return [noisy_copy(state, noise, 1.0)]
    transforms = [
        strategy.copy_transforms(server_round, position, k) for k in range(strategy.copies)
    ]
    shared = {n: strategy.shared_kappa * v for n, v in rms.items()}
    return perturbed_copies(state, sigmas, strategy.alphas, gen, transforms, shared_sigmas=shared)


@pytest.mark.parametrize(
    ("mode", "kwargs"), [("mpu", {}), ("mpu", {"shared_kappa": 0.02}), ("noised", {})]
)
def test_streamed_publishing_sends_the_whole_state_copies_bit_for_bit(tiny_model, mode, kwargs):
    """The copies are drawn and serialised one tensor at a time from the ArrayRecord; what is
    sent is bit for bit what building every copy from a state dict at once gave."""
    state = _state(tiny_model)
    strategy = _strategy(tiny_model, mode, copies=3, **kwargs)
    content = strategy.node_content(1, 0, ArrayRecord(state), ConfigRecord())
    expected = _old_copies(strategy, state)
    assert len(expected) == strategy.copies
    for k, copy in enumerate(expected):
        sent = content[f"arrays-{k}"].to_torch_state_dict()
        assert list(sent) == list(state)
        assert all(torch.equal(sent[n], copy[n]) for n in state), k
    assert strategy.bytes_to_clients[0] == strategy.copies * sum(
        v.numel() * v.element_size() for v in state.values()
    )


def _compact_reply(content, names, copies, rank=3):
    """Each copy's upload as a LoRA client sends it: factors (B from the copy's weights, so
    every copy differs) and a top-10 % Fisher, in that copy's coordinates."""
    gen = torch.Generator().manual_seed(5)
    reply = RecordDict(
        {
            "metrics": MetricRecord({"num-examples": 2}),
            "info": ConfigRecord({"role": "forget", "domain": "d", "objective": "ga"}),
        }
    )
    for k in range(copies):
        published = content[f"arrays-{k}"].to_torch_state_dict()
        factors, fisher = {}, {}
        for n in names:
            weight = published[n]
            a = torch.randn(rank, weight.shape[1], generator=gen)
            factors[n] = LowRankDelta(weight[:, :rank].contiguous(), a, 0.5)
            fisher[n] = weight.pow(2) + torch.rand(weight.shape, generator=gen)
        reply[f"task_vector-{k}"] = ArrayRecord(encode_task_vector(factors, "factors"))
        reply[f"fisher-{k}"] = ArrayRecord(encode_fisher(fisher, "topk", 0.1))
    return reply


def _old_map_back(strategy, reply, shapes, server_round=1, position=0, on_factors=True):
    """The update as the strategy formed it before it mapped back one weight at a time: every
    copy's whole task vector and Fisher mapped back, S₁ and ΣF in float64 over all weights;
    ``on_factors``: LoRA factors mapped before they are multiplied out (``map_back``), else the
    dense products mapped."""
    aggregator, fisher_sum = HarmonicAggregator(out_dtype=torch.float32), None
    for k, alpha in enumerate(strategy.alphas):
        transforms = strategy.copy_transforms(server_round, position, k)
        record = reply[f"task_vector-{k}"]
        if on_factors:
            record = ArrayRecord(map_back(record.to_torch_state_dict(), transforms))
            delta = decoded_arrays(record, shapes)
        else:
            delta = invert_delta(decoded_arrays(record, shapes), transforms)
        fisher = invert_fisher(decoded_arrays(reply[f"fisher-{k}"], shapes), transforms)
        aggregator.add(delta, alpha)
        if fisher_sum is None:
            fisher_sum = {n: f.double() for n, f in fisher.items()}
        else:
            for n, f in fisher.items():
                fisher_sum[n].add_(f)
    fisher_mean = {n: (f / len(strategy.alphas)).float() for n, f in fisher_sum.items()}
    return aggregator.result(), fisher_mean


@pytest.mark.parametrize("stream", [False, True])
def test_replies_map_back_one_weight_at_a_time_bit_for_bit(tiny_model, tmp_path, stream):
    """Compact uploads (factors, top-k Fisher) of three copies: the update, computed one
    weight at a time from the reply's arrays or (upload.stream) from the spooled copies after
    the reply's arrays are gone, equals bit for bit the whole-update aggregation."""
    state = _state(tiny_model)
    spool = UploadSpool(tmp_path / "spool") if stream else None
    strategy = _strategy(tiny_model, "mpu", copies=3, spool=spool)
    arrays = ArrayRecord(state)
    strategy.global_arrays = arrays
    content = strategy.node_content(1, 0, arrays, ConfigRecord())
    names = [n for n in state if n.endswith("_proj.weight")]
    reply = _compact_reply(content, names, 3)
    shapes = strategy.reply_spec(NODE).shapes
    expected_tv, expected_fisher = _old_map_back(strategy, reply, shapes)
    # the factors mapped before they are multiplied out: the dense products' inverse to rounding
    dense_tv, _ = _old_map_back(strategy, reply, shapes, on_factors=False)
    update, fields = strategy.decode_reply(1, NODE, reply)
    assert fields["mpu_copies"] == 3
    if stream:
        assert isinstance(strategy.spool, CopySpool)
        assert strategy.spool.store(update, None) is update  # already on disk
        files = sorted(p.name for p in (tmp_path / "spool" / "round-1").iterdir())
        assert files == [
            f"node-{NODE}-{kind}-{k}.safetensors"
            for kind in ("fisher", "task_vector")
            for k in range(3)
        ]
        for name in list(reply.array_records):  # what MergeStrategy does after store
            del reply[name]
    assert list(update.task_vector) == names and list(update.fisher) == names
    for n in names:
        assert torch.equal(update.task_vector[n], expected_tv[n]), n
        assert torch.allclose(update.task_vector[n], dense_tv[n], rtol=1e-5, atol=1e-7), n
        assert torch.equal(update.fisher[n], expected_fisher[n]), n
    assert strategy.report()["server_seconds"]["map_back"] > 0
    if stream:
        strategy.spool.clear()
        assert not (tmp_path / "spool").exists()


def test_a_copy_with_another_key_set_or_fisher_is_refused(tiny_model):
    state = _state(tiny_model)
    strategy = _strategy(tiny_model, "mpu")
    strategy.global_arrays = ArrayRecord(state)
    content = strategy.node_content(1, 0, strategy.global_arrays, ConfigRecord())
    names = [n for n in state if n.endswith("_proj.weight")]
    reply = _compact_reply(content, names, 2)
    del reply["fisher-1"]
    with pytest.raises(ReplyRejected, match="Fisher on some copies only"):
        strategy.decode_reply(1, NODE, reply)


def test_a_node_holding_the_base_gets_only_what_each_copy_changes(tiny_model):
    """With θ_base declared (ModelDelivery says the node gets the delta), copy k's record holds
    only its tensors that differ from θ_base — every decoder-layer tensor, none of the
    embeddings, final norm or LM head — and θ_base plus them hashes to model-sha256-<k>,
    the hash of the full copy a node without the base receives."""
    state = _state(tiny_model)
    arrays = ArrayRecord(state)
    assignments = [ClientAssignment("forget", "d", (i,)) for i in range(2)]
    for publish in MPU_PUBLISH:
        strategy = MpuStrategy(
            merge="sum",
            model_config=tiny_model.config,
            secret=b"server-secret-for-tests",
            kappa=0.05,
            publish=publish,
            assignments=assignments,
        )
        strategy.node_assignment = {10: assignments[0], 11: assignments[1]}
        base_sha = state_sha256(record_digests(arrays))
        strategy.delivery.declare({10: NodeDeclaration(10, base_sha256=base_sha)})
        strategy.delivery.start_round(1, arrays)
        delta, full = (strategy.node_content(1, p, arrays, ConfigRecord()) for p in (0, 1))
        config = delta["config"]
        assert config[DELIVERY_KEY] == DELTA and config[BASE_SHA_KEY] == base_sha
        assert DELIVERY_KEY not in full["config"]
        layer_keys = [n for n in state if ".layers." in n]
        for k in range(2):
            assert list(delta[f"arrays-{k}"]) == layer_keys
            rebuilt = {**state, **delta[f"arrays-{k}"].to_torch_state_dict()}
            digests = {n: tensor_digest(v.numpy()) for n, v in rebuilt.items()}
            assert state_sha256(digests) == config[model_sha_key(k)]
            if publish == "per-round":  # the same copies: the full record hashes alike
                assert record_digests(full[f"arrays-{k}"]) == digests
        sent = sum(
            v.numel() * v.element_size()
            for k in range(2)
            for v in delta[f"arrays-{k}"].to_torch_state_dict().values()
        )
        assert strategy.bytes_to_clients[0] == sent < strategy.bytes_to_clients[1]


def test_a_simulated_node_reads_its_copies_from_files_equal_to_the_message(tiny_model, tmp_path):
    """A node on the server's machine (``shared-machine``) holding θ_base gets no arrays: each
    copy's changed tensors lie in a file the message names, bit-identical to the record a
    deployed node gets, hashing to the same model-sha256-<k>; the files go with the run."""
    state = _state(tiny_model)
    arrays = ArrayRecord(state)
    assignments = [ClientAssignment("forget", "d", (i,)) for i in range(2)]
    base_sha = state_sha256(record_digests(arrays))
    for publish in MPU_PUBLISH:
        strategy = MpuStrategy(
            merge="sum",
            model_config=tiny_model.config,
            secret=b"server-secret-for-tests",
            kappa=0.05,
            publish=publish,
            assignments=assignments,
            copy_files=CopyFiles(tmp_path / publish),
        )
        strategy.node_assignment = {10: assignments[0], 11: assignments[1]}
        declarations = {
            10: NodeDeclaration(10, base_sha256=base_sha, shared_machine=True),
            11: NodeDeclaration(11, base_sha256=base_sha),
        }
        strategy.delivery.declare(declarations)
        strategy.delivery.start_round(1, arrays)
        by_file = strategy.node_content(1, 0, arrays, ConfigRecord())
        assert strategy.bytes_to_clients[0] == 0
        file_bytes = strategy.file_bytes_to_clients[0]
        # the same client's copies as a deployed node gets them (same position, same keys)
        strategy.node_assignment = {11: assignments[0], 10: assignments[1]}
        in_message = strategy.node_content(1, 0, arrays, ConfigRecord())
        assert strategy.bytes_to_clients[0] > 0
        strategy.node_assignment = {10: assignments[0], 11: assignments[1]}
        for k in range(2):
            path = Path(str(by_file["config"][model_file_key(k)]))
            assert len(by_file[f"arrays-{k}"]) == 0
            assert by_file["config"][model_sha_key(k)] == in_message["config"][model_sha_key(k)]
            stored = load_file(path)
            sent = in_message[f"arrays-{k}"].to_torch_state_dict()
            assert stored.keys() == sent.keys()
            assert all(torch.equal(stored[n], sent[n]) for n in sent)
        assert file_bytes == sum(
            math.prod(v.shape) * 4 for k in range(2) for v in in_message[f"arrays-{k}"].values()
        )
        assert any((tmp_path / publish).rglob("*.safetensors"))
        strategy.release_weights()
        assert not (tmp_path / publish).exists()
