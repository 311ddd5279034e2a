"""MPU's run-config options (``[tool.flwr.app.config.mpu]``) and the values behind them: the
modes, the publication schemes, the σ sources and the shared-noise default κ_η."""

from __future__ import annotations

from dataclasses import dataclass

from fedunlearn.options import (
    NON_NEGATIVE,
    POSITIVE,
    POSITIVE_INT,
    Number,
    OneOf,
    option,
    option_group,
)

MPU_MODES = ("mpu", "clean", "noised")
#: ``mpu.shared-kappa`` = -1: κ_η = SHARED_KAPPA_FACTOR·κ in ``mpu`` mode. A client aligning its
#: copies ends with θ + η, one copy is θ + η + α_1·ε⁰_1 in secret coordinates: one copy is
#: √(1 + (α_1·κ/κ_η)²) times as far from θ, 1.20 at κ_η = 1.5·κ (measured by logits at
#: κ = 0.01: 1.03–1.41 for m = 2–4, against 1.5–1.8 at κ_η = κ; docs/mpu.md, "Threat model").
SHARED_KAPPA_AUTO = -1.0
SHARED_KAPPA_FACTOR = 1.5


def resolve_shared_kappa(shared_kappa: float, mode: str, kappa: float) -> float:
    """κ_η for ``shared_kappa`` as given: -1 stands for SHARED_KAPPA_FACTOR·``kappa`` in ``mpu``
    mode and for 0 in the one-copy baselines (nothing to share); any other value is returned as
    it is."""
    if shared_kappa != SHARED_KAPPA_AUTO:
        return shared_kappa
    return SHARED_KAPPA_FACTOR * kappa if mode == "mpu" else 0.0


#: ``mpu.publish``: fresh copies for every client, or one set of copies for the whole round.
MPU_PUBLISH = ("per-client", "per-round")
MPU_SIGMA_SOURCES = ("weights", "task-vector")


@option_group("mpu")
@dataclass(frozen=True)
class MpuOptions:
    """MPU around the merge (``wrapper = "mpu"``; ``[tool.flwr.app.config.mpu]``)."""

    mode: str = option(
        "mpu",
        "mpu (m reparameterised copies), clean or noised (one copy)",
        OneOf(lambda: MPU_MODES),
    )
    copies: int = option(2, "copies m per client and round (mpu mode: >= 2)", POSITIVE_INT)
    publish: str = option(
        "per-client",
        "per-client: noise and reparameterisation drawn afresh for every client; per-round: "
        "one set of m copies per round, sent to every client",
        OneOf(lambda: MPU_PUBLISH),
    )
    kappa: float = option(0.01, "noise scale κ (σ = κ·RMS of the layer)", NON_NEGATIVE)
    permute_groups: bool = option(True, "also permute the KV groups")
    shared_kappa: float = option(
        SHARED_KAPPA_AUTO,
        "κ_η of a noise common to a client's m copies, which aligning the copies cannot "
        f"average away; -1 = {SHARED_KAPPA_FACTOR:g} × mpu.kappa in mpu mode (the default), "
        "0 = none: the method as published, with a warning",
        Number(
            low=0,
            special=(
                (SHARED_KAPPA_AUTO, f"{SHARED_KAPPA_FACTOR:g} × mpu.kappa in mpu mode, else 0"),
            ),
        ),
    )

    def shared_noise_kappa(self) -> float:
        """κ_η the strategy runs with: ``shared-kappa``, or for -1 1.5·``kappa`` in ``mpu``
        mode and 0 in the one-copy baselines."""
        return resolve_shared_kappa(self.shared_kappa, self.mode, self.kappa)

    secret: str = option("", "refused: a secret in the run config leaks (use secret-file)")
    secret_file: str = option(
        "",
        'absolute path of a 0600 file holding the server secret; "" = $FEDUNLEARN_MPU_SECRET '
        "or a fresh secret",
    )
    server_lr: float = option(1.0, "server learning rate η_srv", POSITIVE)
    sigma_source: str = option(
        "weights",
        "σ from the RMS of the weights, or (task-vector) of θ − θ_pretrained",
        OneOf(lambda: MPU_SIGMA_SOURCES),
    )
    pretrained_path: str = option(
        "", 'θ_pretrained for sigma-source = task-vector; "" = the built-in model\'s pre-training'
    )


#: in results.json and the log whenever ``mpu.mode=mpu`` runs without shared noise
ALIGNMENT_WARNING = (
    "mpu.shared-kappa=0: a client that aligns its m copies (they are noisy versions of the "
    "same weights) can cancel the zero-sum noise and compute nearly the server's exact model: "
    "the threat-model study (python -m simulations.mpu_attack) measured its estimate 41-2204x "
    "closer to the server's logits than one copy on the built-in model (kappa 0.05 to 0.001, "
    'm = 2 to 4) and 335x on SmolLM2-135M at kappa=0.01 (docs/mpu.md, "Threat model"); the '
    "default, shared-kappa = 1.5 x kappa, adds noise the alignment cannot remove"
)
