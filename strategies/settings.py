"""The run configuration (``[tool.flwr.app.config]`` and its option-group tables) parsed into
typed settings: :class:`RunSettings`, a few run-wide keys plus one frozen options dataclass
per component (defined next to that component, see :mod:`fedunlearn.options`)."""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from fedunlearn.benchmarks.wmdp import HAZARD_DOMAINS
from fedunlearn.dp2u import Dp2uOptions, ForgetRequest, json_or_file, parse_forget_request
from fedunlearn.evaluation.options import EvalOptions
from fedunlearn.learn import LearnOptions
from fedunlearn.merging.firm import FirmOptions
from fedunlearn.merging.fulm import FulmOptions
from fedunlearn.merging.ties import TiesOptions
from fedunlearn.models.options import ModelOptions, SubstrateOptions
from fedunlearn.models.substrate import SubstrateConfig
from fedunlearn.objectives import objective_requirements
from fedunlearn.objectives.options import ObjectiveOptions
from fedunlearn.options import (
    COUNT,
    POSITIVE_INT,
    POSITIVE_OR_SCENARIO,
    OneOf,
    Parsed,
    check_options,
    check_value,
    close_matches,
    field_default,
    key_name,
    option,
    typed_value,
)
from fedunlearn.requests import RequestsOptions, read_schedule
from fedunlearn.scenarios import SCENARIOS, ScenarioParams
from fedunlearn.scenarios.options import ScenarioOptions
from fedunlearn.training.lora import parse_layers
from fedunlearn.training.options import LoraOptions, TrainingOptions
from fedunlearn.upload_codec import UploadOptions
from strategies.merge_plugins import check_merge_call, resolve_merge
from strategies.mpu_options import MpuOptions
from strategies.renamed_keys import RENAMED_KEYS, RunConfigError
from strategies.secret_files import check_secret_keys
from strategies.server_options import ServerOptions

__all__ = ["BUILTIN_DEFAULTS", "PRETRAINED_DEFAULTS", "RunConfigError", "RunSettings"]

#: defaults of the keys whose value depends on the model, for the built-in model and a
#: ``model.path`` checkpoint (its size is unknown here); a scenario's own defaults
#: (``Scenario.defaults``) take precedence over these, a registry model's over both, and a
#: scenario's defaults for a registry model (``Scenario.pretrained_defaults``) over all three
BUILTIN_DEFAULTS: dict[str, Any] = {
    "scenario.retain-samples": 200,
    "training.fisher-batches": 20,
    "training.retain-steps": 40,
    "training.retain-lr": 1e-3,
    "eval.max-new-tokens": 32,
    "eval.batch-size": 64,
    "eval.retain-samples": 200,
    "model.finetune-epochs": 6,
    "model.finetune-lr": 1e-4,
}

#: defaults for a registry model (``model``) where a key is left unset,
#: sized for a CPU: LoRA on the query and value projections of every layer (a dense task
#: vector + Fisher of about 106 MB per client for SmolLM2-135M, against 850 MB for all seven
#: projections), two forget clients and one retain client holding the 40 QA of the default
#: subset's two retain authors, fewer Fisher batches and retain steps, the chat answers'
#: length for generation, and a lower learning rate than the tiny model's
PRETRAINED_DEFAULTS: dict[str, Any] = {
    "lora.targets": "q_proj,v_proj",
    "scenario.num-forget-clients": 2,
    "scenario.retain-samples": 40,
    "training.fisher-batches": 4,
    "training.retain-steps": 10,
    "eval.max-new-tokens": 64,
    "eval.batch-size": 16,
    "eval.retain-samples": 20,
    "training.forget-lr": 2e-4,
    "training.retain-lr": 2e-4,
}


#: The pipelines a run can follow (``pipeline``): unlearning by a merge, or DP2Unlearning.
PIPELINE_NAMES = ("unlearn", "dp2u")
#: What may wrap the merge (``wrapper``).
WRAPPERS = ("none", "mpu")


def _check_merge(name: str) -> None:
    """A merge function: registered, ``module:function`` or an entry point (imported now)."""
    if name in ("mpu", "dp2u"):
        raise ValueError(
            f"{name!r} is not a merge: set wrapper = 'mpu' or pipeline = 'dp2u' and name the "
            "merge here (firm, ties, ...)"
        )
    resolve_merge(name)


@dataclass(frozen=True)
class RunSettings:
    """The run configuration: a few run-wide keys and one options group per component.

    Keys are the field names with ``-``; a group's keys are ``<group>.<key>``
    (``firm.alpha``), as Flower flattens the tables ``[tool.flwr.app.config.<group>]``.
    """

    seed: int = option(
        0, "seeds data generation, model building, client training and sampling", COUNT
    )
    num_rounds: int = option(1, "federated rounds (FIRM is single-round)", POSITIVE_INT)
    pipeline: str = option(
        "unlearn",
        "unlearn: clients train and upload, the server merges; dp2u: DP2Unlearning's "
        "federated stages (see the dp2u group)",
        OneOf(lambda: PIPELINE_NAMES),
    )
    merge: str = option(
        "firm",
        "the server merge: firm, fulm, fulm-mean, ties, sum, avg, a module:function plug-in "
        "or an entry point",
        Parsed(_check_merge, "a registered merge, module:function or an entry point"),
    )
    wrapper: str = option(
        "none",
        "none, or mpu: perturbed, reparameterised copies around the merge",
        OneOf(lambda: WRAPPERS),
    )
    gamma: float = option(
        0.0,
        "global scale γ of the merged update (scenario: tofu 8, wmdp 4, muse 3; muse on a "
        "registry model 0.5)",
        POSITIVE_OR_SCENARIO,
    )
    evaluate: bool = option(
        True,
        "evaluate the model before and after (and the reference); false: no metrics, for "
        "runs checked otherwise",
    )
    resume: bool = option(
        True,
        "continue a killed run from <output-dir>/checkpoint (same config only); false = "
        "remove that checkpoint's own files and start afresh",
    )
    output_dir: str = option(
        "", 'absolute output folder; "" = outputs/<scenario>-<strategy>-<time> under the cwd'
    )
    save_uploads: bool = option(
        False, "also save every client's task vector and Fisher (safetensors)"
    )
    scenario: ScenarioOptions = field(default_factory=ScenarioOptions)
    model: ModelOptions = field(default_factory=ModelOptions)
    substrate: SubstrateOptions = field(default_factory=SubstrateOptions)
    training: TrainingOptions = field(default_factory=TrainingOptions)
    lora: LoraOptions = field(default_factory=LoraOptions)
    upload: UploadOptions = field(default_factory=UploadOptions)
    objective: ObjectiveOptions = field(default_factory=ObjectiveOptions)
    firm: FirmOptions = field(default_factory=FirmOptions)
    ties: TiesOptions = field(default_factory=TiesOptions)
    fulm: FulmOptions = field(default_factory=FulmOptions)
    mpu: MpuOptions = field(default_factory=MpuOptions)
    dp2u: Dp2uOptions = field(default_factory=Dp2uOptions)
    learn: LearnOptions = field(default_factory=LearnOptions)
    requests: RequestsOptions = field(default_factory=RequestsOptions)
    eval: EvalOptions = field(default_factory=EvalOptions)
    server: ServerOptions = field(default_factory=ServerOptions)

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> RunSettings:
        """Parse Flower's (flattened, dotted) run config and check every key (:meth:`validate`)
        before any work; unknown or renamed keys, wrong types and bad values raise
        :class:`RunConfigError`."""
        top: dict[str, Any] = {}
        groups: dict[str, dict[str, Any]] = {}
        for key, raw in run_config.items():
            group, name, f = _field_of(key)
            value = typed_value(key, raw, type(field_default(f)))
            if group is None:
                top[f.name] = value
            else:
                groups.setdefault(group, {})[f.name] = value
        built = {g: GROUP_TYPES[g](**values) for g, values in groups.items()}
        settings = cls(**top, **built).resolved()
        settings.validate()
        return settings

    def resolved(self) -> RunSettings:
        """A copy where every key left unset (on its field default, "auto", 0 or -1, which
        stands for "the default") takes the default of the model and scenario, in rising
        precedence :data:`BUILTIN_DEFAULTS`, the scenario's (``Scenario.defaults``, dotted
        keys), :data:`PRETRAINED_DEFAULTS` for a registry model, then the scenario's for a
        registry model (``Scenario.pretrained_defaults``); a key set to any other value keeps
        it, also when it equals what the default would be."""
        check_value("scenario.name", self.scenario.name, _field_of("scenario.name")[2])
        scenario_type = SCENARIOS[self.scenario.name]
        defaults = {**BUILTIN_DEFAULTS, **scenario_type.defaults}
        registry_model = self.model.name != "builtin"
        if registry_model:
            defaults.update(PRETRAINED_DEFAULTS)
            defaults.update(scenario_type.pretrained_defaults)
        scenario = self.scenario
        if scenario.tofu_subset_authors == 0 and scenario.data_path and registry_model:
            defaults["scenario.tofu-subset-authors"] = 200 if torch.cuda.is_available() else 4
        muse_files = scenario.name == "muse" and scenario.data_path and registry_model
        if muse_files and scenario.muse_subset_texts == 0:  # the published lists hold 100 items
            defaults["scenario.muse-subset-texts"] = 100 if torch.cuda.is_available() else 16
        resolved = self
        for key, value in defaults.items():
            resolved = _with_default(resolved, key, value)
        return resolved

    def validate(self) -> None:
        """Every key against its rule (names, types, ranges, finiteness; merges and plug-ins
        resolved), then the combinations of keys. Raises :class:`RunConfigError`."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in GROUP_TYPES:
                check_options(f.name + ".", value)
            else:
                check_value(key_name(f.name), value, f)
        self._validate_model_and_data()
        self._validate_objective()
        self._validate_merge()
        self._validate_clients()
        check_secret_keys(self.mpu.secret, self.mpu.secret_file)
        self._validate_learn()
        if self.pipeline == "dp2u":
            self._validate_dp2u()
        elif self.dp2u.forget_request:
            raise RunConfigError(
                "dp2u.forget-request needs pipeline='dp2u' (an unlearning run forgets the "
                "scenario's forget-percent split)"
            )

    def _validate_model_and_data(self) -> None:
        """``data-path`` with a real model, 4-bit with LoRA, WMDP's ``forget-domains``."""
        model, scenario = self.model, self.scenario
        if scenario.data_path and not model.path and model.name == "builtin":
            raise RunConfigError(
                "scenario.data-path (real benchmark files) needs a real model: "
                "model.name='smollm2-135m' (fine-tuned on the files) or model.path; the "
                "built-in substrate is trained on the generated data and its reference would "
                "not match the files"
            )
        if model.path and model.name != "builtin":
            raise RunConfigError(
                f"set either model.name ({model.name!r}) or model.path ({model.path!r}), not both"
            )
        if self.training.finetune == "full" and model.load_in_4bit:
            raise RunConfigError(
                "training.finetune='full' cannot train 4-bit weights; use LoRA with 4-bit"
            )
        domains = scenario.forget_domain_list()
        unknown = [d for d in domains if d not in HAZARD_DOMAINS]
        if scenario.name == "wmdp" and (unknown or not domains):
            raise RunConfigError(
                f"run-config key 'scenario.forget-domains' = {scenario.forget_domains!r}: must "
                f"name hazard domains ({', '.join(HAZARD_DOMAINS)}); unknown: {unknown}"
            )

    def _validate_learn(self) -> None:
        """Federated learning and a schedule of deletion requests run in an unlearning run, on
        a scenario whose knowledge its clients hold (``Scenario.learn_layout``); the schedule
        names a request for every round (syntax checked here, names and records against the
        clients' data before the first round)."""
        if self.requests.schedule:
            if self.pipeline != "unlearn" or self.scenario.name != "tofu":
                raise RunConfigError(
                    "requests.schedule runs in pipeline='unlearn' on scenario 'tofu', not "
                    f"pipeline={self.pipeline!r} on {self.scenario.name!r}"
                )
            try:
                read_schedule(self.requests.schedule, self.num_rounds)
            except ValueError as err:
                raise RunConfigError(str(err)) from err
        if self.learn.source != "federated":
            return
        if self.pipeline != "unlearn":
            raise RunConfigError(
                "learn.source='federated' learns the model an unlearning run starts from; "
                "pipeline='dp2u' trains its own federated stages (the dp2u group)"
            )
        if not SCENARIOS[self.scenario.name].learns_federated:
            federated = [n for n, t in SCENARIOS.items() if t.learns_federated]
            raise RunConfigError(
                f"learn.source='federated' runs on the scenarios {federated}, not "
                f"{self.scenario.name!r}: its knowledge records are not the clients' records"
            )

    def _validate_objective(self) -> None:
        """The forget objective fits the scenario's data and the clients' retain samples."""
        name = self.objective.name
        requirements = objective_requirements(name)
        if name == "nll":
            raise RunConfigError(
                "objective.name 'nll' trains ON the forget data; pick a forget objective"
            )
        if requirements.needs_alternate and not SCENARIOS[self.scenario.name].qa_forget_data:
            raise RunConfigError(
                f"objective {name!r} prefers a refusal answer to the forget answer, but the "
                f"{self.scenario.name} scenario's forget clients hold plain text"
            )
        if requirements.needs_retain and self.scenario.local_retain_samples < 1:
            raise RunConfigError(
                f"objective {name!r} needs retain data on the forget clients: set "
                "scenario.local-retain-samples >= 1"
            )

    def _validate_merge(self) -> None:
        """MPU's copies and σ reference; the merge callable with this run's parameters."""
        mpu = self.mpu
        if self.wrapper == "mpu" and mpu.mode == "mpu" and mpu.copies < 2:
            raise RunConfigError(
                f"run-config key 'mpu.copies' = {mpu.copies}: mpu.mode='mpu' needs >= 2 "
                "(zero-sum noise over the copies)"
            )
        if (
            self.wrapper == "mpu"
            and mpu.sigma_source == "task-vector"
            and self.model.path
            and not mpu.pretrained_path
        ):
            raise RunConfigError(
                "mpu.sigma-source='task-vector' with model.path needs mpu.pretrained-path "
                "(the checkpoint the model was fine-tuned from)"
            )
        if self.pipeline == "dp2u":
            if self.wrapper != "none":
                raise RunConfigError("wrapper = 'mpu' does not apply to pipeline = 'dp2u'")
            return
        self._validate_fisher_upload()
        try:
            check_merge_call(resolve_merge(self.merge), self.merge_parameters())
        except ValueError as err:
            raise RunConfigError(f"run-config key 'merge' = {self.merge!r}: {err}") from err

    def _validate_mixed(self) -> None:
        """``scenario.mixed-clients``: each folds a forget and a retain client onto one node
        (a schedule: that many of its clients); single-copy unlearning rounds only."""
        scenario, mixed = self.scenario, self.scenario.mixed_clients
        if mixed == 0:
            return
        key = f"run-config key 'scenario.mixed-clients' = {mixed}"
        if self.pipeline != "unlearn":
            raise RunConfigError(f"{key}: mixed-role clients upload in pipeline='unlearn' only")
        if self.wrapper == "mpu":
            raise RunConfigError(
                f"{key}: wrapper='mpu' sends each node m perturbed copies; a mixed-role "
                "node's second upload is not supported there (use separate retain clients)"
            )
        if self.requests.schedule:
            if mixed > self.num_clients:
                raise RunConfigError(f"{key}: more than the run's {self.num_clients} clients")
            return
        most = min(scenario.num_forget_clients, scenario.num_retain_clients)
        if mixed > most:
            raise RunConfigError(
                f"{key}: each mixed-role client takes over one retain client's records; the "
                f"run has {scenario.num_forget_clients} forget and "
                f"{scenario.num_retain_clients} retain clients (at most {most})"
            )

    def _validate_fisher_upload(self) -> None:
        """A top-k Fisher upload keeps at least FIRM's own top-``alpha`` of every tensor."""
        upload, alpha = self.upload, self.firm.alpha
        if self.merge == "firm" and upload.fisher == "topk" and upload.fisher_fraction < alpha:
            raise RunConfigError(
                f"run-config key 'upload.fisher-fraction' = {upload.fisher_fraction:g} is "
                f"below firm.alpha = {alpha:g}: FIRM keeps each client's top-alpha Fisher "
                "entries, so a top-k upload must keep at least that many"
            )

    def _validate_clients(self) -> None:
        """``min-replies`` within the run's clients; a WMDP forget client per forget domain."""
        if self.server.min_replies > self.num_clients:
            raise RunConfigError(
                f"run-config key 'server.min-replies' = {self.server.min_replies}: must be in "
                f"[0, {self.num_clients}] (the run's clients)"
            )
        scenario = self.scenario
        self._validate_mixed()
        domains = scenario.forget_domain_list()
        if scenario.name == "wmdp" and scenario.num_forget_clients < len(domains):
            raise RunConfigError(
                f"run-config key 'scenario.num-forget-clients' = {scenario.num_forget_clients}: "
                f"fewer than the {len(domains)} forget domains {scenario.forget_domains!r}"
            )

    def substrate_config(self) -> SubstrateConfig:
        """The built-in substrate this run uses (its hash names the cache folder)."""
        sc, sub = self.scenario, self.substrate
        return SubstrateConfig(
            scenario=sc.name,
            forget_domains=sc.forget_domains,
            seed=self.seed,
            num_authors=sc.num_authors,
            qa_per_author=sc.qa_per_author,
            forget_percent=sc.forget_percent,
            hidden_size=sub.hidden_size,
            num_hidden_layers=sub.layers,
            intermediate_size=sub.intermediate_size,
            pretrain_epochs=sub.pretrain_epochs,
            finetune_epochs=sub.finetune_epochs,
            finetune_lr=sub.finetune_lr,
            background_documents=sub.background_documents,
        )

    def scenario_params(self) -> ScenarioParams:
        """The scenario's data and client-layout parameters."""
        sc = self.scenario
        needs_retain = objective_requirements(self.objective.name).needs_retain
        return ScenarioParams(
            seed=self.seed,
            data_path=sc.data_path,
            num_authors=sc.num_authors,
            qa_per_author=sc.qa_per_author,
            subset_authors=sc.tofu_subset_authors,
            subset_texts=sc.muse_subset_texts,
            forget_percent=sc.forget_percent,
            num_forget_domains=sc.num_forget_domains,
            retain_layout=sc.retain_layout,
            forget_domains=sc.forget_domains,
            num_forget_clients=sc.num_forget_clients,
            num_retain_clients=sc.num_retain_clients,
            retain_samples=sc.retain_samples,
            local_retain_samples=sc.local_retain_samples if needs_retain else 0,
            eval_retain_samples=self.eval.retain_samples,
        )

    def objective_options(self) -> dict[str, float]:
        """The objective options (``npo_beta``, ``rmu_layer``, ...) as floats for the client."""
        return self.objective.client_options(self.seed)

    def lora_layer_indices(self) -> tuple[int, ...] | None:
        """``lora.layers`` as layer indices; None = every layer."""
        return parse_layers(self.lora.layers)

    def for_model(self, num_hidden_layers: int) -> RunSettings:
        """Settings completed for a model with ``num_hidden_layers`` decoder layers: an unset
        ``objective.rmu-layer`` becomes the middle layer L = n // 2 and ``lora.layers=auto``
        the scenario's choice for that depth (WMDP: L−1 and L; others: all layers). Raises
        when a layer index lies outside the model."""
        scenario = SCENARIOS[self.scenario.name]
        rmu = self.objective.rmu_layer
        layer = rmu if rmu >= 0 else num_hidden_layers // 2
        lora_layers = self.lora.layers
        if lora_layers == "auto":
            lora_layers = scenario.default_lora_layers(num_hidden_layers, layer)
        resolved = dataclasses.replace(
            self,
            objective=dataclasses.replace(self.objective, rmu_layer=layer),
            lora=dataclasses.replace(self.lora, layers=lora_layers),
        )
        bad = [i for i in resolved.lora_layer_indices() or () if not 0 <= i < num_hidden_layers]
        if bad or not 0 <= layer < num_hidden_layers:
            raise ValueError(
                f"the model has layers 0..{num_hidden_layers - 1}, but lora.layers="
                f"{lora_layers!r} / objective.rmu-layer={layer} point outside them"
            )
        return resolved

    def client_seed(self) -> int:
        """The seed of the clients' local training: ``training.seed``, or ``seed`` (-1)."""
        return self.training.seed if self.training.seed >= 0 else self.seed

    def activation_checkpointing(self) -> bool:
        """Whether clients recompute activations in training (``training.activation-
        checkpointing``; auto: for a registry model or a checkpoint, not the built-in model)."""
        mode = self.training.activation_checkpointing
        if mode == "auto":
            return self.model.name != "builtin" or bool(self.model.path)
        return mode == "on"

    def merge_parameters(self) -> dict[str, Any]:
        """Candidate merge keyword arguments; each merge takes those it names: ``gamma`` and
        FIRM's options for every merge, and the ties / fulm group for those merges."""
        params: dict[str, Any] = {"gamma": self.gamma, **dataclasses.asdict(self.firm)}
        if self.merge == "ties":
            params.update(dataclasses.asdict(self.ties))
        elif self.merge in ("fulm", "fulm-mean"):
            params.update(dataclasses.asdict(self.fulm))
        return params

    def _validate_dp2u(self) -> None:
        """DP2U runs on TOFU; the forget request parses (its names and indices are checked
        against the data in the pipeline)."""
        if self.scenario.name != "tofu":
            raise RunConfigError(
                f"pipeline 'dp2u' runs on the tofu scenario, not {self.scenario.name!r}"
            )
        if not self.evaluate:
            raise RunConfigError(
                "evaluate=false does not apply to pipeline='dp2u': its stages are compared by "
                "their evaluations"
            )
        try:
            self.forget_request()
        except ValueError as err:
            raise RunConfigError(f"run-config key 'dp2u.forget-request': {err}") from err

    def forget_request(self) -> list[ForgetRequest]:
        """The parsed ``dp2u.forget-request`` (inline JSON or a JSON file); [] when unset."""
        if not self.dp2u.forget_request.strip():
            return []
        return parse_forget_request(json_or_file("dp2u.forget-request", self.dp2u.forget_request))

    @property
    def num_clients(self) -> int:
        if self.pipeline == "dp2u":
            return self.dp2u.clients
        clients = self.scenario.num_forget_clients + self.scenario.num_retain_clients
        if self.requests.schedule:  # every client holds records; mixed-role when asked
            return clients
        return clients - self.scenario.mixed_clients  # a mixed-role node is two clients

    @property
    def strategy_label(self) -> str:
        """What the server runs, in one word: ``dp2u``, ``mpu`` or the merge's name."""
        if self.pipeline == "dp2u":
            return "dp2u"
        return "mpu" if self.wrapper == "mpu" else self.merge

    def mmlu_folder(self) -> Path | None:
        """Where MMLU is read for a real model's general utility, or None (no MMLU): the
        built-in model is never scored on it (it knows no English beyond its benchmark)."""
        ev, model = self.eval, self.model
        if ev.mmlu_per_subject == 0 or (model.name == "builtin" and not model.path):
            return None
        if ev.mmlu_path:
            return Path(ev.mmlu_path).expanduser()
        data_path = self.scenario.data_path
        beside = Path(data_path).expanduser().parent / "mmlu" if data_path else None
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
        """``<scenario>-<strategy>-<stamp>``, the strategy label made safe for a folder name."""
        strategy = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.strategy_label)
        return f"{self.scenario.name}-{strategy}-{stamp}"

    def as_dict(self) -> dict[str, Any]:
        """The flat run config with dotted keys (what Flower's run config holds), secrets
        blanked; ``from_run_config(as_dict())`` gives these settings back."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in GROUP_TYPES:
                for g in fields(value):
                    out[f"{f.name}.{key_name(g.name)}"] = getattr(value, g.name)
            else:
                out[key_name(f.name)] = value
        if out["mpu.secret"]:
            out["mpu.secret"] = ""  # the server secret is never written to results
        return {k: (str(v) if v == math.inf else v) for k, v in out.items()}


#: The option groups of :class:`RunSettings`, by group name.
GROUP_TYPES: dict[str, type] = {
    f.name: f.default_factory  # type: ignore[misc]
    for f in fields(RunSettings)
    if f.default_factory is not dataclasses.MISSING
}
_TOP_FIELDS = {key_name(f.name): f for f in fields(RunSettings) if f.name not in GROUP_TYPES}


def _field_of(key: str) -> tuple[str | None, str, dataclasses.Field]:
    """``(group or None, field name, field)`` of a run-config key; a renamed or unknown key
    raises :class:`RunConfigError` naming the key to use."""
    if key in RENAMED_KEYS:
        raise RunConfigError(f"run-config key {key!r} was renamed: use {RENAMED_KEYS[key]!r}")
    if key == "strategy":
        raise RunConfigError(
            "run-config key 'strategy' was split: use merge = '<firm | fulm | ties | ...>', "
            "wrapper = 'mpu' for MPU around that merge, pipeline = 'dp2u' for DP2Unlearning"
        )
    group, dot, name = key.partition(".")
    if not dot:
        if key in _TOP_FIELDS:
            return None, key, _TOP_FIELDS[key]
        known = [*_TOP_FIELDS, *(f"{g}.<key>" for g in GROUP_TYPES)]
        raise RunConfigError(f"unknown run-config key {key!r}{_suggestion(key, known)}")
    if group not in GROUP_TYPES:
        raise RunConfigError(
            f"unknown run-config group {group!r} in {key!r}{_suggestion(group, GROUP_TYPES)}"
        )
    by_key = {key_name(f.name): f for f in fields(GROUP_TYPES[group])}
    if name not in by_key:
        full = [f"{group}.{k}" for k in by_key]
        listing = close_matches(key, full) or f"; its keys are: {', '.join(full)}"
        raise RunConfigError(f"unknown run-config key {key!r}{listing}")
    return group, name, by_key[name]


def _suggestion(key: str, known: Collection[str]) -> str:
    return close_matches(key, known) or f"; the keys are: {', '.join(known)}"


def _with_default(settings: RunSettings, key: str, value: Any) -> RunSettings:
    """``settings`` with the dotted ``key`` set to ``value`` if it is on its unset default."""
    group, dot, name = key.partition(".")
    if not dot:  # a run-wide key
        return _on_unset(settings, key, value)
    options = _on_unset(getattr(settings, group), name, value)
    return dataclasses.replace(settings, **{group: options})


def _on_unset(options: Any, name: str, value: Any) -> Any:
    """The dataclass ``options`` with field ``name`` (a key) set to ``value`` if that field is
    still on its default, else ``options`` as it is."""
    attr = name.replace("-", "_")
    unset = next(f.default for f in fields(options) if f.name == attr)
    if getattr(options, attr) != unset:
        return options
    return dataclasses.replace(options, **{attr: value})
