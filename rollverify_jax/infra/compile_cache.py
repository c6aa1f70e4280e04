"""A persistent XLA compilation cache, on by default: the second start of a config loads its compiled programs
from disk instead of compiling them again (minutes at real shapes: docs/scale.md).

``compilation_cache.dir`` (gin) names the directory (``~`` expanded; ``gs://`` and other ``etils.epath`` paths work,
JAX reads and writes it through epath); None turns the cache off. The environment variable
``ROLLVERIFY_COMPILATION_CACHE`` overrides it: ``0`` (or ``off``, ``false``, ``none``) turns it off, any other
value is the directory. JAX's own environment variables (``JAX_COMPILATION_CACHE_DIR``,
``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS``, ``JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES``) are an explicit choice
and win over these settings; turning this setting off leaves them in force. The test suite runs with it off
unless a test asks.

JAX writes cache entries from process 0 only; on several hosts, point the directory at a filesystem they share
(a bucket, NFS) so the other processes find process 0's entries. The cache is trusted code: never share a
directory others can write to.
"""

from __future__ import annotations

import os

import jax

ENV_VAR = "ROLLVERIFY_COMPILATION_CACHE"
DEFAULT_DIR = "~/.cache/rollverify_jax/xla"
_OFF = ("0", "off", "false", "none")


def cache_dir(configured: str | None) -> str | None:
    """The directory the cache uses: the environment variable when set, else ``configured``; None when off."""
    value = os.environ.get(ENV_VAR, configured)
    if value is None or value.strip().lower() in _OFF or not value.strip():
        return None
    value = value.strip()
    return value if "://" in value else os.path.expanduser(value)


def compilation_cache(dir: str | None = DEFAULT_DIR, min_compile_time_s: float = 0.5,
                      min_entry_size_bytes: int = 0) -> str | None:
    """Turns JAX's persistent compilation cache on (call at CLI start, before anything compiles); returns the
    directory in use, or None when it is off (then JAX's own settings are left as they are).

    Programs that compile in less than ``min_compile_time_s`` are not written (loading one costs about as much as
    compiling it); ``min_entry_size_bytes`` skips small executables likewise (0: every size)."""
    path = cache_dir(dir)
    if path is None:
        return None
    _set("jax_compilation_cache_dir", path)
    _set("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
    _set("jax_persistent_cache_min_entry_size_bytes", int(min_entry_size_bytes))
    return jax.config.jax_compilation_cache_dir


def _set(name: str, value) -> None:
    """Updates one JAX option unless its own environment variable (``name.upper()``) set it."""
    if name.upper() in os.environ or getattr(jax.config, name) == value:
        return
    jax.config.update(name, value)
    if name == "jax_compilation_cache_dir":
        from jax.experimental.compilation_cache import compilation_cache as cc

        cc.reset_cache()  # a cache opened earlier in this process (another directory) is dropped
