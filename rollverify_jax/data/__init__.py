"""Data: the synthetic task, reward functions (and verl / TRL ones: ``plugins``) and prompt datasets (the
presets and verl's layout: ``sources``; weighted mixtures: ``mixture``).

``synthetic``, ``rewards`` and ``plugins`` are imported eagerly: they are light, and grader worker processes import
this package. ``datasets`` pulls in grain (and with it JAX) and TFDS, so its names load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from rollverify_jax.data.plugins import UNKNOWN_SOURCE, data_source_of
from rollverify_jax.data.rewards import (
    REWARDS,
    RewardScorer,
    RewardSpec,
    exact_reward,
    extract_answer,
    extract_answer_line,
    extract_boxed,
    get_reward_fn,
    math_equal,
    math_reward,
    overlong_penalty,
    register_reward,
)
from rollverify_jax.data.synthetic import SyntheticTask, char_vocabulary, make_split

_LAZY = {
    name: "rollverify_jax.data.datasets"
    for name in (
        "DATASETS",
        "DAPO_TEMPLATE",
        "TEMPLATES",
        "DatasetSchemaError",
        "MathPrompts",
        "PromptIterator",
        "apply_dapo_template",
        "apply_template",
        "build_tfds",
        "get_dataset",
        "load_mixture",
        "load_synthetic",
        "load_tfds",
    )
}

__all__ = [
    "REWARDS",
    "UNKNOWN_SOURCE",
    "RewardScorer",
    "RewardSpec",
    "SyntheticTask",
    "char_vocabulary",
    "data_source_of",
    "exact_reward",
    "extract_answer",
    "extract_answer_line",
    "extract_boxed",
    "get_reward_fn",
    "make_split",
    "math_equal",
    "math_reward",
    "overlong_penalty",
    "register_reward",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    """Load ``datasets`` names on first access (PEP 562) so grader workers never import JAX."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rollverify_jax.data' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
