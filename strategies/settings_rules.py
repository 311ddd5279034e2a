"""What each run-config key may hold, checked before any work by :meth:`RunSettings.validate`.

:data:`RULES` maps a :class:`~strategies.settings.RunSettings` field to its rule:

* :class:`OneOf` — a name from a registry (scenarios, objectives, solvers, ...), read when the
  check runs, so names registered on import count;
* :class:`Number` — a range; NaN and ±inf are refused unless the rule says ``inf_ok``, and a
  few sentinel values (``0`` = off, ``-1`` = the scenario's default) are named;
* :class:`Parsed` — a function that raises ``ValueError`` for a bad value (merge names,
  including ``module:function`` plug-ins and entry points, are resolved — imported — here).

Rules that involve several keys live in :class:`RunSettings` itself. Every numeric key has a
rule (a test checks it); a new key gets its row here.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from fedunlearn.merging.projection import SOLVERS
from fedunlearn.models.pretrained import model_names
from fedunlearn.objectives import OBJECTIVES
from fedunlearn.scenarios import RETAIN_LAYOUTS, SCENARIOS
from fedunlearn.training.lora import parse_layers
from fedunlearn.upload_codec import FISHER_UPLOADS, TASK_VECTOR_UPLOADS
from strategies.merge_plugins import resolve_merge
from strategies.mpu_strategy import MPU_MODES, MPU_PUBLISH

DTYPES = ("auto", "float32", "bfloat16")  # float16 would need loss scaling
FINETUNE_MODES = ("lora", "full")
DP2U_METHODS = ("dp2u-sgd", "dp2u-mlm", "rfs-r", "ga", "graddiff", "kl", "idk")
MPU_SIGMA_SOURCES = ("weights", "task-vector")
NON_MERGE_STRATEGIES = ("mpu", "dp2u")  # strategies that are not a merge function


class RunConfigError(ValueError):
    """A run-config value the run cannot use; the message names the key, the value and what
    is allowed."""


def key_name(field: str) -> str:
    """The run-config key of a :class:`RunSettings` field (``num_rounds`` → ``num-rounds``)."""
    return field.replace("_", "-")


def close_matches(value: str, names: Collection[str]) -> str:
    """``"; did you mean 'a' or 'b'?"`` for the names close to ``value`` (difflib), or ``""``."""
    close = difflib.get_close_matches(value, list(names), n=3)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


@dataclass(frozen=True)
class OneOf:
    """A name from ``options()`` (a registry, read when the check runs)."""

    options: Callable[[], Collection[str]]

    def problem(self, value: Any, kind: type) -> str | None:
        names = sorted(self.options())
        if value in names:
            return None
        return f"must be one of {', '.join(names)}{close_matches(str(value), names)}"


@dataclass(frozen=True)
class Number:
    """A number in ``[low, high]`` (an end excluded when ``*_open``), finite unless ``inf_ok``;
    ``special`` names values accepted outside the range, as ``(value, meaning)`` pairs."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    inf_ok: bool = False
    special: tuple[tuple[float, str], ...] = ()

    def problem(self, value: Any, kind: type) -> str | None:
        return None if self.accepts(value) else f"must be {self.describe(kind)}"

    def accepts(self, value: float) -> bool:
        if any(value == v for v, _ in self.special):
            return True
        if math.isnan(value) or (math.isinf(value) and not self.inf_ok):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def describe(self, kind: type) -> str:
        """E.g. ``"a finite number in (0, 1]"``, ``"an integer >= 0, or -1 (scenario default)"``."""
        what = "an integer" if kind is int else "a number" if self.inf_ok else "a finite number"
        low, high = f"{self.low:g}", f"{self.high:g}"
        if math.isfinite(self.low) and math.isfinite(self.high):
            span = (
                f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
            )
        elif math.isfinite(self.low):
            span = f"{'>' if self.low_open else '>='} {low}"
        elif math.isfinite(self.high):
            span = f"{'<' if self.high_open else '<='} {high}"
        else:
            span = ""
        text = f"{what} {span}".strip() + (" (inf allowed)" if self.inf_ok else "")
        extra = "".join(f", or {v:g} ({meaning})" for v, meaning in self.special)
        return text + extra


@dataclass(frozen=True)
class Parsed:
    """A value ``check`` accepts; it raises ``ValueError`` saying what is wrong otherwise."""

    check: Callable[[Any], object]

    def problem(self, value: Any, kind: type) -> str | None:
        try:
            self.check(value)
        except ValueError as err:
            return str(err)
        return None


Rule = OneOf | Number | Parsed


def check_strategy(name: str) -> None:
    """``mpu``, ``dp2u`` or a merge :func:`resolve_merge` finds (plug-ins imported now)."""
    if name not in NON_MERGE_STRATEGIES:
        resolve_merge(name)


def check_mpu_merge(name: str) -> None:
    """The merge MPU wraps: a merge function, not another strategy."""
    if name in NON_MERGE_STRATEGIES:
        raise ValueError(f"must name a merge function (firm, ties, ...), not {name!r}")
    resolve_merge(name)


def check_lora_layers(text: str) -> None:
    if text != "auto":
        parse_layers(text)


POSITIVE_INT = Number(low=1)
COUNT = Number(low=0)
POSITIVE = Number(low=0, low_open=True)
NON_NEGATIVE = Number(low=0)
FRACTION = Number(low=0, high=1, low_open=True)
ANY_FINITE = Number()
SCENARIO_DEFAULT = ((-1.0, "the scenario's default"),)
OFF_OR_AT_LEAST_ONE = Number(low=1, special=((0.0, "off"),))

RULES: dict[str, Rule] = {
    # names
    "scenario": OneOf(lambda: SCENARIOS),
    "strategy": Parsed(check_strategy),
    "objective": OneOf(lambda: OBJECTIVES),
    "dtype": OneOf(lambda: DTYPES),
    "model": OneOf(model_names),
    "finetune": OneOf(lambda: FINETUNE_MODES),
    "task_vector_upload": OneOf(lambda: TASK_VECTOR_UPLOADS),
    "fisher_upload": OneOf(lambda: FISHER_UPLOADS),
    "retain_layout": OneOf(lambda: RETAIN_LAYOUTS),
    "lora_layers": Parsed(check_lora_layers),
    "solver": OneOf(lambda: SOLVERS),
    "mpu_merge": Parsed(check_mpu_merge),
    "mpu_mode": OneOf(lambda: MPU_MODES),
    "mpu_publish": OneOf(lambda: MPU_PUBLISH),
    "mpu_sigma_source": OneOf(lambda: MPU_SIGMA_SOURCES),
    "dp2u_method": OneOf(lambda: DP2U_METHODS),
    # scenario and data
    "seed": COUNT,
    "num_rounds": POSITIVE_INT,
    "num_authors": POSITIVE_INT,
    "qa_per_author": POSITIVE_INT,
    "forget_percent": Number(low=0, high=100, low_open=True, high_open=True),
    "num_forget_clients": POSITIVE_INT,  # 0 = the scenario's default, filled in before this
    "num_retain_clients": COUNT,
    "retain_samples": COUNT,
    "local_retain_samples": COUNT,
    "num_forget_domains": POSITIVE_INT,
    # built-in substrate
    "substrate_hidden_size": POSITIVE_INT,
    "substrate_layers": POSITIVE_INT,
    "substrate_intermediate_size": POSITIVE_INT,
    "substrate_pretrain_epochs": COUNT,
    "substrate_finetune_epochs": COUNT,
    "substrate_finetune_lr": POSITIVE,
    "substrate_background_documents": COUNT,
    # a pretrained model fine-tuned on the scenario's data
    "tofu_subset_authors": Number(low=2, special=((0.0, "auto"),)),
    "muse_subset_texts": Number(low=2, special=((0.0, "auto"),)),
    "model_finetune_epochs": POSITIVE_INT,
    "model_finetune_lr": POSITIVE,
    "mmlu_subjects": Number(low=1, high=57),
    "mmlu_per_subject": COUNT,
    # local training
    "forget_steps": POSITIVE_INT,
    "forget_lr": POSITIVE,
    "retain_steps": POSITIVE_INT,
    "retain_lr": POSITIVE,
    "batch_size": POSITIVE_INT,
    "lora_rank": POSITIVE_INT,
    "lora_alpha": POSITIVE,
    "fisher_batches": POSITIVE_INT,
    "fisher_upload_fraction": FRACTION,
    "client_threads": POSITIVE_INT,
    # objective options
    "graddiff_alpha": NON_NEGATIVE,
    "npo_beta": POSITIVE,
    "simnpo_beta": POSITIVE,
    "simnpo_delta": ANY_FINITE,
    "dpo_beta": POSITIVE,
    "undial_beta": NON_NEGATIVE,
    "satimp_beta1": NON_NEGATIVE,
    "satimp_beta2": NON_NEGATIVE,
    "kl_alpha": NON_NEGATIVE,
    "rmu_layer": Number(low=0, special=SCENARIO_DEFAULT),
    "rmu_steering": Number(low=0, special=SCENARIO_DEFAULT),
    "rmu_alpha": Number(low=0, special=SCENARIO_DEFAULT),
    # merges
    "gamma": POSITIVE,  # 0 = the scenario's default, filled in before this
    "alpha": FRACTION,
    "eps0": POSITIVE,
    "epsilon": Number(low=0, low_open=True, inf_ok=True),  # inf = no retention projection
    "ties_k": FRACTION,
    "fulm_k": FRACTION,
    "fulm_threshold": Number(low=-1, high=1),
    # MPU
    "mpu_copies": POSITIVE_INT,
    "mpu_kappa": NON_NEGATIVE,
    "mpu_shared_kappa": NON_NEGATIVE,
    "mpu_server_lr": POSITIVE,
    # DP2Unlearning
    "dp2u_clients": POSITIVE_INT,
    "dp2u_epsilon": POSITIVE,
    "dp2u_delta": Number(low=0, high=1, low_open=True, high_open=True),
    "dp2u_clip": POSITIVE,
    "dp2u_dp_rounds": POSITIVE_INT,
    "dp2u_dp_lr": POSITIVE,
    "dp2u_dp_batch_size": POSITIVE_INT,
    "dp2u_finetune_rounds": POSITIVE_INT,
    "dp2u_retrain_rounds": POSITIVE_INT,
    "dp2u_local_epochs": POSITIVE_INT,
    "dp2u_lr": POSITIVE,
    "dp2u_batch_size": POSITIVE_INT,
    # evaluation, output, timeouts, bad clients
    "eval_retain_samples": COUNT,
    "eval_max_new_tokens": POSITIVE_INT,
    "eval_batch_size": POSITIVE_INT,
    "round_timeout": POSITIVE,
    "node_wait_timeout": POSITIVE,
    "min_replies": COUNT,  # its upper end (the run's clients) is checked by RunSettings
    "max_upload_mb": NON_NEGATIVE,  # 0 = the largest honest reply
    "robust_norm_bound": OFF_OR_AT_LEAST_ONE,
    "fisher_cap": OFF_OR_AT_LEAST_ONE,
    "client_norm_ratio": OFF_OR_AT_LEAST_ONE,  # fedunlearn.merging.sanity
    "max_update_ratio": OFF_OR_AT_LEAST_ONE,
}


def check_value(field: str, value: Any, kind: type) -> None:
    """Raise :class:`RunConfigError` unless ``value`` satisfies the rule of ``field`` (a float
    key without a rule must be finite)."""
    rule = RULES.get(field, ANY_FINITE if kind is float else None)
    problem = rule.problem(value, kind) if rule is not None else None
    if problem:
        raise RunConfigError(f"run-config key {key_name(field)!r} = {value!r}: {problem}")
