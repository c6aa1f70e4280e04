"""What a ``MathPrompts`` TFDS build is, without TFDS: its version, where a build lives and the loaders it converts
from. Shared by ``datasets`` (which finds and reads builds, never importing tensorflow_datasets unless it reads
one) and ``tfds_source`` (the builder, which needs TFDS), so the two import this and never each other."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from rollverify_jax.data import sources

Record = dict[str, Any]

MATH_PROMPTS_VERSION = "1.0.0"  # the builder's version: part of a build's path


def tfds_dir(data_dir: str, config_name: str = "default") -> str:
    """Where ``MathPrompts`` puts a build of config ``config_name``."""
    return os.path.join(os.fspath(data_dir), "math_prompts", config_name, MATH_PROMPTS_VERSION)


def _text_only(loader: Callable[..., list[Record]]) -> Callable[..., list[Record]]:
    """A loader whose records keep only ``prompt`` and ``answer``: what a ``MathPrompts`` TFDS build holds (its
    features are those two texts; builds made before the other keys existed stay valid)."""
    def load(*args, **kwargs) -> list[Record]:
        return [{"prompt": r["prompt"], "answer": r["answer"]} for r in loader(*args, **kwargs)]
    load.__name__ = load.__qualname__ = loader.__name__
    return load


# The loaders ``MathPrompts`` (tfds_source) converts from, by ``source_format``.
FILE_LOADERS: dict[str, Callable[..., list[Record]]] = {
    name: _text_only(loader) for name, loader in sources.FILE_LOADERS.items()
}
