"""Where the published benchmark files lie: ``shared/data`` beside the repository.

Tests that read them fail (never skip) when they are missing: :func:`shared_data` asserts.
"""

from pathlib import Path

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def shared_data(*parts: str) -> Path:
    """``SHARED_DATA / parts``, asserted to exist."""
    path = SHARED_DATA.joinpath(*parts)
    assert path.exists(), f"{path} is missing: the tests need shared/data beside the repository"
    return path
