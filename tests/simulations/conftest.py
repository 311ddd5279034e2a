"""Shared by the Flower tests: a tiny random Llama checkpoint on disk (per module) and a small
built-in substrate preset with one cache for the whole test session."""

import pytest

from fedunlearn.models.llama import new_tiny_llama, tiny_llama_config
from tests.shared_paths import session_folder


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, tiny_tokenizer):
    config = tiny_llama_config(
        len(tiny_tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        eos_token_id=tiny_tokenizer.eos_token_id,
        pad_token_id=tiny_tokenizer.pad_token_id,
    )
    folder = tmp_path_factory.mktemp("ckpt")
    new_tiny_llama(config, seed=0).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def substrate_cache(tmp_path_factory):
    """One substrate cache for the session, shared by the workers: each preset is built once
    (by the first worker that needs it, under the build's lock), then reused."""
    return session_folder(tmp_path_factory, "substrate-cache")
