"""Private files: written owner-only from creation; the MPU secret read from one, not argv.

A secret given on a command line is visible to every user of the machine (``ps``,
``/proc/<pid>/cmdline``), and a run-config value is also kept in the SuperLink's run record,
which any client that reaches the SuperLink's port can list. The MPU server secret therefore
comes from a file (``mpu.secret-file``, mode 0600 or stricter) or from
``$FEDUNLEARN_MPU_SECRET`` in the ServerApp's environment; the inline ``mpu.secret`` key is
refused.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

SECRET_FILE_KEY = "mpu.secret-file"
INLINE_SECRET_KEY = "mpu.secret"
MAX_SECRET_BYTES = 64 * 1024
PRIVATE_MODE = 0o600


def write_private_file(path: Path, data: bytes) -> Path:
    """Create ``path`` with mode 0600 (whatever the umask) and write ``data`` into it.

    The mode is set by the ``open`` that creates the file, so the content is never readable by
    others, not even for a moment. An existing file (or link) is never overwritten: that is a
    ``FileExistsError`` naming the file. A failed write removes the partial file.
    """
    path = Path(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, PRIVATE_MODE)
    except FileExistsError:
        raise FileExistsError(f"{path} already exists; it is not overwritten") from None
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        path.unlink(missing_ok=True)  # only ever the file this call created (O_EXCL)
        raise
    return path


def make_private_dir(path: Path) -> Path:
    """Create ``path`` (and its parents) with the leaf owner-only (0700) from creation.

    An existing folder is kept as it is (its files are private by their own modes)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        if not path.is_dir():
            raise NotADirectoryError(f"{path} exists and is not a folder") from None
    return path


def read_secret_file(path: str | Path, key: str = SECRET_FILE_KEY) -> str:
    """The secret stored in ``path``: its UTF-8 text without one trailing newline.

    Refused with a ``ValueError`` naming ``key`` and the file unless the path is absolute and
    names a regular file that only its owner can read or write (mode 0600 or stricter)
    holding 1 byte to 64 KiB of UTF-8 text.
    """
    where = f"{key} {str(path)!r}"
    path = Path(path).expanduser()
    if not path.is_absolute():
        raise ValueError(
            f"{where}: give an absolute path (the ServerApp runs wherever the SuperLink runs)"
        )
    try:  # O_NONBLOCK: a FIFO must not hang the check; it is refused below
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise ValueError(f"{where} cannot be opened: {err.strerror}") from None
    try:
        info = os.fstat(fd)  # of the file opened, not of whatever the path names later
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{where} is not a regular file")
        mode = stat.S_IMODE(info.st_mode)
        if mode & 0o077:
            raise ValueError(
                f"{where} has mode {mode:04o}: other users may read or change it. Make it "
                f"private (chmod 600 {path}) and keep it on the SuperLink's machine only"
            )
        with os.fdopen(os.dup(fd), "rb") as source:
            data = source.read(MAX_SECRET_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_SECRET_BYTES:
        raise ValueError(f"{where} holds more than {MAX_SECRET_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{where} is not UTF-8 text") from None
    text = text.removesuffix("\n").removesuffix("\r")
    if not text:
        raise ValueError(f"{where} is empty")
    return text


def check_secret_keys(inline_secret: str, secret_file: str) -> None:
    """Refuse an inline ``mpu.secret``; check ``mpu.secret-file`` (when set) now, before any
    expensive work (see :func:`read_secret_file`)."""
    if inline_secret:
        raise ValueError(
            f"run-config key {INLINE_SECRET_KEY!r} is refused: a secret in the run config ends "
            "up on command lines (visible in ps) and in the SuperLink's run record (listed to "
            "anyone who reaches its port). Put the secret in a file with mode 0600 and set "
            f"{SECRET_FILE_KEY}='/absolute/path', or set $FEDUNLEARN_MPU_SECRET in the "
            "SuperLink's environment"
        )
    if secret_file:
        read_secret_file(secret_file)


def given_secret(secret_file: str) -> str:
    """The secret in ``mpu.secret-file``, or ``""`` when unset (then ``$FEDUNLEARN_MPU_SECRET``
    or the checkpoint's stored fresh secret applies, see ``RunCheckpoint.mpu_secret``)."""
    return read_secret_file(secret_file) if secret_file else ""
