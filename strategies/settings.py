"""The flat run config (``[tool.flwr.app.config]``) parsed into typed settings."""

from __future__ import annotations

import dataclasses
import math
import re
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from fedunlearn.benchmarks.wmdp import HAZARD_DOMAINS
from fedunlearn.dp2u import ForgetRequest, parse_forget_request
from fedunlearn.models.substrate import SubstrateConfig
from fedunlearn.objectives import objective_requirements
from fedunlearn.scenarios import SCENARIOS, ScenarioParams
from fedunlearn.training.lora import parse_layers
from strategies.merge_plugins import check_merge_call, resolve_merge
from strategies.secret_files import check_secret_keys
from strategies.settings_rules import RunConfigError, check_value, close_matches, key_name

#: defaults for a registry model (``model``) where a key is left on its default (a
#: ``model-path`` checkpoint keeps the scenario's defaults: its size is unknown here),
#: sized for a CPU: LoRA on the query and value projections of every layer (a dense task
#: vector + Fisher of about 106 MB per client for SmolLM2-135M, against 850 MB for all seven
#: projections), two forget clients and one retain client holding the 40 QA of the default
#: subset's two retain authors, fewer Fisher batches and retain steps, the chat answers'
#: length for generation, and a lower learning rate than the tiny model's
PRETRAINED_DEFAULTS: dict[str, Any] = {
    "lora_targets": "q_proj,v_proj",
    "num_forget_clients": 2,
    "retain_samples": 40,
    "fisher_batches": 4,
    "retain_steps": 10,
    "eval_max_new_tokens": 64,
    "eval_batch_size": 16,
    "eval_retain_samples": 20,
    "forget_lr": 2e-4,
    "retain_lr": 2e-4,
}


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
    model: str = "builtin"  # builtin | smollm2-135m (a registry model, fine-tuned on the data)
    model_path: str = ""
    dtype: str = "auto"
    load_in_4bit: bool = False
    cache_dir: str = ""
    # a node's local copy of the initial checkpoint (simulated nodes; a SuperNode's node config
    # wins): it is sent only the weights that differ from it (wire.delivery)
    base_checkpoint: str = ""
    # built-in substrate (ignored with model-path)
    substrate_hidden_size: int = 192
    substrate_layers: int = 4
    substrate_intermediate_size: int = 512
    substrate_pretrain_epochs: int = 2
    substrate_finetune_epochs: int = 16
    substrate_finetune_lr: float = 2e-3
    substrate_background_documents: int = 1500
    # a pretrained model (model != builtin): its fine-tuning on the scenario's data
    tofu_subset_authors: int = 0  # real TOFU files: authors in play; 0 = all on CUDA, 4 on CPU
    muse_subset_texts: int = 0  # real MUSE files: items of each list; 0 = all on CUDA, 16 on CPU
    model_finetune_epochs: int = 6
    model_finetune_lr: float = 1e-4
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
    # what a client uploads (fedunlearn.upload_codec)
    task_vector_upload: str = "factors"  # factors (LoRA's B, A, s) | dense
    fisher_upload: str = "topk"  # topk | bf16 | dense
    fisher_upload_fraction: float = 0.1  # α' of topk; >= alpha for FIRM (default = alpha)
    stream_uploads: bool = True  # uploads to disk as read, merged from memory maps
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
    mpu_publish: str = "per-client"  # per-client | per-round (one set of copies per round)
    mpu_kappa: float = 0.01
    mpu_permute_groups: bool = True
    mpu_shared_kappa: float = 0.0  # noise common to a client's copies (κ_η·RMS); 0 = none
    mpu_secret: str = ""  # refused: a secret in the run config leaks (secret_files)
    mpu_secret_file: str = ""  # a 0600 file holding the server secret; "" = env or fresh
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
    # general utility of a real model (model or model-path): zero-shot MMLU on a seeded subset
    mmlu_path: str = ""  # folder of MMLU CSVs; "" = the "mmlu" folder beside data-path, if any
    mmlu_subjects: int = 10
    mmlu_per_subject: int = 5  # 0 = no MMLU
    eval_max_new_tokens: int = 32
    eval_batch_size: int = 64
    output_dir: str = ""
    save_uploads: bool = False
    evaluate: bool = True  # false: no benchmark evaluation before / after (no metrics)
    resume: bool = True  # continue from <output-dir>/checkpoint (same config); false = afresh
    round_timeout: float = 3600.0
    node_wait_timeout: float = 120.0
    # bad clients (issue 7): reply validation, dropouts, robust options before the merge
    min_replies: int = 0  # 0 = one valid forget update per assigned forget domain
    max_upload_mb: float = 0.0  # 0 = the largest honest reply (float64 task vector + Fisher)
    robust_norm_bound: float = 0.0  # clip task vectors to this × role median norm; 0 = off
    fisher_cap: float = 0.0  # cap Fisher mass per tensor at this × role median; 0 = off
    # sanity bounds against poisoned uploads (issue 13; fedunlearn.merging.sanity)
    client_norm_ratio: float = 100.0  # exclude task vectors above this × role median; 0 = off
    max_update_ratio: float = 100.0  # fail a round whose update exceeds this × ‖θ‖; 0 = off

    @classmethod
    def from_run_config(cls, run_config: dict[str, Any]) -> RunSettings:
        """Parse Flower's run config and check every key (:meth:`validate`) before any work;
        unknown keys, wrong types and bad values raise :class:`RunConfigError`."""
        known = {key_name(f.name): f for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, raw in run_config.items():
            if key not in known:
                listing = close_matches(key, known) or f"; the keys are: {', '.join(sorted(known))}"
                raise RunConfigError(f"unknown run-config key {key!r}{listing}")
            field = known[key]
            values[field.name] = _typed_value(key, raw, type(field.default))
        settings = cls(**values).resolved()
        settings.validate()
        return settings

    def resolved(self) -> RunSettings:
        """A copy where every key left on its "scenario default" value ("auto", 0, -1) takes
        the scenario's default (``Scenario.defaults``); explicit values are kept."""
        check_value("scenario", self.scenario, str)
        unset = {f.name: f.default for f in fields(self)}
        defaults = dict(SCENARIOS[self.scenario].defaults)
        registry_model = self.model != "builtin"
        if registry_model:
            defaults.update(PRETRAINED_DEFAULTS)
        changes = {
            name: value for name, value in defaults.items() if getattr(self, name) == unset[name]
        }
        if self.tofu_subset_authors == 0 and self.data_path and registry_model:
            changes["tofu_subset_authors"] = 200 if torch.cuda.is_available() else 4
        if (
            self.scenario == "muse"
            and self.muse_subset_texts == 0
            and self.data_path
            and registry_model
        ):
            # the published lists hold 100 items each (fedunlearn.benchmarks.muse_files)
            changes["muse_subset_texts"] = 100 if torch.cuda.is_available() else 16
        return dataclasses.replace(self, **changes)

    def validate(self) -> None:
        """Every key against its rule (:data:`strategies.settings_rules.RULES`: names, types,
        ranges, finiteness; merges and plug-ins resolved), then the combinations of keys.
        Raises :class:`RunConfigError`, a ``ValueError``."""
        for f in fields(self):
            check_value(f.name, getattr(self, f.name), type(f.default))
        self._validate_model_and_data()
        self._validate_objective()
        self._validate_merge()
        self._validate_clients()
        check_secret_keys(self.mpu_secret, self.mpu_secret_file)
        if self.strategy == "dp2u":
            self._validate_dp2u()
            if not self.evaluate:
                raise RunConfigError(
                    "evaluate=false does not apply to strategy='dp2u': its stages are compared "
                    "by their evaluations"
                )
        elif self.dp2u_forget_request:
            raise RunConfigError(
                "dp2u-forget-request needs strategy='dp2u' (the other strategies forget the "
                "scenario's forget-percent split)"
            )

    def _validate_model_and_data(self) -> None:
        """``data-path`` with a real model, 4-bit with LoRA, WMDP's ``forget-domains``."""
        if self.data_path and not self.model_path and self.model == "builtin":
            raise RunConfigError(
                "data-path (real benchmark files) needs a real model: model='smollm2-135m' "
                "(fine-tuned on the files) or model-path; the built-in substrate is trained on "
                "the generated data and its reference would not match the files"
            )
        if self.model_path and self.model != "builtin":
            raise RunConfigError(
                f"set either model ({self.model!r}) or model-path ({self.model_path!r}), not both"
            )
        if self.finetune == "full" and self.load_in_4bit:
            raise RunConfigError("finetune='full' cannot train 4-bit weights; use LoRA with 4-bit")
        unknown = [d for d in self._forget_domain_list() if d not in HAZARD_DOMAINS]
        if self.scenario == "wmdp" and (unknown or not self._forget_domain_list()):
            raise RunConfigError(
                f"run-config key 'forget-domains' = {self.forget_domains!r}: must name hazard "
                f"domains ({', '.join(HAZARD_DOMAINS)}); unknown: {unknown}"
            )

    def _validate_objective(self) -> None:
        """The forget objective fits the scenario's data and the clients' retain samples."""
        requirements = objective_requirements(self.objective)
        if self.objective == "nll":
            raise RunConfigError(
                "objective 'nll' trains ON the forget data; pick a forget objective"
            )
        if requirements.needs_alternate and not SCENARIOS[self.scenario].qa_forget_data:
            raise RunConfigError(
                f"objective {self.objective!r} prefers a refusal answer to the forget answer, "
                f"but the {self.scenario} scenario's forget clients hold plain text"
            )
        if requirements.needs_retain and self.local_retain_samples < 1:
            raise RunConfigError(
                f"objective {self.objective!r} needs retain data on the forget clients: set "
                "local-retain-samples >= 1"
            )

    def _validate_merge(self) -> None:
        """MPU's copies and σ reference; the merge callable with this run's parameters."""
        if self.strategy == "mpu" and self.mpu_mode == "mpu" and self.mpu_copies < 2:
            raise RunConfigError(
                f"run-config key 'mpu-copies' = {self.mpu_copies}: mpu-mode='mpu' needs >= 2 "
                "(zero-sum noise over the copies)"
            )
        if (
            self.strategy == "mpu"
            and self.mpu_sigma_source == "task-vector"
            and self.model_path
            and not self.mpu_pretrained_path
        ):
            raise RunConfigError(
                "mpu-sigma-source='task-vector' with model-path needs mpu-pretrained-path "
                "(the checkpoint the model was fine-tuned from)"
            )
        if self.strategy == "dp2u":
            return
        self._validate_fisher_upload()
        key, merge = (
            ("mpu-merge", self.mpu_merge) if self.strategy == "mpu" else ("strategy", self.strategy)
        )
        try:
            check_merge_call(resolve_merge(merge), self.merge_parameters())
        except ValueError as err:
            raise RunConfigError(f"run-config key {key!r} = {merge!r}: {err}") from err

    def _validate_fisher_upload(self) -> None:
        """A top-k Fisher upload keeps at least FIRM's own top-``alpha`` of every tensor."""
        firm = "firm" in (self.strategy, self.mpu_merge if self.strategy == "mpu" else "")
        if firm and self.fisher_upload == "topk" and self.fisher_upload_fraction < self.alpha:
            raise RunConfigError(
                f"run-config key 'fisher-upload-fraction' = {self.fisher_upload_fraction:g} is "
                f"below alpha = {self.alpha:g}: FIRM keeps each client's top-alpha Fisher "
                "entries, so a top-k upload must keep at least that many"
            )

    def _validate_clients(self) -> None:
        """``min-replies`` within the run's clients; a WMDP forget client per forget domain."""
        if self.min_replies > self.num_clients:
            raise RunConfigError(
                f"run-config key 'min-replies' = {self.min_replies}: must be in "
                f"[0, {self.num_clients}] (the run's clients)"
            )
        domains = self._forget_domain_list()
        if self.scenario == "wmdp" and self.num_forget_clients < len(domains):
            raise RunConfigError(
                f"run-config key 'num-forget-clients' = {self.num_forget_clients}: fewer than "
                f"the {len(domains)} forget domains {self.forget_domains!r}"
            )

    def _forget_domain_list(self) -> list[str]:
        return [d.strip() for d in self.forget_domains.split(",") if d.strip()]

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
            finetune_lr=self.substrate_finetune_lr,
            background_documents=self.substrate_background_documents,
        )

    def scenario_params(self) -> ScenarioParams:
        """The scenario's data and client-layout parameters."""
        return ScenarioParams(
            seed=self.seed,
            data_path=self.data_path,
            num_authors=self.num_authors,
            qa_per_author=self.qa_per_author,
            subset_authors=self.tofu_subset_authors,
            subset_texts=self.muse_subset_texts,
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
        """DP2U runs on TOFU; the forget request parses (its names and indices are checked
        against the data in the pipeline)."""
        if self.scenario != "tofu":
            raise RunConfigError(
                f"strategy 'dp2u' runs on the tofu scenario, not {self.scenario!r}"
            )
        try:
            self.forget_request()
        except ValueError as err:
            raise RunConfigError(f"run-config key 'dp2u-forget-request': {err}") from err

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

    def mmlu_folder(self) -> Path | None:
        """Where MMLU is read for a real model's general utility, or None (no MMLU): the
        built-in model is never scored on it (it knows no English beyond its benchmark)."""
        if self.mmlu_per_subject == 0 or (self.model == "builtin" and not self.model_path):
            return None
        if self.mmlu_path:
            return Path(self.mmlu_path).expanduser()
        beside = Path(self.data_path).expanduser().parent / "mmlu" if self.data_path else None
        return beside if beside is not None and beside.is_dir() else None

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


def _typed_value(key: str, raw: Any, kind: type) -> Any:
    """``raw`` as a ``kind`` value: ints widen to float, "inf" is infinity for a float key."""
    if kind is float and isinstance(raw, str) and raw.strip().lower() in ("inf", "infinity"):
        return math.inf
    if kind is float and isinstance(raw, int | float) and not isinstance(raw, bool):
        return float(raw)
    if isinstance(raw, kind) and not (kind is int and isinstance(raw, bool)):
        return raw
    raise RunConfigError(f"run-config key {key!r} must be {kind.__name__}, got {raw!r}")
