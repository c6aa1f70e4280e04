"""Where a run's files live: a local disk, a shared mount, or an object store (``gs://``) through ``etils.epath``.

Every workdir, checkpoint and output path goes through ``as_path``, so the same code writes ``runs/x`` and
``gs://bucket/runs/x``. On a local path ``epath.Path`` behaves like ``pathlib.Path`` (and compares equal to it).
An object store has no appendable files and no cheap directory rename; the few places that need either ask
``is_local`` first. ``gs://`` needs ``gcsfs`` (epath's backend for it) or TensorFlow installed.

A file the project publishes by a rename (metrics rewrites, sample logs, exports, prepared data) is flushed to
the disk first, through ``fsync`` here, so a crash never leaves a published name on half-written contents.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

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


def fsync(path: PathLike) -> None:
    """Flushes a local file, or every file and directory of a tree, to the disk. Called before the rename that
    publishes it: a rename is durable before the data it names, so a power loss or a kernel crash right after it
    could otherwise leave a published name on empty or partial contents."""
    path = os.fspath(path)
    if os.path.isdir(path):
        for root, dirs, files in os.walk(path, topdown=False):
            for name in files:
                _fsync_one(os.path.join(root, name))
            for name in dirs:
                _fsync_one(os.path.join(root, name))
    _fsync_one(path)


def fsync_dir(path: PathLike) -> None:
    """Makes a rename inside the local directory ``path`` durable (its entry list flushed); best effort: some
    filesystems cannot fsync a directory."""
    try:
        _fsync_one(os.fspath(path))
    except OSError:
        pass


def _fsync_one(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)  # fsync needs no write access on Linux
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomically(path: PathLike, text: str) -> None:
    """Writes ``text`` so that a reader sees the old or the new file, never half of one: a temporary file,
    flushed to the disk, renamed over it on a local disk; one object write on an object store (objects replace
    atomically, renames copy)."""
    path = as_path(path)
    if not is_local(path):
        path.write_text(text)
        return
    tmp = os.fspath(path.with_name(f".{path.name}.{os.getpid()}.tmp"))
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.fspath(path))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def check_writable(path: PathLike, what: str) -> None:
    """Refuses an output file that cannot be written, before the work that produces it (an evaluation, a
    compile): not a directory, and its nearest existing parent a directory this process can create files in (a
    probe file is made there and removed). An object-store path is not probed."""
    if not is_local(path):
        return
    target = Path(os.path.abspath(os.fspath(path)))
    if target.is_dir():
        raise ValueError(f"{what}={path} is a directory; pass a file name.")
    parent = target.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{what}={path}: {parent} is a file, not a directory.")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".probe", dir=parent)
    except OSError as e:
        raise ValueError(f"{what}={path} cannot be written: {parent}: {e.strerror or e}.") from None
    os.close(fd)
    os.unlink(probe)


def is_within(path: PathLike, root: PathLike) -> bool:
    """Whether ``path`` is ``root`` or lies under it (local paths resolved, links included; URIs compared as
    text)."""
    if is_local(path) != is_local(root):
        return False
    if not is_local(path):
        a, b = os.fspath(path).rstrip("/"), os.fspath(root).rstrip("/")
        return a == b or a.startswith(b + "/")
    resolved, base = Path(os.fspath(path)).resolve(), Path(os.fspath(root)).resolve()
    return resolved == base or base in resolved.parents
