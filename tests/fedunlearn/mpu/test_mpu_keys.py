"""MPU keys: deterministic seeds from the server secret, never printed."""

from __future__ import annotations

import pytest

from fedunlearn.mpu import ServerSecret, derive_seed, server_secret

SECRET = "a-very-private-server-secret"


def test_same_parts_same_seed_and_63_bits() -> None:
    a = derive_seed(SECRET, 3, 1, 0, "reparam")
    assert a == derive_seed(SECRET, 3, 1, 0, "reparam")
    assert a == derive_seed(SECRET.encode(), 3, 1, 0, "reparam")  # str is its UTF-8 bytes
    assert 0 <= a < 2**63


def test_different_parts_or_secret_different_seed() -> None:
    seeds = {
        derive_seed(SECRET, 3, 1, 0, "reparam"),
        derive_seed(SECRET, 3, 1, 1, "reparam"),
        derive_seed(SECRET, 3, 2, 0, "reparam"),
        derive_seed(SECRET, 4, 1, 0, "reparam"),
        derive_seed(SECRET, 3, 1, 0, "noise"),
        derive_seed(SECRET, 31, 0, "reparam"),  # no ambiguity from concatenation
        derive_seed(SECRET, "3", 1, 0, "reparam"),  # int and str are distinct
        derive_seed(SECRET + "x", 3, 1, 0, "reparam"),
    }
    assert len(seeds) == 8


def test_server_secret_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MY_MPU_SECRET", raising=False)
    assert server_secret(SECRET, env_var="MY_MPU_SECRET") == SECRET.encode()
    monkeypatch.setenv("MY_MPU_SECRET", "from-env")
    assert server_secret(env_var="MY_MPU_SECRET") == b"from-env"
    assert server_secret(SECRET, env_var="MY_MPU_SECRET") == SECRET.encode()  # explicit wins
    monkeypatch.delenv("MY_MPU_SECRET")
    fresh1, fresh2 = server_secret(env_var="MY_MPU_SECRET"), server_secret(env_var="MY_MPU_SECRET")
    assert len(fresh1) == 32 and fresh1 != fresh2  # fresh random: non-reproducible by design


def test_secret_never_printed() -> None:
    secret = server_secret(SECRET)
    assert isinstance(secret, bytes) and isinstance(secret, ServerSecret)
    for text in (repr(secret), str(secret), f"{secret}", f"{secret!r}", repr([secret])):
        assert SECRET not in text and "redacted" in text
    with pytest.raises(TypeError) as info:
        derive_seed(secret, 1.5)  # bad part type: the error names neither secret nor value
    assert SECRET not in str(info.value)
    with pytest.raises(ValueError):
        derive_seed("", 1)
