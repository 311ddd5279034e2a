"""MPU — multiple perturbed copies unlearning, server-side tensor core (docs/algorithms.md, "MPU").

Pure torch (no Flower). Per round r and forget client the server

1. derives seeds from its secret (:mod:`.keys`),
2. draws zero-sum layer noise ε⁰_k with σ_ℓ = κ·RMS(v_ℓ) and scales α_k (:mod:`.noise`),
3. publishes θ_pub,k = T_k(θ + α_k ε⁰_k) with a secret function-preserving T_k (:mod:`.reparam`;
   which architectures T supports, partially or not at all: :mod:`.support`),
4. maps each returned update back, Δ̂_k = T_k⁻¹(Δ_k) (LoRA factors as factors:
   :mod:`.uploads`), and aggregates harmonically, Δ̄ = S₁/S₀ (:mod:`.aggregate`; one weight
   at a time from the copies' uploads: :class:`.aggregate.HarmonicUpload`).

:mod:`.publish` builds the m copies of steps 2–3 in one pass over the weights, one tensor at a
time.
"""

from .aggregate import HarmonicAggregator, HarmonicUpload, UploadParts, plain_mean
from .keys import DEFAULT_SECRET_ENV_VAR, ServerSecret, derive_seed, server_secret
from .noise import (
    LAYER_PATTERN,
    alphas,
    layer_groups,
    layer_sigmas,
    noisy_copy,
    perturb,
    sigma_per_tensor,
    zero_sum_coefficients,
    zero_sum_draw,
    zero_sum_noise,
)
from .publish import noised_tensors, perturbed_copies, published_tensors
from .reparam import (
    LayerTransform,
    ReparamDims,
    apply_transform,
    draw_transform,
    draw_transforms,
    invert_delta,
    invert_fisher,
    invert_lora,
    invert_transform,
    parse_target,
    transform_tensor,
)
from .support import (
    VERIFIED_MODEL_TYPES,
    ReparamPlan,
    UnsupportedArchitectureError,
    plan_reparam,
)
from .uploads import map_back

__all__ = [
    "DEFAULT_SECRET_ENV_VAR",
    "LAYER_PATTERN",
    "VERIFIED_MODEL_TYPES",
    "HarmonicAggregator",
    "HarmonicUpload",
    "LayerTransform",
    "ReparamDims",
    "ReparamPlan",
    "ServerSecret",
    "UnsupportedArchitectureError",
    "UploadParts",
    "alphas",
    "apply_transform",
    "derive_seed",
    "draw_transform",
    "draw_transforms",
    "invert_delta",
    "invert_fisher",
    "invert_lora",
    "invert_transform",
    "layer_groups",
    "layer_sigmas",
    "map_back",
    "noised_tensors",
    "noisy_copy",
    "parse_target",
    "perturb",
    "perturbed_copies",
    "plain_mean",
    "plan_reparam",
    "published_tensors",
    "server_secret",
    "sigma_per_tensor",
    "transform_tensor",
    "zero_sum_coefficients",
    "zero_sum_draw",
    "zero_sum_noise",
]
