"""Secret keys of MPU: the server secret and the seeds derived from it (docs/algorithms.md,
"Function-preserving reparameterisation").

Every random choice the server makes for a round — the zero-sum noise ε⁰_k and the secret
reparameterisation T_k of each copy k and layer ℓ — is drawn from a generator seeded with
:func:`derive_seed`, a keyed hash of the server secret and of the round, copy, layer and purpose.
Knowing the secret therefore reproduces every copy; without it the seeds are unpredictable.

The secret never appears in a ``repr``, ``str`` or error message produced by this module: it is
returned as a :class:`ServerSecret`, a ``bytes`` subclass whose representation is redacted.
"""

from __future__ import annotations

import hashlib
import os
import secrets

__all__ = ["DEFAULT_SECRET_ENV_VAR", "ServerSecret", "derive_seed", "server_secret"]

DEFAULT_SECRET_ENV_VAR = "FEDUNLEARN_MPU_SECRET"
_PERSON = b"fedunlearn-mpu"  # blake2b personalisation: domain separation from other hashes


class ServerSecret(bytes):
    """The server's MPU secret: plain ``bytes`` with a redacted ``repr``/``str``.

    It behaves as ``bytes`` everywhere (hashing, comparison, pickling); only its printed forms
    hide the content, so that logging a config or an exception never leaks the key.
    """

    def __repr__(self) -> str:
        return f"ServerSecret(<redacted, {len(self)} bytes>)"

    __str__ = __repr__

    def __format__(self, format_spec: str) -> str:
        return repr(self)


def _as_bytes(secret: bytes | str) -> bytes:
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    elif not isinstance(secret, bytes | bytearray):
        raise TypeError(f"MPU secret must be bytes or str, got {type(secret).__name__}")
    if len(secret) == 0:
        raise ValueError("MPU secret must not be empty")
    return bytes(secret)


def derive_seed(secret: bytes | str, *parts: int | str) -> int:
    """A 63-bit seed from a keyed hash of the server ``secret`` and ``parts``.

    ``parts`` name what the seed is for, e.g. ``(round, copy, layer, "reparam")`` for T_k of
    layer ℓ in round r, or ``(round, "noise")`` for the zero-sum noise ε⁰_k of round r. Each
    part is length-prefixed and type-tagged, so ``(1, 23)`` and ``(12, 3)`` or ``1`` and
    ``"1"`` give different seeds. Same secret and parts → same seed (deterministic across
    processes and machines); anything different → an independent-looking seed.
    """
    key = _as_bytes(secret)
    h = hashlib.blake2b(digest_size=8, person=_PERSON)
    h.update(len(key).to_bytes(8, "big"))
    h.update(key)
    for i, part in enumerate(parts):
        if isinstance(part, bool) or not isinstance(part, int | str):
            raise TypeError(
                f"seed part {i} must be int or str, got {type(part).__name__}"
            )  # the value itself is not echoed
        tag = b"i" if isinstance(part, int) else b"s"
        data = str(part).encode("utf-8")
        h.update(tag + len(data).to_bytes(8, "big") + data)
    return int.from_bytes(h.digest(), "big") >> 1


def server_secret(explicit: str = "", env_var: str = DEFAULT_SECRET_ENV_VAR) -> ServerSecret:
    """The server secret: ``explicit`` if given, else ``$env_var``, else 32 fresh random bytes.

    A fresh secret (``secrets.token_bytes(32)``) is the safe default: nobody, including whoever
    reads the run configuration or logs, can rebuild T_k or ε⁰_k. It also makes runs
    non-reproducible (the published copies differ from run to run); set ``explicit`` or the
    environment variable to a fixed value to reproduce a run exactly.
    """
    if explicit:
        return ServerSecret(_as_bytes(explicit))
    from_env = os.environ.get(env_var, "")
    if from_env:
        return ServerSecret(_as_bytes(from_env))
    return ServerSecret(secrets.token_bytes(32))
