"""The built-in model substrate: a tiny Llama that really knows the fictitious authors.

Stages (each cached on disk under a folder keyed by the config hash):

1. a byte-level BPE tokenizer trained on a separate generated background corpus;
2. "pre-training" on that background corpus plus the real-authors / world-facts sets
   (knowledge the model has before the author fine-tune and that nobody asks to forget);
3. the *knowledgeable model*: fine-tuned on all fictitious authors;
4. the *retain-only reference model*: the same recipe without the forget authors — the
   gold standard that forget quality is measured against.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from fedunlearn.benchmarks.tofu import (
    TofuData,
    generate_background_corpus,
    generate_tofu,
    knowledge_texts,
)
from fedunlearn.evaluation import exact_match, greedy_generate
from fedunlearn.models.llama import new_tiny_llama, tiny_llama_config
from fedunlearn.models.tokenizer import train_bpe_tokenizer
from fedunlearn.qa_format import encode_qa
from fedunlearn.training.batching import Example
from fedunlearn.training.full import train_full

SUBSTRATE_FORMAT_VERSION = 2


@dataclass(frozen=True)
class SubstrateConfig:
    """Everything that determines the built-in substrate; its hash names the cache folder.

    ``forget_percent`` only selects the retain-only reference model, which is cached per
    forget split inside the substrate folder; it is not part of the hash.
    """

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
        fields.pop("forget_percent")  # only the reference depends on it: built per split
        payload = json.dumps({"version": SUBSTRATE_FORMAT_VERSION, **fields}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


@dataclass
class Substrate:
    """A built substrate loaded in memory."""

    config: SubstrateConfig
    data: TofuData
    tokenizer: PreTrainedTokenizerFast
    model: PreTrainedModel
    reference_model: PreTrainedModel
    folder: Path
    info: dict


def _text_examples(
    tokenizer: PreTrainedTokenizerFast, texts: list[str], max_tokens: int = 96
) -> list[Example]:
    out: list[Example] = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][: max_tokens - 1]
        ids = ids + [tokenizer.eos_token_id]
        out.append((ids, list(ids)))
    return out


def _qa_examples(tokenizer: PreTrainedTokenizerFast, records: list[dict]) -> list[Example]:
    return [encode_qa(tokenizer, r["question"], r["answer"]) for r in records]


def author_recall(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, records: list[dict]
) -> float:
    """Share of QA whose greedy answer matches the reference answer exactly."""
    generations = greedy_generate(model, tokenizer, [r["question"] for r in records])
    scores = exact_match(generations, [r["answer"] for r in records])
    return float(sum(scores) / max(1, len(scores)))


def _finetune_on_authors(
    base: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    author_records: list[dict],
    knowledge_records: list[dict],
    cfg: SubstrateConfig,
    desc: str,
    show_progress: bool,
) -> tuple[PreTrainedModel, list[float]]:
    model = copy.deepcopy(base)
    examples = _qa_examples(tokenizer, author_records) + _qa_examples(tokenizer, knowledge_records)
    losses = train_full(
        model,
        examples,
        pad_token_id=tokenizer.pad_token_id,
        epochs=cfg.finetune_epochs,
        lr=cfg.finetune_lr,
        batch_size=cfg.batch_size,
        seed=cfg.seed + 2,
        desc=desc,
        show_progress=show_progress,
    )
    return model, losses


def _atomic_build(folder: Path, build) -> None:
    """Run ``build(tmp)`` into a temporary sibling folder, then rename it into place, so an
    interrupted build never leaves a half-written cache entry behind."""
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        build(tmp)
        if folder.exists():  # a damaged entry (its info file missing)
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def build_substrate(cfg: SubstrateConfig, folder: Path, *, show_progress: bool = True) -> dict:
    """Tokenizer, pre-trained and knowledgeable model into ``folder`` (must not exist yet)."""
    t0 = time.perf_counter()
    data = generate_tofu(cfg.seed, cfg.num_authors, cfg.qa_per_author)
    corpus = generate_background_corpus(cfg.seed, cfg.background_documents)
    tokenizer = train_bpe_tokenizer(corpus, cfg.vocab_size)
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
    knowledge = data.real_authors + data.world_facts
    pretrain_examples = _text_examples(tokenizer, corpus + knowledge_texts(data))
    pretrain_examples += _qa_examples(tokenizer, knowledge) * cfg.knowledge_repeats
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
    knowledgeable, ft_losses = _finetune_on_authors(
        pretrained, tokenizer, data.author_qa, knowledge, cfg, "author fine-tune", show_progress
    )
    t_end = time.perf_counter()
    info = {
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "forget_percent"},
        "cache_key": cfg.cache_key(),
        "num_parameters": sum(p.numel() for p in knowledgeable.parameters()),
        "seconds": {
            "tokenizer_and_data": t_pre - t0,
            "pretraining": t_ft - t_pre,
            "author_finetune": t_end - t_ft,
        },
        "losses": {"pretraining": pre_losses, "author_finetune": ft_losses},
        "author_recall_exact_match": author_recall(knowledgeable, tokenizer, data.author_qa),
    }
    folder.mkdir(parents=True)
    tokenizer.save_pretrained(folder / "tokenizer")
    pretrained.save_pretrained(folder / "pretrained")
    knowledgeable.save_pretrained(folder / "knowledgeable")
    (folder / "build_info.json").write_text(json.dumps(info, indent=2))
    return info


def build_reference(
    cfg: SubstrateConfig, substrate: Path, folder: Path, *, show_progress: bool = True
) -> dict:
    """The retain-only reference for ``cfg.forget_percent``: the knowledgeable model's recipe
    (same pre-trained start, epochs, seed) on every author except the forget authors."""
    started = time.perf_counter()
    data = generate_tofu(cfg.seed, cfg.num_authors, cfg.qa_per_author)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(substrate / "tokenizer")
    pretrained = LlamaForCausalLM.from_pretrained(substrate / "pretrained", dtype=torch.float32)
    reference, losses = _finetune_on_authors(
        pretrained,
        tokenizer,
        data.retain_split(cfg.forget_percent),
        data.real_authors + data.world_facts,
        cfg,
        f"retain-only reference (forget {cfg.forget_percent:g} %)",
        show_progress,
    )
    info = {
        "forget_percent": cfg.forget_percent,
        "seconds": time.perf_counter() - started,
        "losses": losses,
        "forget_recall_reference_exact_match": author_recall(
            reference, tokenizer, data.forget_split(cfg.forget_percent)
        ),
    }
    folder.mkdir(parents=True)
    reference.save_pretrained(folder)
    (folder / "reference_info.json").write_text(json.dumps(info, indent=2))
    return info


def default_cache_dir() -> Path:
    """``$FEDUNLEARN_CACHE_DIR`` or ``~/.cache/fedunlearn``."""
    env = os.environ.get("FEDUNLEARN_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "fedunlearn"


def substrate_folder(cfg: SubstrateConfig, cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / f"tofu-substrate-{cfg.cache_key()}"


def reference_folder(cfg: SubstrateConfig, cache_dir: Path | None = None) -> Path:
    return substrate_folder(cfg, cache_dir) / f"reference-forget{cfg.forget_percent:g}"


def ensure_substrate(
    cfg: SubstrateConfig, cache_dir: Path | None = None, *, show_progress: bool = True
) -> Path:
    """The cached substrate folder for ``cfg``, with the knowledgeable model and the
    reference for ``cfg.forget_percent``; each part is built first when missing."""
    folder = substrate_folder(cfg, cache_dir)
    if not (folder / "build_info.json").is_file():
        _atomic_build(folder, lambda tmp: build_substrate(cfg, tmp, show_progress=show_progress))
    reference = reference_folder(cfg, cache_dir)
    if not (reference / "reference_info.json").is_file():
        _atomic_build(
            reference,
            lambda tmp: build_reference(cfg, folder, tmp, show_progress=show_progress),
        )
    return folder


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
    info = json.loads((folder / "build_info.json").read_text())
    reference_info = json.loads((reference_dir / "reference_info.json").read_text())
    info["seconds"]["reference_finetune"] = reference_info["seconds"]
    info["losses"]["reference_finetune"] = reference_info["losses"]
    info["forget_percent"] = cfg.forget_percent
    info["forget_recall_reference_exact_match"] = reference_info[
        "forget_recall_reference_exact_match"
    ]
    return Substrate(
        config=cfg,
        data=generate_tofu(cfg.seed, cfg.num_authors, cfg.qa_per_author),
        tokenizer=tokenizer,
        model=model,
        reference_model=reference,
        folder=folder,
        info=info,
    )
