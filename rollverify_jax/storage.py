"""Where a run's files live: a local disk, a shared mount, or an object store (``gs://``) through ``etils.epath``.

Every workdir, checkpoint and output path goes through ``as_path``, so the same code writes ``runs/x`` and
``gs://bucket/runs/x``. On a local path ``epath.Path`` behaves like ``pathlib.Path`` (and compares equal to it).
An object store has no appendable files and no cheap directory rename; the few places that need either ask
``is_local`` first. ``gs://`` needs ``gcsfs`` (epath's backend for it) or TensorFlow installed.
"""

from __future__ import annotations

import os

from etils import epath

PathLike = str | os.PathLike


def as_path(path: PathLike) -> epath.Path:
    """``path`` as an ``epath.Path`` (``gs://...``, ``s3://...`` or a local path)."""
    return epath.Path(path)


def is_local(path: PathLike) -> bool:
    """Whether ``path`` is on a filesystem the OS mounts (not an object-store URI such as ``gs://bucket/x``)."""
    return "://" not in os.fspath(path)


def absolute(path: PathLike) -> epath.Path:
    """An absolute local path (relative to the working directory), or the URI itself: ``absolute()`` of
    ``gs://b/x`` would otherwise prefix the working directory."""
    path = as_path(path)
    return path.absolute() if is_local(path) else path


def remove_tree(path: PathLike) -> None:
    """Removes a directory tree, best effort: what could not be removed stays (a cleanup never raises)."""
    try:
        as_path(path).rmtree(missing_ok=True)
    except OSError:
        pass


def write_text_atomically(path: PathLike, text: str) -> None:
    """Writes ``text`` so that a reader sees the old or the new file, never half of one: a temporary file renamed
    over it on a local disk; one object write on an object store (objects replace atomically, renames copy)."""
    path = as_path(path)
    if not is_local(path):
        path.write_text(text)
        return
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
