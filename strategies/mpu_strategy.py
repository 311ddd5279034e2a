"""MPU as a Flower strategy: clients unlearn perturbed, reparameterised copies
(docs/algorithms.md, "MPU").

Per round and client the server publishes m copies θ_pub,k = T_k(θ + α_k ε⁰_k) and never
the exact weights; the client runs its objective (LoRA) on every copy and returns each
task vector and Fisher diagonal in that copy's coordinates; the server maps them back
(Δ̂_k = T_k⁻¹(Δ_k)), aggregates them harmonically per client (Δ̄ = S₁/S₀, streaming), hands
one ``ClientUpdate`` per client to the wrapped merge and sets θ ← θ + η_srv·Δ. Keys come from
the server secret per (round, client, copy, layer) and never leave the server.

``publish="per-round"`` (``mpu.publish``) draws ε⁰_k and T_k per (round, copy) instead and
sends the same m copies to every client of the round, built once. For the server's weights
that is no weaker: a coalition of clients then holds m copies of θ instead of m per member,
and one client's view is unchanged (the same law of copies). What changes: the copies no
longer identify the client they were sent to (a leaked copy cannot be traced to one client);
every client's upload is in the same secret coordinates, so uploads of two clients can be
compared without undoing T (only the server and the client itself should see an upload); and
the noise, hence the second-order remainder the harmonic aggregate leaves, is the same for
every client, so it no longer averages out across clients in the merge.

Baselines through the same code path: ``clean`` (one exact copy) and ``noised`` (one copy
θ + ε, no reparameterisation, no denoising).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from logging import WARNING
from typing import Any, cast

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from flwr.common.logger import log

from fedunlearn.merging import ClientUpdate
from fedunlearn.mpu import (
    HarmonicUpload,
    LayerTransform,
    UploadParts,
    alphas,
    derive_seed,
    draw_transforms,
    layer_groups,
    layer_sigmas,
    noised_tensors,
    plan_reparam,
    published_tensors,
    sigma_per_tensor,
)
from strategies.copy_files import CopyFiles
from strategies.merge_strategy import MergeStrategy
from strategies.mpu_copies import (
    CopyFile,
    CopySpool,
    PublishedCopy,
    RecordTensors,
    copy_reply,
    exact_tensors,
    payload_nbytes,
)
from strategies.mpu_options import (
    ALIGNMENT_WARNING,
    MPU_MODES,
    MPU_PUBLISH,
    SHARED_KAPPA_AUTO,
    resolve_shared_kappa,
)
from strategies.reply_validation import ReplyRejected, validate_reply_content
from strategies.results import json_safe
from wire.arrays import weight_array
from wire.delivery import (
    BASE_OFFER_KEY,
    BASE_SHA_KEY,
    DELIVERY_KEY,
    DELTA,
    model_file_key,
    model_sha_key,
    state_sha256,
    weight_digest,
)

TransformSet = dict[int, LayerTransform]  # T_k: one transform per decoder layer


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
    publish : str (default: "per-client")
        ``per-client``: noise and T_k drawn per (round, client, copy); ``per-round``: per
        (round, copy), one set of copies built once and sent to every client of the round
        (what that changes: the module docstring).
    kappa : float (default: 0.01)
        κ in σ_ℓ = κ·RMS(layer ℓ's weights).
    shared_kappa : float (default: -1.0)
        κ_η of a noise η (σ = κ_η·RMS(layer ℓ)) common to all m copies of a client,
        T_k(θ + η + α_k ε⁰_k): what a client that aligns its copies cannot average away, and
        what the server's harmonic aggregate does not cancel either (``mpu`` only). -1 (the
        default) = 1.5·``kappa`` in ``mpu`` mode, 0 in ``clean`` / ``noised``; 0 = none, the
        method as published — with a warning, see the MPU threat model in the docs.
    permute_groups : bool (default: True)
        Also permute whole KV groups (the paper's extra step the reference code omits).
    sigma_reference : Mapping[str, torch.Tensor] | None (default: None)
        θ_pretrained: when given, σ_ℓ = κ·RMS(θ_ℓ − θ_pretrained,ℓ) (the task-vector variant of
        docs/algorithms.md, "Zero-sum noise", as in the reference code) instead of κ·RMS(θ_ℓ).
    copy_files : CopyFiles | None (default: None)
        Where copies for the nodes on the server's machine are written instead of sent
        (``strategies.copy_files``): a simulated node that holds θ_base gets its copies'
        changed weights as files; None: every copy travels in the message.
    """

    def __init__(
        self,
        *,
        model_config: Any,
        secret: bytes,
        mode: str = "mpu",
        copies: int = 2,
        publish: str = "per-client",
        kappa: float = 0.01,
        permute_groups: bool = True,
        shared_kappa: float = SHARED_KAPPA_AUTO,
        sigma_reference: Mapping[str, torch.Tensor] | None = None,
        copy_files: CopyFiles | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if mode not in MPU_MODES:
            raise ValueError(f"mpu.mode must be one of {MPU_MODES}, got {mode!r}")
        if mode == "mpu" and copies < 2:
            raise ValueError(f"MPU needs mpu.copies >= 2 (zero-sum noise), got {copies}")
        if kappa < 0:
            raise ValueError(f"mpu.kappa must be >= 0, got {kappa}")
        shared_kappa = resolve_shared_kappa(shared_kappa, mode, kappa)
        if not math.isfinite(shared_kappa) or shared_kappa < 0:
            raise ValueError(f"mpu.shared-kappa must be finite and >= 0, got {shared_kappa}")
        if shared_kappa > 0 and mode != "mpu":
            raise ValueError(f"mpu.shared-kappa needs mpu.mode='mpu', got {mode!r}")
        if publish not in MPU_PUBLISH:
            raise ValueError(f"mpu.publish must be one of {MPU_PUBLISH}, got {publish!r}")
        self.mode = mode
        self.publish = publish
        self.copies = copies if mode == "mpu" else 1
        self.kappa = kappa
        self.shared_kappa = shared_kappa
        self.permute_groups = permute_groups
        self.sigma_reference = sigma_reference
        self.copy_files = copy_files
        # refuses an architecture T would silently break (naming the module / config field)
        # here, before any copy is built; clean / noised copies are not reparameterised
        self.reparam = (
            plan_reparam(model_config, permute_groups=permute_groups) if mode == "mpu" else None
        )
        self.warnings = list(self.reparam.warnings) if self.reparam is not None else []
        if mode == "mpu" and shared_kappa == 0:
            self.warnings.append(ALIGNMENT_WARNING)
        for warning in self.warnings:
            log(WARNING, "MPU: %s", warning)
        self.dims = self.reparam.dims if self.reparam is not None else None
        self.num_layers = int(model_config.num_hidden_layers)
        self._secret = secret
        self.alphas = alphas(self.copies)
        self.bytes_to_clients: dict[int, int] = {}
        self.file_bytes_to_clients: dict[int, int] = {}  # the copies written to files instead
        self.seconds = {"publish": 0.0, "map_back": 0.0}  # server pre- and post-processing
        # the per-tensor σ and shared-noise σ_η of the round being published (θ itself is
        # read from the round's ArrayRecord one tensor at a time, never copied)
        self._round_state: tuple[int, dict[str, float], dict[str, float]] | None = None
        self.sigma_per_layer: dict[int, float] = {}  # σ_ℓ of the last published round
        # per-round publishing: the round's copies as sent (every node's records share them)
        self._published: tuple[int, list[PublishedCopy]] | None = None
        self._published_files: tuple[int, list[CopyFile]] | None = None  # per-round, as files
        if self.spool is not None and not isinstance(self.spool, CopySpool):
            self.spool = CopySpool(self.spool.folder)  # a reply's copies go to disk as read
        # T_k of the current round by (client key, copy), drawn once for publish and map back
        self._transforms: tuple[int, dict[tuple[int | str, int], TransformSet]] = (0, {})

    # ---- keys ------------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """What results.json records about MPU (never the secret or any key)."""
        return {
            "mode": self.mode,
            "copies": self.copies,
            "publish": self.publish,
            "kappa": self.kappa,
            "alphas": list(self.alphas),
            "permute_groups": self.permute_groups,
            "sigma_source": "weights" if self.sigma_reference is None else "task-vector",
            "sigma_per_layer": dict(self.sigma_per_layer),
            "server_seconds": dict(self.seconds),
            "bytes_to_client_last_round": dict(self.bytes_to_clients),
            "file_bytes_to_client_last_round": dict(self.file_bytes_to_clients),
            "reparam": self.reparam.describe() if self.reparam is not None else None,
            "shared_kappa": self.shared_kappa,
            "warnings": list(self.warnings),
        }

    def round_record(self) -> dict[str, Any]:
        """The base record plus ``mpu`` (``report()``; never the secret)."""
        return {**super().round_record(), "mpu": json_safe(self.report())}

    def _client_key(self, position: int) -> int | str:
        """Whose keys: the client's position, or (``per-round``) the round's shared set."""
        return position if self.publish == "per-client" else "per-round"

    def copy_transforms(self, server_round: int, position: int, copy: int) -> TransformSet:
        """T_k of copy ``copy`` sent to client ``position`` in ``server_round`` (drawn once per
        round from the secret: ``per-client`` keys (round, position·1000 + copy), ``per-round``
        keys (round, "per-round-<copy>"))."""
        key = self._client_key(position)
        if self._transforms[0] != server_round:
            self._transforms = (server_round, {})
        cache = self._transforms[1]
        if (key, copy) not in cache:
            copy_idx = position * 1000 + copy if self.publish == "per-client" else f"{key}-{copy}"
            cache[(key, copy)] = draw_transforms(
                self.dims,
                self._secret,
                server_round,
                copy_idx,
                self.num_layers,
                permute_groups=self.permute_groups,
            )
        return cache[(key, copy)]

    def _round_inputs(
        self, server_round: int, arrays: ArrayRecord
    ) -> tuple[Mapping[str, torch.Tensor], dict[str, float], dict[str, float]]:
        """θ read from ``arrays`` one tensor at a time, σ per perturbed tensor and the shared
        noise's σ_η = κ_η·RMS(layer ℓ) per tensor (computed once per round)."""
        state = RecordTensors(arrays)
        if self._round_state is None or self._round_state[0] != server_round:
            groups = layer_groups(state.keys(), self.num_layers)
            per_layer = layer_sigmas(state, groups, 1.0, reference=self.sigma_reference)
            rms = sigma_per_tensor(groups, per_layer)
            sigmas = {name: self.kappa * value for name, value in rms.items()}
            shared = {name: self.shared_kappa * value for name, value in rms.items()}
            self.sigma_per_layer = {layer: self.kappa * v for layer, v in per_layer.items()}
            self._round_state = (server_round, sigmas, shared)
        return state, self._round_state[1], self._round_state[2]

    def _tensors(
        self, server_round: int, position: int, arrays: ArrayRecord
    ) -> Iterator[tuple[str, torch.Tensor, list[torch.Tensor]]]:
        """(name, θ's tensor, its copies) one tensor at a time: T_k(θ + η + α_k ε⁰_k) for
        k = 1..m, η of σ_η (``noised``: θ + ε, one plain Gaussian draw; ``clean``: θ)."""
        state, sigmas, shared = self._round_inputs(server_round, arrays)
        gen = torch.Generator().manual_seed(
            derive_seed(self._secret, server_round, self._client_key(position), "noise")
        )
        if self.mode == "mpu":
            transforms = [
                self.copy_transforms(server_round, position, k) for k in range(self.copies)
            ]
            return published_tensors(
                state, sigmas, self.alphas, gen, transforms, shared_sigmas=shared
            )
        if self.mode == "noised":
            return noised_tensors(state, sigmas, gen)
        return exact_tensors(state)

    def _build(
        self, server_round: int, position: int, arrays: ArrayRecord, hashed: bool
    ) -> list[PublishedCopy]:
        """The m copies client ``position`` receives as Flower arrays, built one tensor at a
        time (a tensor no copy changes travels as θ's own array); ``hashed``: with each
        tensor's digest, to find what differs from θ_base and hash every copy."""
        copies = [PublishedCopy() for _ in range(self.copies)]
        for name, weight, tensors in self._tensors(server_round, position, arrays):
            theta_digest = None
            for copy, tensor in zip(copies, tensors, strict=True):
                if tensor is weight:
                    copy.arrays[name] = arrays[name]
                    if hashed:
                        theta_digest = theta_digest or weight_digest(weight)
                        copy.digests[name] = theta_digest
                    continue
                copy.arrays[name] = weight_array(tensor)
                if hashed:
                    copy.digests[name] = weight_digest(tensor)
            del tensors
        for copy in copies:  # θ's order, as the global weights travel
            copy.arrays = {name: copy.arrays[name] for name in arrays}
        return copies

    # ---- hooks of MergeStrategy --------------------------------------------------------------

    def release_weights(self) -> None:
        """The base's release, and the copy files (no round needs them any more)."""
        super().release_weights()
        self._published_files = None
        if self.copy_files is not None:
            self.copy_files.clear()

    def node_content(
        self, server_round: int, position: int, arrays: ArrayRecord, node_config: ConfigRecord
    ) -> RecordDict:
        """m published copies for this node instead of the exact weights: in full, or (a node
        that holds θ_base) only the tensors of each copy that differ from θ_base."""
        started = time.perf_counter()
        try:
            return self._publish(server_round, position, arrays, node_config)
        finally:
            self.seconds["publish"] += time.perf_counter() - started

    def _publish(
        self, server_round: int, position: int, arrays: ArrayRecord, node_config: ConfigRecord
    ) -> RecordDict:
        config: dict[str, Any] = {**dict(node_config), "mpu-copies": self.copies}
        node_id = list(self.node_assignment)[position]
        delta = self.delivery.why_full(node_id) is None
        if self.mode == "clean" and not delta:  # the exact weights, as they are
            self.bytes_to_clients[position] = payload_nbytes(arrays.values())
            return RecordDict({"config": ConfigRecord(config), "arrays-0": arrays})
        declaration = self.delivery.declarations.get(node_id)
        by_file = (
            delta
            and self.copy_files is not None
            and declaration is not None
            and declaration.shared_machine
        )
        records: dict[str, ArrayRecord] = {}
        hashes: dict[str, str] = {}
        if by_file:
            files = self._copy_files(server_round, position, arrays)
            for k, copy_file in enumerate(files):
                records[f"arrays-{k}"] = ArrayRecord()
                hashes[model_sha_key(k)] = copy_file.sha256
                hashes[model_file_key(k)] = str(copy_file.path)
            self.file_bytes_to_clients[position] = sum(f.nbytes for f in files)
        else:
            copies = self._copies(server_round, position, arrays, delta)
            for k, copy in enumerate(copies):
                keys = copy.changed(self.delivery.base_digests) if delta else list(copy.arrays)
                records[f"arrays-{k}"] = copy.record(keys)
                if delta:
                    hashes[model_sha_key(k)] = copy.sha256(self.delivery.base_digests)
            self.file_bytes_to_clients.pop(position, None)
        if delta:
            config.update(
                {
                    DELIVERY_KEY: DELTA,
                    BASE_SHA_KEY: str(self.delivery.base_sha256),
                    **hashes,
                    **({BASE_OFFER_KEY: self.delivery.offer} if self.delivery.offer else {}),
                }
            )
        self.bytes_to_clients[position] = sum(payload_nbytes(r.values()) for r in records.values())
        return RecordDict({"config": ConfigRecord(config), **records})

    def _copy_files(self, server_round: int, position: int, arrays: ArrayRecord) -> list[CopyFile]:
        """Client ``position``'s copies written to files (``per-round``: written for the round's
        first such client and named to the others)."""
        if self.publish == "per-client":
            node_id = list(self.node_assignment)[position]
            return self._write_copies(server_round, position, arrays, f"node-{node_id}")
        if self._published_files is None or self._published_files[0] != server_round:
            files = self._write_copies(server_round, 0, arrays, "round")
            self._published_files = (server_round, files)
        return self._published_files[1]

    def _write_copies(
        self, server_round: int, position: int, arrays: ArrayRecord, name: str
    ) -> list[CopyFile]:
        """Client ``position``'s m copies as ``<name>-copy-<k>.safetensors``: each copy's
        tensors that differ from θ_base, written as they are drawn (one tensor alive)."""
        assert self.copy_files is not None
        self.copy_files.begin_round(server_round)
        candidates = {key: (torch.float32, tuple(arrays[key].shape)) for key in arrays}
        base = self.delivery.base_digests
        digests: list[dict[str, str]] = [dict(base) for _ in range(self.copies)]
        writers = [
            self.copy_files.writer(f"{name}-copy-{k}", candidates) for k in range(self.copies)
        ]
        with ExitStack() as stack:
            for writer in writers:
                stack.enter_context(writer)
            for key, weight, tensors in self._tensors(server_round, position, arrays):
                theta_digest = None
                for k, (writer, tensor) in enumerate(zip(writers, tensors, strict=True)):
                    if tensor is weight:
                        theta_digest = theta_digest or weight_digest(weight)
                        digest = theta_digest
                    else:
                        digest = weight_digest(tensor)
                    if digest != base[key]:
                        writer.add(key, tensor.float())
                        digests[k][key] = digest
                del tensors
        return [
            CopyFile(writer.path, state_sha256(digest), writer.nbytes)
            for writer, digest in zip(writers, digests, strict=True)
        ]

    def _copies(
        self, server_round: int, position: int, arrays: ArrayRecord, delta: bool
    ) -> list[PublishedCopy]:
        """Client ``position``'s copies (``per-round``: built by the round's first client and
        kept for the others, hashed whenever some node declared a base)."""
        if self.publish == "per-client":
            return self._build(server_round, position, arrays, hashed=delta)
        if self._published is None or self._published[0] != server_round:
            hashed = self.delivery.base_sha256 is not None
            self._published = (server_round, self._build(server_round, 0, arrays, hashed))
        return self._published[1]

    def decode_reply(
        self, server_round: int, node_id: int, content: RecordDict
    ) -> tuple[ClientUpdate, dict[str, Any]]:
        """Check every copy in its own coordinates and return the client's update as a
        harmonic aggregate of its mapped-back copies computed one weight at a time (with the
        spool, from memory maps of the copies as uploaded)."""
        started, before = time.perf_counter(), self.seconds["map_back"]
        try:
            return self._map_back(server_round, node_id, content)
        finally:  # the weights computed meanwhile (update validation) are part of this time
            self.seconds["map_back"] = before + time.perf_counter() - started

    def _count_map_back(self, seconds: float) -> None:
        """A weight computed from the copies (see :class:`fedunlearn.mpu.HarmonicUpload`)."""
        self.seconds["map_back"] += seconds

    def _map_back(
        self, server_round: int, node_id: int, content: RecordDict
    ) -> tuple[ClientUpdate, dict[str, Any]]:
        position = list(self.node_assignment).index(node_id)
        # the messages built so far hold their copies; a node whose message is built after
        # this reply (server.max-in-flight) gets the same copies rebuilt from the secret
        self._published = None
        spec = self.reply_spec(node_id)
        task_vectors: list[UploadParts] = []
        fishers: list[UploadParts] = []
        fields: dict[str, Any] = {}
        for k in range(self.copies):
            copy_content = copy_reply(content, k, node_id)
            # every copy is checked in its own coordinates before T⁻¹ touches it
            fields = validate_reply_content(f"{node_id} copy {k}", copy_content, spec)
            if k and ("fisher" in copy_content) != bool(fishers):
                raise ReplyRejected(f"{node_id} copy {k}", "sent a Fisher on some copies only")
            # validate_reply_content checked the record types (check_records)
            record = cast(ArrayRecord, copy_content["task_vector"])
            task_vectors.append(self._parts(server_round, node_id, f"task_vector-{k}", record))
            if k and task_vectors[k].keys() != task_vectors[0].keys():
                raise ReplyRejected(f"{node_id} copy {k}", "sent another key set than copy 0")
            if "fisher" in copy_content:
                record = cast(ArrayRecord, copy_content["fisher"])
                fishers.append(self._parts(server_round, node_id, f"fisher-{k}", record))
        transforms = (
            [self.copy_transforms(server_round, position, k) for k in range(self.copies)]
            if self.mode == "mpu"
            else None
        )
        info = content["info"]
        combined = ClientUpdate(
            node_id=node_id,
            role=str(info["role"]),
            domain=str(info["domain"]),
            num_examples=int(fields["num_examples"]),
            task_vector=HarmonicUpload(
                task_vectors,
                self.alphas,
                transforms,
                fisher=False,
                on_seconds=self._count_map_back,
            ),
            fisher=HarmonicUpload(
                fishers, self.alphas, transforms, fisher=True, on_seconds=self._count_map_back
            )
            if fishers
            else None,
        )
        fields.update(
            mpu_copies=len(self.alphas),
            bytes_received=self.bytes_to_clients.get(position, 0),
            bytes_received_files=self.file_bytes_to_clients.get(position, 0),
        )
        return combined, fields

    def _parts(
        self, server_round: int, node_id: int, name: str, record: ArrayRecord
    ) -> UploadParts:
        """A validated copy record's parts: read from the reply or (with the spool) written to
        disk now and read from a memory map."""
        shapes = self.reply_spec(node_id).shapes
        names = list(record)
        if self.spool is None:
            return UploadParts(names, lambda part: torch.from_numpy(record[part].numpy()), shapes)
        self.spool.begin_round(server_round)
        parts = {part: torch.from_numpy(record[part].numpy()) for part in names}
        get_part = self.spool.store_record(node_id, name, parts)
        return UploadParts(names, get_part, shapes)
