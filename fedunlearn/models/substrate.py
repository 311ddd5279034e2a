"""The built-in model substrate: a tiny Llama that really knows a scenario's data.

Stages (each cached on disk under ``<scenario>-substrate-<config hash>``), with the data of
the scenario (:class:`fedunlearn.scenarios.Scenario`):

1. a byte-level BPE tokenizer trained on the scenario's separate background corpus;
2. "pre-training" on that corpus plus the never-forgotten knowledge (TOFU: real authors and
   world facts; WMDP: general knowledge);
3. the *knowledgeable model*: fine-tuned on everything the scenario's clients hold;
4. the *retain-only reference model*: the same recipe without the forget part — the
   gold standard (retraining) that forget quality and PrivLeak are measured against.

The substrate (1-3) and each reference (4) are separate cache entries with a sha256 manifest,
built under a file lock by one process at a time (``ensure_substrate``).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from fedunlearn.files import build_entry, cached_entry_ok, default_cache_dir, waiting_lock
from fedunlearn.models.llama import new_tiny_llama, tiny_llama_config
from fedunlearn.models.tokenizer import train_bpe_tokenizer
from fedunlearn.qa_format import encode_record, encode_text
from fedunlearn.scenarios import Scenario, ScenarioParams, get_scenario
from fedunlearn.training.batching import Example
from fedunlearn.training.full import train_full

SUBSTRATE_FORMAT_VERSION = 2
REFERENCE_ONLY_FIELDS = ("forget_percent", "forget_domains")
PRETRAIN_TEXT_TOKENS = 96  # pre-training documents are cut to this many tokens
SUBSTRATE_INFO = "build_info.json"  # written last by a build: the entry is complete
REFERENCE_INFO = "reference_info.json"
SUBSTRATE_PARTS = ("tokenizer", "pretrained", "knowledgeable", SUBSTRATE_INFO)
SUBSTRATE_KIND = "substrate"
REFERENCE_KIND = "reference model"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SubstrateConfig:
    """Everything that determines the built-in substrate; its hash names the cache folder.

    ``scenario`` names the folder (``<scenario>-substrate-<hash>``). ``forget_percent`` (TOFU)
    and ``forget_domains`` (WMDP) only select the retain-only reference model, which is cached
    per forget split inside the substrate folder; none of the three is part of the hash.
    """

    scenario: str = "tofu"
    forget_domains: str = "bio,cyber"
    seed: int = 0
    num_authors: int = 200
    qa_per_author: int = 10
    forget_percent: float = 1.0
    vocab_size: int = 2048
    background_documents: int = 1500
    hidden_size: int = 192
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 512
    pretrain_epochs: int = 2
    pretrain_lr: float = 2e-3
    knowledge_repeats: int = 8
    finetune_epochs: int = 16
    finetune_lr: float = 2e-3
    batch_size: int = 32

    def cache_key(self) -> str:
        """Stable short hash of the config (and of the substrate format version)."""
        fields = dataclasses.asdict(self)
        for name in REFERENCE_ONLY_FIELDS:  # only the reference depends on them
            fields.pop(name)
        fields.pop("scenario")  # in the folder name
        payload = json.dumps({"version": SUBSTRATE_FORMAT_VERSION, **fields}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def build_scenario(self) -> Scenario:
        """The scenario whose data this substrate learns (generated from the seed)."""
        return get_scenario(self.scenario)(
            ScenarioParams(
                seed=self.seed,
                num_authors=self.num_authors,
                qa_per_author=self.qa_per_author,
                forget_percent=self.forget_percent,
                forget_domains=self.forget_domains,
            )
        )


@dataclass
class Substrate:
    """A built substrate loaded in memory."""

    config: SubstrateConfig
    scenario: Scenario
    tokenizer: PreTrainedTokenizerFast
    model: PreTrainedModel
    reference_model: PreTrainedModel
    folder: Path
    info: dict

    @property
    def data(self) -> Any:
        """The scenario's benchmark data."""
        return self.scenario.data


def _examples(
    tokenizer: PreTrainedTokenizerFast, records: list[dict], max_text_tokens: int = 512
) -> list[Example]:
    """QA records through ``encode_qa``; text records truncated to ``max_text_tokens``."""
    return [
        encode_text(tokenizer, r["text"], max_text_tokens)
        if "text" in r and "question" not in r
        else encode_record(tokenizer, r)
        for r in records
    ]


def _finetune(
    base: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    records: list[dict],
    cfg: SubstrateConfig,
    desc: str,
    show_progress: bool,
) -> tuple[PreTrainedModel, list[float]]:
    model = copy.deepcopy(base)
    losses = train_full(
        model,
        _examples(tokenizer, records),
        pad_token_id=tokenizer.pad_token_id,
        epochs=cfg.finetune_epochs,
        lr=cfg.finetune_lr,
        batch_size=cfg.batch_size,
        seed=cfg.seed + 2,
        desc=desc,
        show_progress=show_progress,
    )
    return model, losses


def build_substrate(cfg: SubstrateConfig, folder: Path, *, show_progress: bool = True) -> dict:
    """Tokenizer, pre-trained and knowledgeable model into ``folder`` (must not exist yet;
    ``ensure_substrate`` builds into a temporary folder and moves it into the cache)."""
    t0 = time.perf_counter()
    scenario = cfg.build_scenario()
    tokenizer = train_bpe_tokenizer(
        scenario.tokenizer_corpus(cfg.background_documents), cfg.vocab_size
    )
    model_config = tiny_llama_config(
        len(tokenizer),
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        intermediate_size=cfg.intermediate_size,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    pretrained = new_tiny_llama(model_config, cfg.seed)
    pretrain_examples = _examples(
        tokenizer,
        scenario.pretraining_records(cfg.background_documents, cfg.knowledge_repeats),
        max_text_tokens=PRETRAIN_TEXT_TOKENS,
    )
    t_pre = time.perf_counter()
    pre_losses = train_full(
        pretrained,
        pretrain_examples,
        pad_token_id=tokenizer.pad_token_id,
        epochs=cfg.pretrain_epochs,
        lr=cfg.pretrain_lr,
        batch_size=cfg.batch_size,
        seed=cfg.seed + 1,
        desc="pre-training",
        show_progress=show_progress,
    )
    t_ft = time.perf_counter()
    knowledgeable, ft_losses = _finetune(
        pretrained,
        tokenizer,
        scenario.knowledge_records(include_forget=True),
        cfg,
        f"{cfg.scenario} knowledge fine-tune",
        show_progress,
    )
    t_end = time.perf_counter()
    info = {
        "config": {
            k: v for k, v in dataclasses.asdict(cfg).items() if k not in REFERENCE_ONLY_FIELDS
        },
        "cache_key": cfg.cache_key(),
        "num_parameters": sum(p.numel() for p in knowledgeable.parameters()),
        "seconds": {
            "tokenizer_and_data": t_pre - t0,
            "pretraining": t_ft - t_pre,
            "knowledge_finetune": t_end - t_ft,
        },
        "losses": {"pretraining": pre_losses, "knowledge_finetune": ft_losses},
        **scenario.check_knowledge(knowledgeable, tokenizer),
    }
    folder.mkdir(parents=True)
    tokenizer.save_pretrained(folder / "tokenizer")
    pretrained.save_pretrained(folder / "pretrained")
    knowledgeable.save_pretrained(folder / "knowledgeable")
    (folder / SUBSTRATE_INFO).write_text(json.dumps(info, indent=2))
    return info


def build_reference(
    cfg: SubstrateConfig, substrate: Path, folder: Path, *, show_progress: bool = True
) -> dict:
    """The retain-only reference of ``cfg``'s forget split: the knowledgeable model's recipe
    (same pre-trained start, epochs, seed) on everything except the forget part."""
    started = time.perf_counter()
    scenario = cfg.build_scenario()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(substrate / "tokenizer")
    pretrained = LlamaForCausalLM.from_pretrained(substrate / "pretrained", dtype=torch.float32)
    reference, losses = _finetune(
        pretrained,
        tokenizer,
        scenario.knowledge_records(include_forget=False),
        cfg,
        f"retain-only reference ({scenario.reference_name()})",
        show_progress,
    )
    info = {
        "reference": scenario.reference_name(),
        "forget_percent": cfg.forget_percent,
        "forget_domains": cfg.forget_domains,
        "seconds": time.perf_counter() - started,
        "losses": losses,
        **scenario.check_reference(reference, tokenizer),
    }
    folder.mkdir(parents=True)
    reference.save_pretrained(folder)
    (folder / REFERENCE_INFO).write_text(json.dumps(info, indent=2))
    return info


def substrate_folder(cfg: SubstrateConfig, cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / f"{cfg.scenario}-substrate-{cfg.cache_key()}"


def reference_folder(cfg: SubstrateConfig, cache_dir: Path | None = None) -> Path:
    return substrate_folder(cfg, cache_dir) / cfg.build_scenario().reference_name()


def ensure_substrate(
    cfg: SubstrateConfig, cache_dir: Path | None = None, *, show_progress: bool = True
) -> Path:
    """The cached substrate folder for ``cfg``, with the knowledgeable model and the
    reference for ``cfg.forget_percent``; each part is built first when missing or damaged.

    Holds the lock ``<folder>.lock`` meanwhile: a second process building the same substrate
    waits, then reuses what the first built. Each entry (the substrate, each reference) is
    verified against its ``manifest.json`` (sha256 of every file); a damaged one is rebuilt
    alone (WARNING naming the file), the other entries are kept. An entry written before
    manifests is adopted (manifest written once) when its tokenizer and models load with
    finite weights, and rebuilt otherwise."""
    folder = substrate_folder(cfg, cache_dir)
    reference = reference_folder(cfg, cache_dir)
    with waiting_lock(folder.with_name(f"{folder.name}.lock"), "substrate build"):
        if not cached_entry_ok(
            folder, SUBSTRATE_INFO, SUBSTRATE_KIND, _check_legacy_substrate, SUBSTRATE_PARTS
        ):
            logger.info("building the substrate %s", folder)
            build_entry(
                folder,
                SUBSTRATE_INFO,
                SUBSTRATE_KIND,
                lambda tmp: build_substrate(cfg, tmp, show_progress=show_progress),
            )
        if not cached_entry_ok(reference, REFERENCE_INFO, REFERENCE_KIND, _check_legacy_model):
            logger.info("building the reference model %s", reference)
            build_entry(
                reference,
                REFERENCE_INFO,
                REFERENCE_KIND,
                lambda tmp: build_reference(cfg, folder, tmp, show_progress=show_progress),
            )
    return folder


def _check_legacy_model(folder: Path) -> None:
    """Raise unless the model in ``folder`` loads with finite weights."""
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for name, tensor in model.state_dict().items():
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{folder}: {name} holds non-finite values")


def _check_legacy_substrate(folder: Path) -> None:
    """Raise unless the substrate's info, tokenizer and both models load."""
    json.loads((folder / SUBSTRATE_INFO).read_text())
    PreTrainedTokenizerFast.from_pretrained(folder / "tokenizer")
    for part in ("pretrained", "knowledgeable"):
        _check_legacy_model(folder / part)


def load_substrate(
    cfg: SubstrateConfig, cache_dir: Path | None = None, *, show_progress: bool = True
) -> Substrate:
    """Build (if needed) and load the substrate: data, tokenizer, knowledgeable and reference."""
    folder = ensure_substrate(cfg, cache_dir, show_progress=show_progress)
    reference_dir = reference_folder(cfg, cache_dir)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder / "tokenizer")
    model = LlamaForCausalLM.from_pretrained(folder / "knowledgeable", dtype=torch.float32)
    reference = LlamaForCausalLM.from_pretrained(reference_dir, dtype=torch.float32)
    model.eval()
    reference.eval()
    info = json.loads((folder / SUBSTRATE_INFO).read_text())
    reference_info = json.loads((reference_dir / REFERENCE_INFO).read_text())
    info["seconds"]["reference_finetune"] = reference_info["seconds"]
    info["losses"]["reference_finetune"] = reference_info["losses"]
    info.update({k: v for k, v in reference_info.items() if k not in ("seconds", "losses")})
    return Substrate(
        config=cfg,
        scenario=cfg.build_scenario(),
        tokenizer=tokenizer,
        model=model,
        reference_model=reference,
        folder=folder,
        info=info,
    )
