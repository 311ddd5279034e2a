"""MPU as a Flower strategy: clients unlearn perturbed, reparameterised copies (SPEC §3).

Per round and client the server publishes m copies θ_pub,k = T_k(θ + α_k ε⁰_k) and never
the exact weights; the client runs its objective (LoRA) on every copy and returns each
task vector and Fisher diagonal in that copy's coordinates; the server maps them back
(Δ̂_k = T_k⁻¹(Δ_k)), aggregates them harmonically per client (Δ̄ = S₁/S₀, streaming), hands
one ``ClientUpdate`` per client to the wrapped merge and sets θ ← θ + η_srv·Δ. Keys come from
the server secret per (round, client, copy, layer) and never leave the server.

Baselines through the same code path: ``clean`` (one exact copy) and ``noised`` (one copy
θ + ε, no reparameterisation, no denoising).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from logging import WARNING
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from flwr.common.logger import log

from clients.messages import decode_client_reply
from fedunlearn.merging import ClientUpdate
from fedunlearn.mpu import (
    HarmonicAggregator,
    alphas,
    apply_transform,
    derive_seed,
    draw_transforms,
    invert_delta,
    invert_fisher,
    layer_groups,
    layer_sigmas,
    noisy_copy,
    plan_reparam,
    sigma_per_tensor,
    zero_sum_noise,
)
from strategies.merge_strategy import MergeStrategy
from strategies.reply_validation import ReplyRejected, validate_reply_content
from strategies.results import json_safe

MPU_MODES = ("mpu", "clean", "noised")


class MpuStrategy(MergeStrategy):
    """MPU around any registered merge (see the module docstring).

    Parameters (besides those of :class:`MergeStrategy`, whose ``merge`` is the wrapped one)
    ----------
    model_config : Any
        The model's Hugging Face config (heads, KV heads, head_dim, intermediate size, layers).
    secret : bytes
        The server secret all noise and reparameterisation keys derive from.
    mode : str (default: "mpu")
        ``mpu``, ``clean`` or ``noised``.
    copies : int (default: 2)
        m, copies per client and round (``mpu`` only; the baselines use one).
    kappa : float (default: 0.01)
        κ in σ_ℓ = κ·RMS(layer ℓ's weights).
    permute_groups : bool (default: True)
        Also permute whole KV groups (the paper's extra step the reference code omits).
    sigma_reference : Mapping[str, torch.Tensor] | None (default: None)
        θ_pretrained: when given, σ_ℓ = κ·RMS(θ_ℓ − θ_pretrained,ℓ) (the task-vector variant of
        SPEC §3, as in the reference code) instead of κ·RMS(θ_ℓ).
    """

    def __init__(
        self,
        *,
        model_config: Any,
        secret: bytes,
        mode: str = "mpu",
        copies: int = 2,
        kappa: float = 0.01,
        permute_groups: bool = True,
        sigma_reference: Mapping[str, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if mode not in MPU_MODES:
            raise ValueError(f"mpu-mode must be one of {MPU_MODES}, got {mode!r}")
        if mode == "mpu" and copies < 2:
            raise ValueError(f"MPU needs mpu-copies >= 2 (zero-sum noise), got {copies}")
        if kappa < 0:
            raise ValueError(f"mpu-kappa must be >= 0, got {kappa}")
        self.mode = mode
        self.copies = copies if mode == "mpu" else 1
        self.kappa = kappa
        self.permute_groups = permute_groups
        self.sigma_reference = sigma_reference
        # refuses an architecture T would silently break (naming the module / config field)
        # here, before any copy is built; clean / noised copies are not reparameterised
        self.reparam = (
            plan_reparam(model_config, permute_groups=permute_groups) if mode == "mpu" else None
        )
        for warning in self.reparam.warnings if self.reparam is not None else ():
            log(WARNING, "MPU: %s", warning)
        self.dims = self.reparam.dims if self.reparam is not None else None
        self.num_layers = int(model_config.num_hidden_layers)
        self._secret = secret
        self.alphas = alphas(self.copies)
        self.bytes_to_clients: dict[int, int] = {}
        self.seconds = {"publish": 0.0, "map_back": 0.0}  # server pre- and post-processing
        # θ of the round being published and its per-tensor σ (the same for every client)
        self._round_state: tuple[int, dict[str, torch.Tensor], dict[str, float]] | None = None
        self.sigma_per_layer: dict[int, float] = {}  # σ_ℓ of the last published round

    # ---- keys ------------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """What results.json records about MPU (never the secret or any key)."""
        return {
            "mode": self.mode,
            "copies": self.copies,
            "kappa": self.kappa,
            "alphas": list(self.alphas),
            "permute_groups": self.permute_groups,
            "sigma_source": "weights" if self.sigma_reference is None else "task-vector",
            "sigma_per_layer": dict(self.sigma_per_layer),
            "server_seconds": dict(self.seconds),
            "bytes_to_client_last_round": dict(self.bytes_to_clients),
            "reparam": self.reparam.describe() if self.reparam is not None else None,
            "warnings": list(self.reparam.warnings) if self.reparam is not None else [],
        }

    def round_record(self) -> dict[str, Any]:
        """The base record plus ``mpu`` (``report()``; never the secret)."""
        return {**super().round_record(), "mpu": json_safe(self.report())}

    def _transforms(self, server_round: int, position: int, copy: int):
        return draw_transforms(
            self.dims,
            self._secret,
            server_round,
            position * 1000 + copy,
            self.num_layers,
            permute_groups=self.permute_groups,
        )

    def _state_and_sigmas(
        self, server_round: int, arrays: ArrayRecord
    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """θ as tensors and σ per perturbed tensor, computed once per round."""
        if self._round_state is None or self._round_state[0] != server_round:
            state = arrays.to_torch_state_dict()
            groups = layer_groups(state.keys(), self.num_layers)
            per_layer = layer_sigmas(state, groups, self.kappa, reference=self.sigma_reference)
            sigmas = sigma_per_tensor(groups, per_layer)
            self.sigma_per_layer = per_layer
            self._round_state = (server_round, state, sigmas)
        return self._round_state[1], self._round_state[2]

    def _noise(
        self,
        server_round: int,
        position: int,
        state: Mapping[str, torch.Tensor],
        sigmas: Mapping[str, float],
    ) -> list[dict[str, torch.Tensor]]:
        """ε⁰_1..ε⁰_m for this client and round (``noised``: one plain Gaussian draw)."""
        shapes = {name: state[name].shape for name in sigmas}
        gen = torch.Generator().manual_seed(
            derive_seed(self._secret, server_round, position, "noise")
        )
        if self.mode == "mpu":
            return zero_sum_noise(shapes, sigmas, self.copies, gen)
        return [
            {
                name: torch.randn(shape, generator=gen, dtype=torch.float64)
                .mul_(sigmas[name])
                .to(torch.float32)
                for name, shape in shapes.items()
            }
        ]

    # ---- hooks of MergeStrategy --------------------------------------------------------------

    def node_content(
        self, server_round: int, position: int, arrays: ArrayRecord, node_config: ConfigRecord
    ) -> RecordDict:
        """m published copies for this node instead of the exact weights."""
        started = time.perf_counter()
        try:
            return self._publish(server_round, position, arrays, node_config)
        finally:
            self.seconds["publish"] += time.perf_counter() - started

    def _publish(
        self, server_round: int, position: int, arrays: ArrayRecord, node_config: ConfigRecord
    ) -> RecordDict:
        state, sigmas = self._state_and_sigmas(server_round, arrays)
        config = ConfigRecord({**dict(node_config), "mpu-copies": self.copies})
        content = RecordDict({"config": config})
        if self.mode == "clean":
            content["arrays-0"] = arrays
            self.bytes_to_clients[position] = _nbytes(state)
            return content
        noise = self._noise(server_round, position, state, sigmas)
        total = 0
        for k, (eps0, alpha) in enumerate(zip(noise, self.alphas, strict=True)):
            published = noisy_copy(state, eps0, alpha)
            if self.mode == "mpu":
                published = apply_transform(published, self._transforms(server_round, position, k))
            content[f"arrays-{k}"] = ArrayRecord(
                {name: t.contiguous() for name, t in published.items()}
            )
            total += _nbytes(published)
        self.bytes_to_clients[position] = total
        return content

    def decode_reply(
        self, server_round: int, node_id: int, content: RecordDict
    ) -> tuple[ClientUpdate, dict[str, Any]]:
        """Map every copy's task vector and Fisher back and aggregate them harmonically."""
        started = time.perf_counter()
        try:
            return self._map_back(server_round, node_id, content)
        finally:
            self.seconds["map_back"] += time.perf_counter() - started

    def _map_back(
        self, server_round: int, node_id: int, content: RecordDict
    ) -> tuple[ClientUpdate, dict[str, Any]]:
        position = list(self.node_assignment).index(node_id)
        aggregator = HarmonicAggregator()
        fisher_sum: dict[str, torch.Tensor] | None = None
        first_update, fields = None, {}
        for k, alpha in enumerate(self.alphas):
            copy_content = _copy_reply(content, k, node_id)
            # every copy is checked in its own coordinates before T⁻¹ touches it
            spec = self.reply_spec(node_id)
            fields = validate_reply_content(f"{node_id} copy {k}", copy_content, spec)
            update, _ = decode_client_reply(node_id, copy_content, spec.shapes)
            if first_update is not None and (update.fisher is None) != (fisher_sum is None):
                raise ReplyRejected(f"{node_id} copy {k}", "sent a Fisher on some copies only")
            if (
                first_update is not None
                and update.task_vector.keys() != first_update.task_vector.keys()
            ):
                raise ReplyRejected(f"{node_id} copy {k}", "sent another key set than copy 0")
            first_update = first_update or update
            delta, fisher = update.task_vector, update.fisher
            if self.mode == "mpu":
                transforms = self._transforms(server_round, position, k)
                delta = invert_delta(delta, transforms)
                fisher = invert_fisher(fisher, transforms) if fisher is not None else None
            aggregator.add(delta, alpha)
            if fisher is not None:
                fisher_sum = (
                    {n: f.double() for n, f in fisher.items()}
                    if fisher_sum is None
                    else {n: fisher_sum[n] + f.double() for n, f in fisher.items()}
                )
        if first_update is None:
            raise ValueError(f"client {node_id}: reply holds no copy")
        combined = ClientUpdate(
            node_id=node_id,
            role=first_update.role,
            domain=first_update.domain,
            num_examples=first_update.num_examples,
            task_vector={n: t.float() for n, t in aggregator.result().items()},
            fisher=(
                {n: (f / len(self.alphas)).float() for n, f in fisher_sum.items()}
                if fisher_sum is not None
                else None
            ),
        )
        fields.update(
            mpu_copies=len(self.alphas), bytes_received=self.bytes_to_clients.get(position, 0)
        )
        return combined, fields


def _copy_reply(content: RecordDict, k: int, node_id: int) -> RecordDict:
    """Copy k's part of a multi-copy reply as an ordinary single reply."""
    key = f"task_vector-{k}"
    if key not in content:
        raise ValueError(f"client {node_id}: reply has no {key!r} record (copy {k} missing)")
    for name in ("metrics", "info"):
        if name not in content:
            raise ValueError(f"client {node_id}: reply has no {name!r} record")
    out = RecordDict({"task_vector": content[key], "metrics": content["metrics"]})
    out["info"] = content["info"]
    if f"fisher-{k}" in content:
        out["fisher"] = content[f"fisher-{k}"]
    return out


def _nbytes(state: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())
