"""The flat run config (``[tool.flwr.app.config]``) parsed into typed settings."""

from __future__ import annotations

import dataclasses
import math
import re
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from fedunlearn.dp2u import ForgetRequest, parse_forget_request
from fedunlearn.models.substrate import SubstrateConfig
from fedunlearn.objectives import OBJECTIVES, objective_requirements
from fedunlearn.scenarios import RETAIN_LAYOUTS, SCENARIOS, ScenarioParams
from fedunlearn.training.lora import parse_layers

DTYPES = ("auto", "float32", "bfloat16")  # float16 would need loss scaling
FINETUNE_MODES = ("lora", "full")
DP2U_METHODS = ("dp2u-sgd", "dp2u-mlm", "rfs-r", "ga", "graddiff", "kl", "idk")
MPU_SIGMA_SOURCES = ("weights", "task-vector")


@dataclass(frozen=True)
class RunSettings:
    """Every run-config key, with its default. Keys are the field names with ``-``."""

    scenario: str = "tofu"
    strategy: str = "firm"
    seed: int = 0
    num_rounds: int = 1
    # benchmark / scenario
    num_authors: int = 200
    qa_per_author: int = 10
    forget_percent: float = 1.0
    forget_domains: str = "bio,cyber"
    num_forget_clients: int = 0  # 0 = the scenario's default
    num_retain_clients: int = 1
    retain_samples: int = 200
    local_retain_samples: int = 32
    num_forget_domains: int = 1
    retain_layout: str = "random"
    data_path: str = ""
    # model
    model_path: str = ""
    dtype: str = "auto"
    load_in_4bit: bool = False
    cache_dir: str = ""
    # built-in substrate (ignored with model-path)
    substrate_hidden_size: int = 192
    substrate_layers: int = 4
    substrate_intermediate_size: int = 512
    substrate_pretrain_epochs: int = 2
    substrate_finetune_epochs: int = 16
    substrate_background_documents: int = 1500
    # local training
    objective: str = "auto"
    forget_steps: int = 0  # 0 = the scenario's default
    forget_lr: float = 0.0  # 0 = the scenario's default
    retain_steps: int = 40
    retain_lr: float = 1e-3
    batch_size: int = 8
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_targets: str = "auto"
    lora_layers: str = "auto"
    finetune: str = "lora"  # lora | full (train the targeted weights themselves)
    fisher_batches: int = 20
    # objective options (SPEC §6); each objective reads its own
    graddiff_alpha: float = 1.0
    npo_beta: float = 0.1
    simnpo_beta: float = 4.5
    simnpo_delta: float = 0.0
    dpo_beta: float = 0.1
    undial_beta: float = 10.0
    satimp_beta1: float = 5.0
    satimp_beta2: float = 1.0
    kl_alpha: float = 1.0
    rmu_layer: int = -1  # -1 = the scenario's default
    rmu_steering: float = -1.0  # -1 = the scenario's default
    rmu_alpha: float = -1.0  # -1 = the scenario's default
    client_threads: int = 1
    # merge (FIRM)
    gamma: float = 0.0  # 0 = the scenario's default
    alpha: float = 0.1
    eps0: float = 1e-8
    epsilon: float = math.inf
    solver: str = "exact"
    # MPU (strategy=mpu): perturbed, reparameterised copies around the merge mpu-merge
    mpu_merge: str = "firm"
    mpu_mode: str = "mpu"
    mpu_copies: int = 2
    mpu_kappa: float = 0.01
    mpu_permute_groups: bool = True
    mpu_secret: str = ""
    mpu_server_lr: float = 1.0
    mpu_sigma_source: str = "weights"  # weights | task-vector (θ − θ_pretrained)
    mpu_pretrained_path: str = ""  # θ_pretrained for task-vector; "" = the substrate's
    # DP2Unlearning (strategy=dp2u): DP base, deployed fine-tune, retain-only unlearning
    dp2u_method: str = "dp2u-sgd"  # dp2u-sgd | dp2u-mlm | rfs-r | ga | graddiff | kl | idk
    dp2u_clients: int = 2
    dp2u_epsilon: float = 1.0  # DP-SGD: per client, all stage-A rounds; DP-MLM: per token
    dp2u_delta: float = 1e-5
    dp2u_clip: float = 1.0
    dp2u_dp_rounds: int = 2
    dp2u_dp_lr: float = 0.05
    dp2u_dp_batch_size: int = 64
    dp2u_finetune_rounds: int = 3  # E′ (stages B and C)
    dp2u_retrain_rounds: int = 6  # E (RFS-R and the non-DP deployed model)
    dp2u_local_epochs: int = 4  # local epochs per round of the non-DP stages
    dp2u_lr: float = 4e-3
    dp2u_batch_size: int = 32
    dp2u_public_knowledge: bool = True  # every client also trains on the public knowledge
    dp2u_mlm_sensitive_only: bool = False
    dp2u_mlm_path: str = ""  # a local masked-LM checkpoint; "" = built from the public corpus
    # named forget request: JSON {"<client>": {"authors": [...], "records": [...]}} or the
    # path of a JSON file holding one; "" = the last forget-percent % of the authors
    dp2u_forget_request: str = ""
    # baselines
    ties_k: float = 0.2
    fulm_threshold: float = 0.6
    fulm_k: float = 0.3
    # evaluation and output
    eval_retain_samples: int = 200
    eval_max_new_tokens: int = 32
    eval_batch_size: int = 64
    output_dir: str = ""
    save_uploads: bool = False
    resume: bool = True  # continue from <output-dir>/checkpoint (same config); false = afresh
    round_timeout: float = 3600.0
    node_wait_timeout: float = 120.0
    # bad clients (issue 7): reply validation, dropouts, robust options before the merge
    min_replies: int = 0  # 0 = one valid forget update per assigned forget domain
    max_upload_mb: float = 0.0  # 0 = the largest honest reply (float64 task vector + Fisher)
    robust_norm_bound: float = 0.0  # clip task vectors to this × role median norm; 0 = off
    fisher_cap: float = 0.0  # cap Fisher mass per tensor at this × role median; 0 = off

    @classmethod
    def from_run_config(cls, run_config: dict[str, Any]) -> RunSettings:
        """Parse Flower's run config; unknown keys and wrong types are clear errors."""
        known = {f.name.replace("_", "-"): f for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, raw in run_config.items():
            if key not in known:
                raise KeyError(f"unknown run-config key {key!r}; known: {', '.join(sorted(known))}")
            field = known[key]
            kind = type(field.default)
            if (
                kind is float
                and isinstance(raw, str)
                and raw.strip().lower() in ("inf", "infinity")
            ):
                value: Any = math.inf
            elif kind is float and isinstance(raw, int | float) and not isinstance(raw, bool):
                value = float(raw)
            elif isinstance(raw, kind) and not (kind is int and isinstance(raw, bool)):
                value = raw
            else:
                raise TypeError(f"run-config key {key!r} must be {kind.__name__}, got {raw!r}")
            values[field.name] = value
        settings = cls(**values).resolved()
        settings.validate()
        return settings

    def resolved(self) -> RunSettings:
        """A copy where every key left on its "scenario default" value ("auto", 0, -1) takes
        the scenario's default (``Scenario.defaults``); explicit values are kept."""
        if self.scenario not in SCENARIOS:
            raise ValueError(
                f"scenario {self.scenario!r} is not available (available: "
                f"{', '.join(sorted(SCENARIOS))})"
            )
        unset = {f.name: f.default for f in fields(self)}
        changes = {
            name: value
            for name, value in SCENARIOS[self.scenario].defaults.items()
            if getattr(self, name) == unset[name]
        }
        return dataclasses.replace(self, **changes)

    def validate(self) -> None:
        if self.scenario not in SCENARIOS:
            raise ValueError(
                f"scenario {self.scenario!r} is not available (available: "
                f"{', '.join(sorted(SCENARIOS))})"
            )
        if self.objective not in OBJECTIVES:
            raise ValueError(
                f"objective {self.objective!r} is unknown; available: "
                f"{', '.join(sorted(OBJECTIVES))}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.data_path and not self.model_path:
            raise ValueError(
                "data-path (real benchmark files) needs model-path: the built-in substrate is "
                "trained on the generated data and its reference would not match the files"
            )
        requirements = objective_requirements(self.objective)
        if self.objective == "nll":
            raise ValueError("objective 'nll' trains ON the forget data; pick a forget objective")
        if requirements.needs_alternate and not SCENARIOS[self.scenario].qa_forget_data:
            raise ValueError(
                f"objective {self.objective!r} prefers a refusal answer to the forget answer, "
                f"but the {self.scenario} scenario's forget clients hold plain text"
            )
        if requirements.needs_retain and self.local_retain_samples < 1:
            raise ValueError(
                f"objective {self.objective!r} needs retain data on the forget clients: set "
                "local-retain-samples >= 1"
            )
        if self.lora_layers != "auto":
            parse_layers(self.lora_layers)
        if self.finetune not in FINETUNE_MODES:
            raise ValueError(f"finetune must be one of {FINETUNE_MODES}, got {self.finetune!r}")
        if self.finetune == "full" and self.load_in_4bit:
            raise ValueError("finetune='full' cannot train 4-bit weights; use LoRA with 4-bit")
        if self.strategy == "dp2u":
            self._validate_dp2u()
        elif self.dp2u_forget_request:
            raise ValueError(
                "dp2u-forget-request needs strategy='dp2u' (the other strategies forget the "
                "scenario's forget-percent split)"
            )
        if self.strategy == "mpu":
            if self.mpu_mode not in ("mpu", "clean", "noised"):
                raise ValueError(f"mpu-mode must be mpu, clean or noised, got {self.mpu_mode!r}")
            if self.mpu_mode == "mpu" and self.mpu_copies < 2:
                raise ValueError(f"mpu-copies must be >= 2, got {self.mpu_copies}")
            if self.mpu_merge == "mpu":
                raise ValueError("mpu-merge names the merge MPU wraps; it cannot be 'mpu'")
            if self.mpu_sigma_source not in MPU_SIGMA_SOURCES:
                raise ValueError(
                    f"mpu-sigma-source must be one of {MPU_SIGMA_SOURCES}, "
                    f"got {self.mpu_sigma_source!r}"
                )
            if (
                self.mpu_sigma_source == "task-vector"
                and self.model_path
                and not (self.mpu_pretrained_path)
            ):
                raise ValueError(
                    "mpu-sigma-source='task-vector' with model-path needs mpu-pretrained-path "
                    "(the checkpoint the model was fine-tuned from)"
                )
        if not 0 < self.forget_percent < 100:
            raise ValueError(f"forget-percent must be in (0, 100), got {self.forget_percent}")
        for name in (
            "num_rounds",
            "forget_steps",
            "retain_steps",
            "batch_size",
            "lora_rank",
            "fisher_batches",
            "num_forget_clients",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1")
        if self.gamma <= 0:
            raise ValueError(f"gamma must be > 0, got {self.gamma}")
        if self.epsilon <= 0:
            raise ValueError(
                f"epsilon must be > 0 (inf disables the projection), got {self.epsilon}"
            )
        if self.retain_layout not in RETAIN_LAYOUTS:
            raise ValueError(
                f"retain-layout must be one of {RETAIN_LAYOUTS}, got {self.retain_layout!r}"
            )
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        self._validate_bad_client_keys()

    def _validate_bad_client_keys(self) -> None:
        """``min-replies``, ``max-upload-mb``, ``robust-norm-bound``, ``fisher-cap``."""
        if not 0 <= self.min_replies <= self.num_clients:
            raise ValueError(
                f"min-replies must be in [0, {self.num_clients}] (the run's clients), "
                f"got {self.min_replies}"
            )
        if not 0 <= self.max_upload_mb < math.inf:
            raise ValueError(f"max-upload-mb must be >= 0 and finite, got {self.max_upload_mb}")
        for name in ("robust_norm_bound", "fisher_cap"):
            value = getattr(self, name)
            if not (value == 0 or 1 <= value < math.inf):
                raise ValueError(
                    f"{name.replace('_', '-')} must be 0 (off) or a finite number >= 1, got {value}"
                )

    def substrate_config(self) -> SubstrateConfig:
        """The built-in substrate this run uses (its hash names the cache folder)."""
        return SubstrateConfig(
            scenario=self.scenario,
            forget_domains=self.forget_domains,
            seed=self.seed,
            num_authors=self.num_authors,
            qa_per_author=self.qa_per_author,
            forget_percent=self.forget_percent,
            hidden_size=self.substrate_hidden_size,
            num_hidden_layers=self.substrate_layers,
            intermediate_size=self.substrate_intermediate_size,
            pretrain_epochs=self.substrate_pretrain_epochs,
            finetune_epochs=self.substrate_finetune_epochs,
            background_documents=self.substrate_background_documents,
        )

    def scenario_params(self) -> ScenarioParams:
        """The scenario's data and client-layout parameters."""
        return ScenarioParams(
            seed=self.seed,
            data_path=self.data_path,
            num_authors=self.num_authors,
            qa_per_author=self.qa_per_author,
            forget_percent=self.forget_percent,
            num_forget_domains=self.num_forget_domains,
            retain_layout=self.retain_layout,
            forget_domains=self.forget_domains,
            num_forget_clients=self.num_forget_clients,
            num_retain_clients=self.num_retain_clients,
            retain_samples=self.retain_samples,
            local_retain_samples=(
                self.local_retain_samples
                if objective_requirements(self.objective).needs_retain
                else 0
            ),
            eval_retain_samples=self.eval_retain_samples,
        )

    def objective_options(self) -> dict[str, float]:
        """The objective options (``npo_beta``, ``rmu_layer``, ...) as floats for the client."""
        names = (
            "graddiff_alpha npo_beta simnpo_beta simnpo_delta dpo_beta undial_beta "
            "satimp_beta1 satimp_beta2 kl_alpha rmu_layer rmu_steering rmu_alpha"
        ).split()
        options = {name: float(getattr(self, name)) for name in names}
        # left on "scenario default" and the scenario has none: the objective's own default
        for name, unset in (("rmu_layer", -1.0), ("rmu_steering", -1.0), ("rmu_alpha", -1.0)):
            if options[name] == unset:
                del options[name]
        options["rmu_seed"] = float(self.seed)
        return options

    def lora_layer_indices(self) -> tuple[int, ...] | None:
        """``lora-layers`` as layer indices; None = every layer."""
        return parse_layers(self.lora_layers)

    def for_model(self, num_hidden_layers: int) -> RunSettings:
        """Settings completed for a model with ``num_hidden_layers`` decoder layers: an unset
        ``rmu-layer`` becomes the middle layer L = n // 2 and ``lora-layers=auto`` the
        scenario's choice for that depth (WMDP: L−1 and L; others: all layers). Raises when
        a layer index lies outside the model."""
        scenario = SCENARIOS[self.scenario]
        layer = self.rmu_layer if self.rmu_layer >= 0 else num_hidden_layers // 2
        lora_layers = self.lora_layers
        if lora_layers == "auto":
            lora_layers = scenario.default_lora_layers(num_hidden_layers, layer)
        resolved = dataclasses.replace(self, rmu_layer=layer, lora_layers=lora_layers)
        bad = [i for i in resolved.lora_layer_indices() or () if not 0 <= i < num_hidden_layers]
        if bad or not 0 <= layer < num_hidden_layers:
            raise ValueError(
                f"the model has layers 0..{num_hidden_layers - 1}, but lora-layers="
                f"{lora_layers!r} / rmu-layer={layer} point outside them"
            )
        return resolved

    def merge_parameters(self) -> dict[str, Any]:
        """Candidate merge keyword arguments; each merge takes those it names."""
        params: dict[str, Any] = {
            "gamma": self.gamma,
            "alpha": self.alpha,
            "eps0": self.eps0,
            "epsilon": self.epsilon,
            "solver": self.solver,
        }
        merge = self.mpu_merge if self.strategy == "mpu" else self.strategy
        if merge == "ties":
            params["k"] = self.ties_k
        elif merge in ("fulm", "fulm-mean"):
            params.update(k=self.fulm_k, threshold=self.fulm_threshold)
        return params

    def _validate_dp2u(self) -> None:
        if self.dp2u_method not in DP2U_METHODS:
            raise ValueError(f"dp2u-method must be one of {DP2U_METHODS}, got {self.dp2u_method!r}")
        if self.scenario != "tofu":
            raise ValueError(f"strategy 'dp2u' runs on the tofu scenario, not {self.scenario!r}")
        if not 0 < self.dp2u_epsilon < math.inf:
            raise ValueError(f"dp2u-epsilon must be positive and finite, got {self.dp2u_epsilon}")
        if not 0 < self.dp2u_delta < 1:
            raise ValueError(f"dp2u-delta must be in (0, 1), got {self.dp2u_delta}")
        for name in (
            "dp2u_clients",
            "dp2u_dp_rounds",
            "dp2u_finetune_rounds",
            "dp2u_retrain_rounds",
            "dp2u_local_epochs",
            "dp2u_batch_size",
            "dp2u_dp_batch_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1")
        for name in ("dp2u_clip", "dp2u_dp_lr", "dp2u_lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name.replace('_', '-')} must be > 0")
        self.forget_request()  # syntax now; names and indices against the data in the pipeline

    def forget_request(self) -> list[ForgetRequest]:
        """The parsed ``dp2u-forget-request`` (inline JSON or a JSON file); [] when unset."""
        text = self.dp2u_forget_request.strip()
        if not text:
            return []
        if not text.startswith("{"):
            path = Path(text).expanduser()
            if not path.is_file():
                raise ValueError(f"dp2u-forget-request: {text!r} is neither JSON nor a file")
            text = path.read_text()
        return parse_forget_request(text)

    @property
    def num_clients(self) -> int:
        if self.strategy == "dp2u":
            return self.dp2u_clients
        return self.num_forget_clients + self.num_retain_clients

    def resolved_output_dir(self) -> Path:
        """Absolute output folder: ``output-dir`` or ``outputs/<timestamp>`` under the cwd."""
        if self.output_dir:
            path = Path(self.output_dir).expanduser()
            if not path.is_absolute():
                raise ValueError(
                    f"output-dir must be an absolute path (the ServerApp's working folder is "
                    f"wherever the SuperLink runs), got {self.output_dir!r}"
                )
            return path
        return (Path.cwd() / "outputs" / self.output_name(time.strftime("%Y%m%d-%H%M%S"))).resolve()

    def output_name(self, stamp: str) -> str:
        """``<scenario>-<strategy>-<stamp>``, the strategy made safe for a folder name."""
        strategy = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.strategy)
        return f"{self.scenario}-{strategy}-{stamp}"

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if out["mpu_secret"]:
            out["mpu_secret"] = ""  # the server secret is never written to results
        return {k.replace("_", "-"): (str(v) if v == math.inf else v) for k, v in out.items()}
