"""Where the published benchmark files lie: ``shared/data`` beside the repository; folders
shared by the test workers.

Tests that read them fail (never skip) when they are missing: :func:`shared_data` asserts.
"""

import os
from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def shared_data(*parts: str) -> Path:
    """``SHARED_DATA / parts``, asserted to exist."""
    path = SHARED_DATA.joinpath(*parts)
    assert path.exists(), f"{path} is missing: the tests need shared/data beside the repository"
    return path


def session_folder(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A folder shared by every pytest-xdist worker of this test session (beside the workers'
    own temporary folders), or this process's own when it runs alone: for caches whose builds
    hold a lock (the substrate, a converted checkpoint), so the first worker that needs an
    entry builds it while the others wait, instead of every worker building its own."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        folder = tmp_path_factory.getbasetemp().parent / name
        folder.mkdir(exist_ok=True)
        return folder
    return tmp_path_factory.mktemp(name)
