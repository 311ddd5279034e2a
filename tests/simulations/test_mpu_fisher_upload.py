"""The MPU Fisher-upload study's parts on the tiny model: exact without MPU, not under it."""

import torch
from flwr.app import ArrayRecord, ConfigRecord

from fedunlearn.mpu import parse_target
from fedunlearn.qa_format import encode_record
from fedunlearn.scenarios import ClientAssignment
from simulations.mpu_fisher_upload import (
    ALPHA,
    TARGETS,
    client_fishers,
    fractions,
    mapped_fisher,
    markdown,
    merge_error,
    per_kind,
    task_vectors,
)
from strategies.mpu_strategy import MpuStrategy


def test_top_alpha_uploads_are_exact_alone_but_not_under_mpu(tiny_model, tiny_tokenizer, tiny_data):
    roles = ("forget", "retain")
    qa = tiny_data.author_qa
    shards = [[encode_record(tiny_tokenizer, r) for r in qa[i * 6 : i * 6 + 6]] for i in (0, 1)]
    state = {k: v.detach().clone() for k, v in tiny_model.state_dict().items()}
    names = [k for k in state if (parse_target(k) or (0, ""))[1] in TARGETS]
    strategy = MpuStrategy(
        merge="firm",
        model_config=tiny_model.config,
        secret=b"fisher-upload-test",
        kappa=0.05,
        shared_kappa=0.0,  # the mapping's own error, without the default's shared noise
        assignments=[ClientAssignment(r, "d", (i,)) for i, r in enumerate(roles)],
    )
    strategy.node_assignment = {1: strategy.assignments[0], 2: strategy.assignments[1]}
    pad = tiny_tokenizer.pad_token_id
    plain, mpu = [], []
    for position, shard in enumerate(shards):
        content = strategy.node_content(1, position, ArrayRecord(state), ConfigRecord())
        copies = [content[f"arrays-{k}"].to_torch_state_dict() for k in range(2)]
        mpu.append(client_fishers(tiny_model, copies, shard, names, 2, pad))
        plain.append(client_fishers(tiny_model, [state], shard, names, 2, pad))
    deltas = task_vectors({k: tuple(state[k].shape) for k in names}, 2, 2, 0)
    errors = {}
    for wrapper, fishers, strat in (("none", plain, None), ("mpu", mpu, strategy)):
        dense = [mapped_fisher(f, strat, p, None) for p, f in enumerate(fishers)]
        for fraction in (ALPHA, 1.0):
            compact = [mapped_fisher(f, strat, p, fraction) for p, f in enumerate(fishers)]
            errors[wrapper, fraction] = merge_error(roles, deltas, dense, compact)
            if wrapper == "mpu" and fraction == ALPHA:
                kinds = per_kind(dense[0], compact[0])
    assert errors["none", ALPHA] == 0.0  # one client's own top-α: exact for α' ≥ α
    assert errors["none", 1.0] == 0.0 and errors["mpu", 1.0] == 0.0
    assert errors["mpu", ALPHA] > 0.0  # truncated in each copy's coordinates, then mixed
    assert set(kinds) == set(TARGETS)
    assert all(v["fisher_error"] > 0 for v in kinds.values())
    assert fractions()[0] == ALPHA and fractions()[-1] == 1.0
    # the server's average of the dense copies is a plain mean of the mapped-back diagonals
    assert all(torch.all(f >= 0) for f in dense[0].values())


def test_markdown_lists_every_fraction():
    rows = {f"{f:g}": {"error": 0.5, "per_kind_client_0": {}} for f in fractions()}
    per = {k: {"fisher_error": 0.1, "support_change": 0.2} for k in TARGETS}
    rows[f"{ALPHA:g}"]["per_kind_client_0"] = per
    results = {
        "config": {"copies": 2, "kappa": 0.01, "batches": 4},
        "weights": 14,
        "sets": {"single": {"rows": {"none": rows, "mpu": rows}}},
    }
    text = markdown(results)
    assert all(f"α' = {f:g}" in text for f in fractions())
    assert "| single | mpu |" in text and "| Fisher error |" in text
