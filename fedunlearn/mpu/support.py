"""Which Hugging Face decoders MPU's reparameterisation T keeps function-preserving.

T (:mod:`.reparam`) is exact only for the layer structure it was derived for: separate
``self_attn.{q,k,v,o}_proj`` and ``mlp.{gate,up,down}_proj`` linears, an element-wise MLP
activation, rotary embeddings over the whole head in HF's ``rotate_half`` pairing, and norms
that act in the hidden space (which T never changes). :func:`plan_reparam` reads the config
and the modules of a meta-device instance of the model (no weights are allocated) and either
returns a :class:`ReparamPlan` — the dims, the maps T uses, those it skips and why — or raises
:class:`UnsupportedArchitectureError` naming every module and config field it does not
understand, before any copy is built.

q/k RMSNorm (Qwen3, Gemma3: per head over ``head_dim``; Olmo2: over the whole projection)
scales every channel with its own weight, so it commutes with a rotation of the RoPE plane
(i, i + d_h/2) only for the angles 0 and π. With such norms T keeps the MLP permutation, the
v/o orthogonal maps and the KV-group permutation (which also permutes a whole-projection norm's
weights) and reduces the RoPE-plane rotations to sign flips, with a warning.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

__all__ = [
    "QK_NORM_LAYOUTS",
    "VERIFIED_MODEL_TYPES",
    "ReparamDims",
    "ReparamPlan",
    "UnsupportedArchitectureError",
    "plan_reparam",
]

#: ``config.model_type`` values whose forward pass T has been checked against (logits preserved
#: to 1e-5 in fp32 by tests/fedunlearn/mpu/test_mpu_architectures.py).
VERIFIED_MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo2", "granite"}
)
#: RoPE variants that only change the per-plane frequencies / a global scale: all commute with
#: a rotation of each plane (i, i + d_h/2).
_ROPE_TYPES = frozenset({"default", "linear", "dynamic", "yarn", "longrope", "llama3"})
#: Element-wise activations (a channel permutation commutes with them).
_ELEMENTWISE_ACTIVATIONS = frozenset(
    {
        "gelu",
        "gelu_accurate",
        "gelu_fast",
        "gelu_new",
        "gelu_python",
        "gelu_python_tanh",
        "gelu_pytorch_tanh",
        "quick_gelu",
        "relu",
        "relu2",
        "silu",
        "swish",
        "tanh",
    }
)
_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
#: q/k norm layouts: none, one weight of size d_h shared by every head, or one weight over the
#: whole projection (H·d_h for q, H_KV·d_h for k).
QK_NORM_LAYOUTS = ("none", "per-head", "per-projection")

_PROJECTIONS = {
    "self_attn.q_proj": "q",
    "self_attn.k_proj": "k",
    "self_attn.v_proj": "v",
    "self_attn.o_proj": "o",
    "mlp.gate_proj": "gate",
    "mlp.up_proj": "up",
    "mlp.down_proj": "down",
}
_QK_NORMS = {"self_attn.q_norm": "q", "self_attn.k_norm": "k"}
#: Norms on the residual stream: T leaves the hidden basis alone, so any norm there is fine.
HIDDEN_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)
_ACTIVATION_SLOTS = ("mlp.act_fn", "mlp.activation_fn")  # the activation itself: see config
_CONTAINERS = ("", "self_attn", "mlp")


@dataclass(frozen=True)
class ReparamDims:
    """What T needs to know about a decoder layer: H_Q, H_KV, d_h, MLP width, q/k norm layout."""

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    qk_norm: str = "none"

    def __post_init__(self) -> None:
        for attr in ("num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, attr) < 1:
                raise ValueError(f"{attr} must be >= 1")
        if self.intermediate_size < 1:
            raise ValueError("intermediate_size must be >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
        if self.qk_norm not in QK_NORM_LAYOUTS:
            raise ValueError(f"qk_norm must be one of {QK_NORM_LAYOUTS}, got {self.qk_norm!r}")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (n_rep)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def sign_flips_only(self) -> bool:
        """True when q/k norms restrict the RoPE-plane rotations to the angles 0 and π."""
        return self.qk_norm != "none"

    @classmethod
    def from_config(cls, config: Any) -> ReparamDims:
        """The dims of a supported HF config (raises :class:`UnsupportedArchitectureError`)."""
        return plan_reparam(config).dims


class UnsupportedArchitectureError(ValueError):
    """The model has modules or config fields T would silently break; ``problems`` lists them."""

    def __init__(self, model_type: str, problems: list[str]) -> None:
        self.model_type = model_type
        self.problems = tuple(problems)
        listed = "\n  - ".join(self.problems)
        super().__init__(
            f"MPU cannot reparameterise this {model_type!r} model without changing its outputs "
            f"(refused before any copy is published):\n  - {listed}\n"
            "Use mpu.mode=clean or noised (no reparameterisation), or an architecture listed "
            'in docs/algorithms.md, "Supported architectures".'
        )


@dataclass(frozen=True)
class ReparamPlan:
    """What T does to one architecture: the dims and which maps are used or skipped, and why."""

    model_type: str
    dims: ReparamDims
    permute_groups: bool
    activation: str
    tied_embeddings: bool
    biases: tuple[str, ...]  # layer-relative projections that carry a bias (T maps them too)
    qk_norm_class: str = ""

    @property
    def rope_map(self) -> str:
        """``rope-plane-rotations`` or, under q/k norms, ``rope-plane-sign-flips``."""
        return "rope-plane-sign-flips" if self.dims.sign_flips_only else "rope-plane-rotations"

    @property
    def maps(self) -> tuple[str, ...]:
        """The maps T applies, in the order of the module docstring of :mod:`.reparam`."""
        used = ["mlp-channel-permutation", self.rope_map, "vo-orthogonal"]
        if self.permute_groups:
            used.append("kv-group-permutation")
        return tuple(used)

    @property
    def skipped(self) -> dict[str, str]:
        """Map → why T does not use it for this model."""
        out: dict[str, str] = {}
        if self.dims.sign_flips_only:
            out["rope-plane-rotations"] = (
                f"self_attn.q_norm/k_norm ({self.qk_norm_class}, {self.dims.qk_norm}) weight "
                "each channel separately: only the angles 0 and π commute with them"
            )
        if not self.permute_groups:
            out["kv-group-permutation"] = "mpu.permute-groups=false"
        return out

    @property
    def warnings(self) -> tuple[str, ...]:
        """What a user should know: maps weakened because of the architecture."""
        if not self.dims.sign_flips_only:
            return ()
        extra = (
            "; the KV-group permutation also permutes the q_norm/k_norm weights"
            if self.dims.qk_norm == "per-projection" and self.permute_groups
            else ""
        )
        return (
            f"{self.model_type}: RoPE-plane rotations reduced to sign flips (angle 0 or π per "
            f"plane) because of {self.skipped['rope-plane-rotations']}; the other maps are kept "
            f"in full{extra}",
        )

    def describe(self) -> dict[str, Any]:
        """A JSON-ready description (for results.json's ``mpu`` record)."""
        return {
            "model_type": self.model_type,
            "maps": list(self.maps),
            "skipped": self.skipped,
            "qk_norm": self.dims.qk_norm,
            "activation": self.activation,
            "tied_embeddings": self.tied_embeddings,
            "biases": list(self.biases),
            "warnings": list(self.warnings),
        }


def plan_reparam(config: Any, *, permute_groups: bool = True) -> ReparamPlan:
    """The :class:`ReparamPlan` of an HF causal-LM ``config``, or a refusal.

    Raises :class:`UnsupportedArchitectureError` listing every problem (unknown or fused
    modules, partial rotary, unknown RoPE or layer types, a non-element-wise activation, a
    ``model_type`` T has not been verified on) — it never returns a plan T would break.
    """
    model_type = str(getattr(config, "model_type", "") or "<no model_type>")
    problems = [*_rope_problems(config), *_layer_type_problems(config)]
    activation, activation_problems = _activation(config)
    problems += activation_problems
    dims = None
    try:
        dims = _config_dims(config)
    except (AttributeError, TypeError, ValueError) as err:
        problems.append(f"config: {err}")
    layout = _ModuleLayout()
    if dims is not None:
        layout = _inspect_modules(config, dims)
        problems += layout.problems
    if model_type not in VERIFIED_MODEL_TYPES:
        problems.append(
            f"config.model_type={model_type!r} is not an architecture T has been verified on "
            f"(verified: {', '.join(sorted(VERIFIED_MODEL_TYPES))})"
        )
    if problems or dims is None:
        raise UnsupportedArchitectureError(model_type, problems)
    return ReparamPlan(
        model_type=model_type,
        dims=dataclasses.replace(dims, qk_norm=layout.qk_norm),
        permute_groups=permute_groups,
        activation=activation,
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        biases=tuple(sorted(layout.biases)),
        qk_norm_class=layout.qk_norm_class,
    )


# ---- config fields ------------------------------------------------------------------------


def _config_dims(config: Any) -> ReparamDims:
    heads = int(config.num_attention_heads)
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ReparamDims(heads, int(kv), int(head_dim), int(config.intermediate_size))


def _rope_entries(config: Any) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(config field, RoPE dict): one, or one per layer type (Gemma3's nested form)."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, Mapping):
        return
    if params and all(isinstance(v, Mapping) for v in params.values()):
        for layer_type, entry in params.items():
            yield f"config.rope_parameters[{layer_type!r}]", entry
    else:
        yield "config.rope_parameters", params


def _rope_problems(config: Any) -> list[str]:
    problems = []
    entries = list(_rope_entries(config))
    if not entries:
        problems.append("config.rope_parameters is missing: T needs rotary position embeddings")
    for label, entry in entries:
        rope_type = entry.get("rope_type", entry.get("type", "default"))
        if rope_type not in _ROPE_TYPES:
            problems.append(
                f"{label}['rope_type']={rope_type!r}: T knows only {sorted(_ROPE_TYPES)}"
            )
        factor = entry.get("partial_rotary_factor", 1.0)
        if factor is not None and float(factor) != 1.0:
            problems.append(
                f"{label}['partial_rotary_factor']={factor}: partial rotary embeddings (RoPE "
                "on part of each head) do not commute with T's RoPE-plane rotations"
            )
    for attr in ("partial_rotary_factor", "rotary_pct"):
        value = getattr(config, attr, None)
        if value is not None and float(value) != 1.0:
            problems.append(f"config.{attr}={value}: partial rotary embeddings are not supported")
    return problems


def _layer_type_problems(config: Any) -> list[str]:
    layer_types = getattr(config, "layer_types", None) or []
    return [
        f"config.layer_types[{i}]={kind!r}: T knows only {sorted(_LAYER_TYPES)} layers"
        for i, kind in enumerate(layer_types)
        if kind not in _LAYER_TYPES
    ]


def _activation(config: Any) -> tuple[str, list[str]]:
    fields = [f for f in ("hidden_act", "hidden_activation") if getattr(config, f, None)]
    if not fields:
        return "", ["config has no hidden_act: T needs an element-wise MLP activation"]
    problems = [
        f"config.{f}={getattr(config, f)!r} is not an element-wise activation T knows "
        f"({sorted(_ELEMENTWISE_ACTIVATIONS)})"
        for f in fields
        if getattr(config, f) not in _ELEMENTWISE_ACTIVATIONS
    ]
    return str(getattr(config, fields[-1])), problems


# ---- modules ------------------------------------------------------------------------------


@dataclass
class _ModuleLayout:
    """What the module walk found: problems, biased projections, the q/k norm layout."""

    problems: list[str] = field(default_factory=list)
    biases: set[str] = field(default_factory=set)
    qk_norm: str = "none"
    qk_norm_class: str = ""


def _meta_model(config: Any) -> nn.Module:
    from transformers import AutoModelForCausalLM  # heavy import: only when a plan is made

    config = copy.deepcopy(config)
    config._attn_implementation = "eager"  # the modules do not depend on it; always available
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _inspect_modules(config: Any, dims: ReparamDims) -> _ModuleLayout:
    layout = _ModuleLayout()
    try:
        model = _meta_model(config)
    except Exception as err:  # noqa: BLE001 — any build failure is reported, not raised
        layout.problems.append(f"the model cannot be built from its config: {err}")
        return layout
    layers = getattr(getattr(model, "model", None), "layers", None)
    expected = int(getattr(config, "num_hidden_layers", -1))
    if not isinstance(layers, nn.ModuleList) or len(layers) != expected:
        layout.problems.append(
            f"no {expected} decoder layers at model.layers (MPU addresses layers by that name)"
        )
        return layout
    seen: dict[str, str] = {}  # layer-relative name → first problem (reported once)
    for index, layer in enumerate(layers):
        for rel, problem in _layer_problems(layer, dims, layout):
            where = f"model.layers.{index}" + (f".{rel}" if rel else "")
            seen.setdefault(rel, f"{where}: {problem}")
    layout.problems.extend(seen.values())
    return layout


def _own_state(module: nn.Module) -> list[str]:
    """Names of the parameters and persistent buffers a module holds itself."""
    params = [n for n, p in module.named_parameters(recurse=False) if p is not None]
    skip: set[str] = getattr(module, "_non_persistent_buffers_set", set())
    buffers = [n for n, b in module.named_buffers(recurse=False) if b is not None and n not in skip]
    return params + buffers


def _layer_problems(
    layer: nn.Module, dims: ReparamDims, layout: _ModuleLayout
) -> Iterator[tuple[str, str]]:
    """(layer-relative name, problem) for every part of one decoder layer T does not know."""
    present: set[str] = set()
    unknown: list[str] = []  # subtrees already reported as a whole
    for rel, module in layer.named_modules():
        if any(rel.startswith(f"{prefix}.") for prefix in unknown):
            continue
        if rel in _PROJECTIONS:
            present.add(rel)
            problem = _projection_problem(module, _PROJECTIONS[rel], dims)
            if getattr(module, "bias", None) is not None:
                layout.biases.add(rel)
        elif rel in _QK_NORMS:
            problem = _qk_norm_problem(module, _QK_NORMS[rel], dims, layout)
        elif rel in HIDDEN_NORMS:
            kind = type(module).__name__
            problem = "" if "Norm" in kind else f"is a {kind}, not a norm"
        elif rel in _ACTIVATION_SLOTS or isinstance(module, nn.Dropout):
            problem = ""
        elif rel in _CONTAINERS:
            own = _own_state(module)
            problem = f"holds {own} directly, which T does not know" if own else ""
        else:
            unknown.append(rel)
            problem = f"unknown or fused module ({type(module).__name__})"
        if problem:
            yield rel, problem
    missing = sorted(set(_PROJECTIONS) - present)
    if missing:
        yield "", f"lacks {', '.join(missing)} (T needs separate projections)"


def _projection_problem(module: nn.Module, kind: str, dims: ReparamDims) -> str:
    if not isinstance(module, nn.Linear):
        return f"is a {type(module).__name__}, T needs an nn.Linear"
    extra = [n for n in _own_state(module) if n not in ("weight", "bias")]
    if extra:
        return f"holds {extra}, which T does not know"
    q_width = dims.num_attention_heads * dims.head_dim
    kv_width = dims.num_key_value_heads * dims.head_dim
    expected = {
        "q": ("out_features", q_width),
        "k": ("out_features", kv_width),
        "v": ("out_features", kv_width),
        "o": ("in_features", q_width),
        "gate": ("out_features", dims.intermediate_size),
        "up": ("out_features", dims.intermediate_size),
        "down": ("in_features", dims.intermediate_size),
    }[kind]
    actual = getattr(module, expected[0])
    if actual != expected[1]:
        return f"{expected[0]}={actual}, but the config implies {expected[1]}"
    return ""


def _qk_norm_problem(module: nn.Module, kind: str, dims: ReparamDims, layout: _ModuleLayout) -> str:
    name = type(module).__name__
    if not name.endswith("RMSNorm") or _own_state(module) != ["weight"]:
        return f"is a {name}: T knows only a q/k RMSNorm with a weight and no bias"
    size = cast(torch.Tensor, module.weight).numel()  # its one state entry (checked above)
    heads = dims.num_attention_heads if kind == "q" else dims.num_key_value_heads
    fits = {"per-head"} if size == dims.head_dim else set()
    fits |= {"per-projection"} if size == heads * dims.head_dim else set()
    if not fits:
        return f"weight has {size} entries, neither head_dim nor the projection width"
    if layout.qk_norm == "none":  # the first q/k norm decides; sizes agree when H = 1
        layout.qk_norm = "per-head" if "per-head" in fits else "per-projection"
    elif layout.qk_norm not in fits:
        return f"is {sorted(fits)[0]} while the other q/k norm is {layout.qk_norm}"
    layout.qk_norm_class = name
    return ""
