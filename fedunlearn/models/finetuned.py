"""A pretrained model fine-tuned on a scenario's real benchmark files.

The real-file counterpart of :mod:`fedunlearn.models.substrate`: instead of a tiny model
trained from scratch, a pretrained checkpoint (e.g. SmolLM2, :mod:`fedunlearn.models.pretrained`)
is fine-tuned — every weight, AdamW, linear warm-up and cosine decay — into

1. the *knowledgeable model*, on everything the scenario's clients hold
   (:meth:`Scenario.knowledge_records` with the forget part: on TOFU the authors in play), and
2. the *retain-only reference*, the same recipe without the forget part (the retraining gold
   standard that forget quality is measured against).

Both are one cache entry ``<cache>/<scenario>-finetuned-<hash>`` (hash of the base checkpoint's
folder name, the scenario's data parameters and the recipe) with a sha256 manifest, built
under a file lock; ``build_info.json`` records the recipe, the losses, the wall time of each
stage and how much each model knows (:meth:`Scenario.check_knowledge` / ``check_reference``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from fedunlearn.files import build_entry, cached_entry_ok, refuse_unmanifested, waiting_lock
from fedunlearn.qa_format import encode_record
from fedunlearn.scenarios import Scenario
from fedunlearn.training.full import train_full

FINETUNED_FORMAT_VERSION = 1
FINETUNED_INFO = "build_info.json"
FINETUNED_KIND = "fine-tuned pretrained model"
DATA_FIELDS = ("seed", "data_path", "subset_authors", "forget_percent", "forget_domains")
#: data parameters added later: named (hashed) only when set, so older entries stay valid
LATER_DATA_FIELDS = ("subset_texts",)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FinetuneRecipe:
    """How the knowledgeable model and the reference are fine-tuned (full fine-tuning)."""

    epochs: int = 6
    lr: float = 1e-4
    batch_size: int = 8
    max_length: int = 256
    seed: int = 0


def finetuned_folder(
    base: Path, scenario: Scenario, recipe: FinetuneRecipe, cache_dir: Path
) -> Path:
    """Cache folder of ``base`` fine-tuned on ``scenario``'s data with ``recipe``."""
    payload = {
        "version": FINETUNED_FORMAT_VERSION,
        "base": base.name,
        "scenario": scenario.name,
        "data": _data_fields(scenario),
        "recipe": dataclasses.asdict(recipe),
    }
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir / f"{scenario.name}-finetuned-{digest}"


def _data_fields(scenario: Scenario) -> dict:
    """The scenario parameters that decide what the models are fine-tuned on."""
    params = dataclasses.asdict(scenario.params)
    later = {k: params[k] for k in LATER_DATA_FIELDS if params[k]}
    return {**{k: params[k] for k in DATA_FIELDS}, **later}


def _finetune(
    base: Path,
    tokenizer: PreTrainedTokenizerBase,
    records: list[dict],
    recipe: FinetuneRecipe,
    desc: str,
) -> tuple[PreTrainedModel, list[float], float]:
    model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True, dtype=torch.float32)
    examples = [encode_record(tokenizer, r, recipe.max_length) for r in records]
    started = time.perf_counter()
    losses = train_full(
        model,
        examples,
        pad_token_id=tokenizer.pad_token_id,
        epochs=recipe.epochs,
        lr=recipe.lr,
        batch_size=recipe.batch_size,
        seed=recipe.seed,
        desc=desc,
    )
    return model, losses, time.perf_counter() - started


def build_finetuned(base: Path, scenario: Scenario, recipe: FinetuneRecipe, folder: Path) -> dict:
    """Fine-tune ``base`` into ``folder/knowledgeable`` and ``folder/reference``."""
    tokenizer = AutoTokenizer.from_pretrained(base, local_files_only=True)
    folder.mkdir(parents=True)
    info: dict = {
        "base": str(base),
        "recipe": dataclasses.asdict(recipe),
        "data": _data_fields(scenario),
        "seconds": {},
        "losses": {},
    }
    for part, include_forget in (("knowledgeable", True), ("reference", False)):
        records = scenario.knowledge_records(include_forget=include_forget)
        model, losses, seconds = _finetune(base, tokenizer, records, recipe, f"{part} fine-tune")
        info["losses"][part] = losses
        info["seconds"][part] = seconds
        info["examples" if include_forget else "reference_examples"] = len(records)
        started = time.perf_counter()
        check = scenario.check_knowledge if include_forget else scenario.check_reference
        info.update(check(model, tokenizer))
        info["seconds"][f"{part}_check"] = time.perf_counter() - started
        model.save_pretrained(folder / part)
        del model
    tokenizer.save_pretrained(folder / "tokenizer")
    (folder / FINETUNED_INFO).write_text(json.dumps(info, indent=2))
    return info


def ensure_finetuned(
    base: Path, scenario: Scenario, recipe: FinetuneRecipe, cache_dir: Path
) -> Path:
    """The cached fine-tuned pair for ``base`` and ``scenario``, built when missing or
    damaged (a second process building the same entry waits for the first)."""
    folder = finetuned_folder(base, scenario, recipe, cache_dir)
    with waiting_lock(folder.with_name(f"{folder.name}.lock"), "fine-tuning"):
        if not cached_entry_ok(folder, FINETUNED_INFO, FINETUNED_KIND, refuse_unmanifested):
            logger.info("fine-tuning %s on %s into %s", base.name, scenario.name, folder)
            build_entry(
                folder,
                FINETUNED_INFO,
                FINETUNED_KIND,
                lambda tmp: build_finetuned(base, scenario, recipe, tmp),
            )
    return folder
