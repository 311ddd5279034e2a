"""The Flower app's own files, copied into a folder of their own before ``flwr run``.

``flwr run <folder>`` walks EVERY file under the folder and only then drops what its bundle
rules (``.gitignore`` and Flower's include/exclude patterns) leave out. Run on the repository
itself that walk also visits the virtual environment, the caches and the outputs — on a
checkout with ``.venv/`` inside about 54,000 files and 5–6 s of CPU per run, spent before
the run even starts. :func:`stage_app` walks the repository once without descending into the
folders ``.gitignore`` excludes (nor into ``.git``), applies Flower's own
rules to what it found and copies exactly those files, so the bundle Flower builds from the
staged folder holds the same files as one built from the repository.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from flwr.cli.utils import build_pathspec, filter_paths_for_publish, load_gitignore_patterns


def app_files(root: Path) -> list[str]:
    """Relative POSIX paths of the files Flower would bundle from ``root``.

    Folders that ``.gitignore`` excludes, ``.git`` and symbolic links are not entered (Flower
    skips links, and nothing in an excluded folder or in ``.git`` is bundled anyway).
    """
    root = root.resolve()
    gitignore = root / ".gitignore"
    ignored = build_pathspec(
        load_gitignore_patterns(gitignore.read_bytes() if gitignore.is_file() else b"")
    )
    found: dict[str, Path | bytes] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        folder = Path(dirpath)
        relative = folder.relative_to(root).as_posix()
        prefix = "" if relative == "." else relative + "/"
        dirnames[:] = [
            d
            for d in dirnames
            if d != ".git"
            and not (folder / d).is_symlink()
            and not ignored.match_file(prefix + d + "/")
        ]
        for name in filenames:
            if not (folder / name).is_symlink():
                found[prefix + name] = folder / name
    return sorted(filter_paths_for_publish(found))


def stage_app(root: Path, destination: Path) -> Path:
    """Copy the app files of ``root`` (:func:`app_files`) into ``destination`` (replacing
    an earlier copy) and return it, ready for ``flwr run <destination>``."""
    if destination.exists():
        shutil.rmtree(destination)
    for relative in app_files(root):
        target = destination / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / relative, target)
    return destination
