"""Shared fixtures: a tiny real Llama and its tokenizer (built in a second, no downloads)."""

import os

import pytest
import torch

from fedunlearn.benchmarks.tofu import generate_background_corpus, generate_tofu
from fedunlearn.models.llama import new_tiny_llama, tiny_llama_config
from fedunlearn.models.pretrained import pretrained_checkpoint
from fedunlearn.models.tokenizer import train_bpe_tokenizer
from tests.shared_paths import session_folder

# One compute thread per test process, and for the Flower runs the tests start (they inherit
# the environment). The suite runs in two pytest workers, and a Flower run adds its own server
# and client processes: with torch's default of a thread per core in each, OpenMP threads spin
# against each other on a machine with few cores (a tiny model's TOFU evaluation took 58 s
# instead of 6.5 s beside one busy process on a 2-core machine).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# One client process per Flower run (Ray sized to one CPU): every Ray actor imports torch,
# transformers and peft (~10 s of CPU) before it trains; a test's clients train for a second
# or two, so a second actor only adds its start-up to the two busy cores.
os.environ.setdefault("FEDUNLEARN_FEDERATION_CONFIG", "init-args-num-cpus=1")

#: The files that take longest, longest first (minutes of one worker in a fresh-clone run of
#: the suite on a 2-core CPU, both workers busy; at least their slowest 60 tests). pytest-xdist
#: hands whole files to the workers in collection order (``--dist loadfile
#: --no-loadscope-reorder`` in pyproject.toml; its default order, most tests first, started
#: these last, and one of them then ran alone for 13 minutes at the end), so these start first
#: and the short files fill in around them.
LONGEST_FILES = (
    "tests/simulations/test_scenarios_end_to_end.py",  # 8.5: two substrate builds, two runs
    "tests/simulations/test_end_to_end.py",  # 7
    "tests/simulations/test_resume.py",  # 7: two killed runs resumed (MPU, a request schedule)
    "tests/simulations/test_real_check.py",  # 4.5
    "tests/simulations/test_dp2u_flower.py",  # 4.5
    "tests/simulations/test_objectives_flower.py",  # 4
    "tests/simulations/test_mpu_flower.py",  # 4
    "tests/simulations/test_deploy.py",  # 3.5
    "tests/simulations/test_memory_bounds.py",  # 3: two runs, one of a 0.26 GB model
    "tests/simulations/test_learn_flower.py",  # 3: federated learning, cached, and LoRA
    "tests/simulations/test_scale_check.py",  # 2.6
    "tests/simulations/test_studies.py",  # 3
    "tests/simulations/test_model_delivery_flower.py",  # 2
    "tests/simulations/test_flwr_run.py",  # 2
    "tests/simulations/test_mpu_attack.py",  # 1
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest files first (stable: the rest keep their order)."""
    rank = {path: i for i, path in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture(scope="session")
def tiny_data():
    return generate_tofu(seed=0, num_authors=20, qa_per_author=10)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return train_bpe_tokenizer(generate_background_corpus(seed=0, num_documents=300), 600)


@pytest.fixture()
def tiny_model(tiny_tokenizer):
    torch.manual_seed(0)
    config = tiny_llama_config(
        len(tiny_tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        eos_token_id=tiny_tokenizer.eos_token_id,
        pad_token_id=tiny_tokenizer.pad_token_id,
    )
    return new_tiny_llama(config, seed=0)


@pytest.fixture(scope="session")
def smollm2_checkpoint(tmp_path_factory):
    """SmolLM2-135M-Instruct converted from the registry package's GGUF file to a float32
    checkpoint (once per test session, about 15 s)."""
    return pretrained_checkpoint("smollm2-135m", session_folder(tmp_path_factory, "pretrained"))


@pytest.fixture
def umask_zero():
    """Nothing masked: a file or folder gets exactly the mode its creation asks for."""
    old = os.umask(0)
    yield
    os.umask(old)
