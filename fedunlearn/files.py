"""Files the project writes: durable atomic writes, sha256 manifests, cache entries, locks.

* ``write_file_atomic``: a file is written under a unique temporary name in its folder
  (``.<name>.tmp-<pid>-<random>``, see ``temp_path``), fsynced, moved into place with
  ``os.replace`` and the folder fsynced: a crash leaves the old file or the new one, and two
  processes never write the same temporary file.
* Manifests (``manifest.json``): the size and sha256 of every file of a folder;
  ``verify_manifest`` names the first file that is missing or differs.
* Cache entries (a folder built once and reused: the substrate, its reference models, the
  dp2u stages): ``cached_entry_ok`` verifies an entry against its manifest and
  ``build_entry`` builds one under a temporary name and moves it into place.
* Locks (``filelock``: advisory ``flock``, released by the kernel when the holder dies):
  ``waiting_lock`` waits for another process (a cache build); ``exclusive_folder`` refuses at
  once and names the PID of the run that holds the folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock, Timeout

MANIFEST_FILE = "manifest.json"
RUN_LOCK_FILE = ".fedunlearn-run.lock"
TEMP_NAME = re.compile(r"^\.(?P<target>.+)\.tmp-\d+-[0-9a-f]{8}$")

logger = logging.getLogger(__name__)


class IntegrityError(RuntimeError):
    """A file that is missing, unreadable or does not match its manifest; ``path`` names it."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path


class FolderInUseError(RuntimeError):
    """Another process holds the folder (``exclusive_folder``)."""


# ---- durable atomic writes -----------------------------------------------------------------


def fsync_dir(folder: Path) -> None:
    """Make a rename or a new entry in ``folder`` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """Flush ``path``'s contents to disk (after a writer that does not fsync, e.g. safetensors)."""
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def fsync_tree(folder: Path) -> None:
    """fsync every file and folder under ``folder`` (a freshly built cache entry)."""
    for path in sorted(folder.rglob("*"), reverse=True):  # contents before their folders
        if path.is_file():
            fsync_file(path)
        elif path.is_dir():
            fsync_dir(path)
    fsync_dir(folder)


def default_cache_dir() -> Path:
    """``$FEDUNLEARN_CACHE_DIR`` or ``~/.cache/fedunlearn``: built models, kernels, evaluations."""
    env = os.environ.get("FEDUNLEARN_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "fedunlearn"


def temp_path(path: Path) -> Path:
    """A unique temporary name for ``path`` in its folder: ``.<name>.tmp-<pid>-<8 hex>``."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def temp_target(name: str) -> str | None:
    """The file name a ``temp_path`` name stands for, or None for any other name."""
    match = TEMP_NAME.match(name)
    return match["target"] if match else None


def write_new_file(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Create ``path`` (which must not exist) with permissions exactly ``mode``, write ``data``
    and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as handle:
        os.fchmod(handle.fileno(), mode)  # exactly ``mode``, whatever the umask
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def write_file_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` by ``data`` atomically and durably (unique temporary name, fsync,
    ``os.replace``, fsync of the folder)."""
    tmp = temp_path(path)
    try:
        write_new_file(tmp, data, mode)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


# ---- manifests -----------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    """Hex sha256 of the file's contents."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def files_under(folder: Path, names: Iterable[str] | None = None) -> list[Path]:
    """Every file under ``folder`` (or under its top-level items ``names``), sorted."""
    roots = [folder / n for n in names] if names is not None else [folder]
    found = []
    for root in roots:
        found += [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
    return sorted(p for p in found if p != folder / MANIFEST_FILE)


def write_manifest(folder: Path, kind: str, files: Iterable[Path] | None = None) -> dict[str, Any]:
    """Record the size and sha256 of ``files`` (default: every file under ``folder``) in
    ``folder/manifest.json`` (atomically); returns the manifest."""
    manifest = {
        "kind": kind,
        "files": {
            p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
            for p in (files if files is not None else files_under(folder))
        },
    }
    write_file_atomic(folder / MANIFEST_FILE, json.dumps(manifest, indent=1).encode())
    return manifest


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """``folder``'s manifest, None when it has none; raises ``IntegrityError`` when it is
    unreadable."""
    path = folder / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise IntegrityError(path, f"unreadable manifest ({type(err).__name__}: {err})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise IntegrityError(path, "not a manifest (no 'files' table)")
    return manifest


def verify_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Raise ``IntegrityError`` naming the first listed file that is missing, has another
    size or another sha256 than ``manifest`` records."""
    for name, expected in sorted(manifest["files"].items()):
        path = folder / name
        if not path.is_file():
            raise IntegrityError(path, "missing (listed in the manifest)")
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise IntegrityError(path, f"{size} bytes, the manifest records {expected['bytes']}")
        if sha256_file(path) != expected["sha256"]:
            raise IntegrityError(path, "its sha256 differs from the manifest's (damaged)")


# ---- cache entries -------------------------------------------------------------------------


def cached_entry_ok(
    folder: Path,
    completion: str,
    kind: str,
    legacy_check: Callable[[Path], None],
    legacy_parts: Iterable[str] | None = None,
) -> bool:
    """Whether the cache entry ``folder`` is complete and intact.

    ``completion`` (e.g. ``info.json``) is the file a build writes last. An entry with it and a
    manifest is verified (damage: WARNING naming the file, False: the caller rebuilds it). An
    entry with it but without a manifest was written before manifests existed: it is adopted
    — its manifest (over ``legacy_parts``, default all its files) written once — when
    ``legacy_check(folder)`` loads it without an error, and rebuilt otherwise (WARNING)."""
    if not (folder / completion).is_file():
        return False  # never built, or a replacement was interrupted
    try:
        manifest = read_manifest(folder)
        if manifest is not None:
            verify_manifest(folder, manifest)
            return True
    except IntegrityError as err:
        logger.warning("cached %s is damaged (%s): rebuilding this entry", kind, err)
        return False
    try:
        legacy_check(folder)
    except Exception as err:  # noqa: BLE001 — any load failure means: rebuild
        logger.warning(
            "cached %s in %s (written before manifests) does not load (%s: %s): rebuilding it",
            kind,
            folder,
            type(err).__name__,
            err,
        )
        return False
    write_manifest(folder, kind, files_under(folder, legacy_parts))
    logger.info("cached %s in %s (written before manifests) loads: manifest written", kind, folder)
    return True


def refuse_unmanifested(folder: Path) -> None:
    """``legacy_check`` of :func:`cached_entry_ok` for entries that always had a manifest: an
    entry without one is incomplete and is rebuilt."""
    raise ValueError(f"{folder} has no manifest")


def build_entry(
    folder: Path,
    completion: str,
    kind: str,
    build: Callable[[Path], Any],
    stale: Iterable[str] = (),
) -> None:
    """Build a cache entry with ``build(tmp)`` in a temporary sibling folder, write its manifest
    and move it into ``folder``. Call it holding the entry's lock.

    A new entry is renamed into place at once. Over an older (damaged) entry, the old manifest
    and ``completion`` go first, so the entry counts as unfinished until the new ``completion``
    and manifest are moved in last; only the items the build made replace theirs (other items,
    e.g. sub-entries, stay) and the old items named by the glob patterns ``stale`` are removed.
    Leftover temporary folders of interrupted builds of this entry (``<name>.tmp-<pid>[-<hex>]``)
    are removed first."""
    for leftover in folder.parent.glob(f"{glob_escape(folder.name)}.tmp-*"):
        if re.fullmatch(r"\d+(-[0-9a-f]{8})?", leftover.name.rsplit(".tmp-", 1)[1]):
            shutil.rmtree(leftover, ignore_errors=True)
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        build(tmp)
        write_manifest(tmp, kind)
        fsync_tree(tmp)
        if not folder.exists():
            os.replace(tmp, folder)
        else:
            _replace_items(tmp, folder, completion, stale)
        fsync_dir(folder.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def glob_escape(name: str) -> str:
    """``name`` with the glob metacharacters escaped."""
    return re.sub(r"([\[\]*?])", r"[\1]", name)


def _replace_items(built: Path, folder: Path, completion: str, stale: Iterable[str]) -> None:
    for name in (MANIFEST_FILE, completion):
        (folder / name).unlink(missing_ok=True)
    for pattern in stale:
        for path in folder.glob(pattern):
            path.unlink()
    fsync_dir(folder)
    items = sorted(p.name for p in built.iterdir() if p.name not in (MANIFEST_FILE, completion))
    for name in [*items, completion, MANIFEST_FILE]:
        target = folder / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(built / name, target)
    fsync_dir(folder)


# ---- locks ---------------------------------------------------------------------------------


@contextmanager
def waiting_lock(lock_file: Path, what: str) -> Iterator[None]:
    """Hold the advisory lock ``lock_file``, waiting (logged) while another process holds it."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(lock_file)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.info("waiting for another process that holds %s (%s)", lock_file, what)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


@contextmanager
def exclusive_folder(folder: Path, what: str) -> Iterator[None]:
    """Hold ``folder`` for this process (lock file ``.fedunlearn-run.lock`` in it, this PID in
    ``.fedunlearn-run.lock.pid``); raises ``FolderInUseError`` at once, naming the holder's
    PID, while another process holds it."""
    folder.mkdir(parents=True, exist_ok=True)
    lock_file = folder / RUN_LOCK_FILE
    pid_file = folder / f"{RUN_LOCK_FILE}.pid"
    lock = FileLock(lock_file)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise FolderInUseError(
            f"{what} {folder} is in use by PID {_holder_pid(pid_file)} (it holds {lock_file}); "
            f"wait for that run to end, or choose another {what}"
        ) from None
    try:
        write_file_atomic(pid_file, f"{os.getpid()}\n".encode())
        yield
    finally:
        pid_file.unlink(missing_ok=True)
        lock.release()


def _holder_pid(pid_file: Path, wait_s: float = 1.0) -> str:
    """The PID the holder wrote (it writes it right after taking the lock: wait a moment)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return str(int(pid_file.read_text()))
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                return "<unknown>"
            time.sleep(0.05)


#: safetensors' dtype names and item sizes of the torch dtypes a checkpoint holds
_SAFETENSORS_DTYPES = {
    torch.float64: ("F64", 8),
    torch.float32: ("F32", 4),
    torch.bfloat16: ("BF16", 2),
    torch.float16: ("F16", 2),
    torch.int64: ("I64", 8),
    torch.int32: ("I32", 4),
    torch.int16: ("I16", 2),
    torch.int8: ("I8", 1),
    torch.uint8: ("U8", 1),
    torch.bool: ("BOOL", 1),
}


_DTYPES_BY_CODE = {code: dtype for dtype, (code, _) in _SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor of a safetensors file lies: its dtype, shape and byte range."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # the tensor's first byte in the file
    stop: int


def safetensors_layout(path: Path) -> dict[str, StoredTensor]:
    """Every tensor of a safetensors file, in header order, from its header alone (8 bytes of
    length, then JSON; the data offsets made absolute)."""
    with open(path, "rb") as fh:
        length = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(length))
    header.pop("__metadata__", None)
    base = 8 + length
    return {
        name: StoredTensor(
            _DTYPES_BY_CODE[info["dtype"]], tuple(info["shape"]), base + start, base + stop
        )
        for name, info in header.items()
        for start, stop in [info["data_offsets"]]
    }


def _safetensors_header(
    layout: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    metadata: dict[str, str] | None = None,
    *,
    room: int = 0,
    offset_digits: int = 0,
) -> bytes:
    """The JSON header of ``layout``'s tensors stored in that order, padded with spaces to a
    multiple of 8 bytes and to at least ``room`` bytes (the format allows trailing spaces);
    ``offset_digits`` > 0 writes every offset as that wide a number (a bound on the length)."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, (dtype, shape) in layout.items():
        code, itemsize = _SAFETENSORS_DTYPES[dtype]
        size = itemsize * math.prod(shape)
        header[name] = {
            "dtype": code,
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    if offset_digits:  # every offset widened to offset_digits digits: the longest it can be
        encoded += b" " * (2 * len(layout) * offset_digits)
    encoded += b" " * max(0, room - len(encoded))
    return encoded + b" " * (-len(encoded) % 8)


def _tensor_bytes(
    path: Path, name: str, value: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]
) -> memoryview:
    """A CPU tensor's bytes as stored, after checking it is ``dtype`` of ``shape``."""
    value = value.detach().cpu().contiguous()
    if value.dtype != dtype or tuple(value.shape) != tuple(shape):
        raise ValueError(
            f"{path.name}: tensor {name!r} is {value.dtype} {tuple(value.shape)}, "
            f"the layout says {dtype} {tuple(shape)}"
        )
    if value.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits as int16
        value = value.view(torch.int16)
    return value.numpy().data


def save_safetensors_streamed(
    path: Path,
    layout: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    tensor: Callable[[str], torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write a safetensors file one tensor at a time: ``safetensors.torch.save_file`` first
    copies every tensor into one buffer, a second copy of a whole model.

    ``layout`` gives each name's dtype and shape, in file order; ``tensor(name)`` returns that
    CPU tensor, called once per name in that order, so only one is alive at a time. The file
    is what ``safetensors`` reads: an 8-byte header length, the JSON header, the bytes."""
    encoded = _safetensors_header(layout, metadata)
    with open(path, "wb") as out:
        out.write(len(encoded).to_bytes(8, "little"))
        out.write(encoded)
        for name, (dtype, shape) in layout.items():
            out.write(_tensor_bytes(path, name, tensor(name), dtype, shape))


class SafetensorsSubsetWriter:
    """A safetensors file of some of ``candidates``' tensors, chosen while it is written.

    The header's room is reserved for every candidate (the header of a subset, in any order,
    is never longer); :meth:`add` appends one tensor's bytes at a time, so only the caller's
    current tensor is alive; :meth:`close` writes the header of what was added, padded with
    spaces to the reserved room. Used as a context manager, a failure removes the partial file.
    """

    def __init__(
        self, path: Path, candidates: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]
    ) -> None:
        self.path = Path(path)
        self._candidates = dict(candidates)
        total = sum(
            _SAFETENSORS_DTYPES[dtype][1] * math.prod(shape)
            for dtype, shape in self._candidates.values()
        )
        self._room = len(_safetensors_header(self._candidates, offset_digits=len(str(total))))
        self._layout: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        self.nbytes = 0  # the tensors' bytes written so far
        self._out = open(self.path, "wb")  # noqa: SIM115 — closed by close() / __exit__
        self._out.write(b"\0" * (8 + self._room))

    def add(self, name: str, value: torch.Tensor) -> None:
        """Append candidate ``name``'s tensor (of the candidate's dtype and shape)."""
        if name not in self._candidates:
            raise KeyError(f"{self.path.name}: {name!r} is not a candidate tensor")
        if name in self._layout:
            raise ValueError(f"{self.path.name}: tensor {name!r} was added already")
        dtype, shape = self._candidates[name]
        data = _tensor_bytes(self.path, name, value, dtype, shape)
        self._out.write(data)
        self.nbytes += data.nbytes
        self._layout[name] = (dtype, shape)

    def close(self) -> None:
        """Write the header of the tensors added and close the file."""
        if self._out.closed:
            return
        encoded = _safetensors_header(self._layout, room=self._room)
        if len(encoded) != self._room:  # cannot happen: the room bounds every subset
            raise RuntimeError(f"{self.path.name}: the header outgrew its reserved room")
        self._out.seek(0)
        self._out.write(len(encoded).to_bytes(8, "little"))
        self._out.write(encoded)
        self._out.close()

    def __enter__(self) -> SafetensorsSubsetWriter:
        return self

    def __exit__(self, kind: object, error: object, trace: object) -> None:
        if kind is None:
            self.close()
            return
        self._out.close()
        self.path.unlink(missing_ok=True)
