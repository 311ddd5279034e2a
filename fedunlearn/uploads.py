"""Saving and loading client uploads, so one federated round can be re-merged offline.

A single-round merge (FIRM, FULM, TIES, ...) sees the clients' uploads only; the clients
trained from the same θ₀ whatever the merge or its γ. Re-merging saved uploads therefore
gives exactly the model a new Flower run with another merge setting would produce (up to
client-side randomness, which is seeded), at a fraction of the cost.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from safetensors.torch import load_file, save_file

from fedunlearn.merging import ClientUpdate

MANIFEST = "uploads.json"


def save_uploads(updates: Sequence[ClientUpdate], folder: Path) -> Path:
    """Write every update as ``client-<i>.safetensors`` plus a JSON manifest."""
    folder.mkdir(parents=True, exist_ok=True)
    manifest = []
    for i, update in enumerate(updates):
        tensors = {f"task_vector/{k}": v.contiguous() for k, v in update.task_vector.items()}
        if update.fisher is not None:
            tensors.update({f"fisher/{k}": v.contiguous() for k, v in update.fisher.items()})
        name = f"client-{i}.safetensors"
        save_file(tensors, str(folder / name))
        manifest.append(
            {
                "file": name,
                "node_id": str(update.node_id),
                "role": update.role,
                "domain": update.domain,
                "num_examples": update.num_examples,
                "has_fisher": update.fisher is not None,
            }
        )
    path = folder / MANIFEST
    path.write_text(json.dumps(manifest, indent=2))
    return path


def load_uploads(folder: Path) -> list[ClientUpdate]:
    """Read the updates written by :func:`save_uploads` (validated on construction)."""
    path = folder / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no {MANIFEST}: not a saved-uploads folder")
    updates = []
    for entry in json.loads(path.read_text()):
        tensors = load_file(str(folder / entry["file"]))
        task_vector = {
            k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("task_vector/")
        }
        fisher = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("fisher/")}
        updates.append(
            ClientUpdate(
                node_id=entry["node_id"],
                role=entry["role"],
                domain=entry["domain"],
                num_examples=int(entry["num_examples"]),
                task_vector=task_vector,
                fisher=fisher if entry["has_fisher"] else None,
            )
        )
    return updates
