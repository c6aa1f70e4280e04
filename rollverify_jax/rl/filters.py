"""Trajectory filters of the partial-rollout baselines (METHOD.md section 7).

A filtered trajectory is dropped from the loss only; it still counts in its group's advantage.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

FILTERS = ("none", "staleness", "ops")


def staleness_keep(versions: list[list[int]], current_version: int, s_max: int) -> np.ndarray:
    """bool[N]: keep trajectories whose staleness (current - oldest token version) is <= s_max."""
    stale = np.asarray([current_version - min(v) if v else 0 for v in versions])
    return stale <= s_max


def ops_keep(sequence_ops: np.ndarray, threshold: float) -> np.ndarray:
    """bool[N]: keep trajectories whose train-time sequence OPS is <= threshold."""
    return np.asarray(sequence_ops) <= threshold


def check_filter(name: str, s_max: int, ops_threshold: float) -> None:
    if name not in FILTERS:
        raise ValueError(f"Unknown filter {name!r}; known filters: {list(FILTERS)}.")
    if name == "staleness" and s_max < 0:
        raise ValueError(f"staleness filter needs s_max >= 0, got {s_max}.")
    if name == "ops" and not ops_threshold > 0:
        raise ValueError(f"OPS filter needs a threshold > 0, got {ops_threshold}.")


FilterFn = Callable[..., np.ndarray]
