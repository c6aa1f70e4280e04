"""Trajectory filters of the partial-rollout baselines (METHOD.md section 7), as a registry.

`FILTERS[name](inputs, s_max, ops_threshold) -> keep: bool[N]`. A filtered trajectory leaves the loss only; it
still counts in its group's advantage. The OPS and staleness math lives in `verify/ops.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from rollverify_jax.verify.ops import sequence_ops, token_ops, trajectory_staleness


@dataclasses.dataclass(frozen=True)
class FilterInputs:
    """What a filter may look at, for the N trajectories of one training batch."""

    versions: list[list[int]]  # per trajectory, v_t of each response token
    current_version: int  # the version the batch trains (the policy version of this step)
    behavior_logp: np.ndarray  # [N, T] log mu on response tokens (0 elsewhere)
    response_mask: np.ndarray  # [N, T] bool, True on response tokens
    current_logp: Callable[[], np.ndarray]  # [N, T] log pi of the policy being trained, computed on demand


def staleness_keep(versions: list[list[int]], current_version: int, s_max: int) -> np.ndarray:
    """bool[N]: keep trajectories whose staleness (current - oldest token version) is <= s_max."""
    return trajectory_staleness(current_version, versions) <= s_max


def ops_keep(seq_ops: np.ndarray, threshold: float) -> np.ndarray:
    """bool[N]: keep trajectories whose train-time sequence OPS is <= threshold (NaN is dropped)."""
    return np.asarray(seq_ops) <= threshold


def _keep_all(x: FilterInputs, s_max: int, ops_threshold: float) -> np.ndarray:
    return np.ones(len(x.versions), bool)


def _staleness(x: FilterInputs, s_max: int, ops_threshold: float) -> np.ndarray:
    return staleness_keep(x.versions, x.current_version, s_max)


def _ops(x: FilterInputs, s_max: int, ops_threshold: float) -> np.ndarray:
    """Sequence OPS over the response tokens (the response mask, not `log mu != 0`: a token the behaviour
    policy was sure of has log mu = 0.0 exactly and OPS near 0, and must count)."""
    seq = sequence_ops(token_ops(x.current_logp(), x.behavior_logp), x.response_mask)
    return ops_keep(np.asarray(seq), ops_threshold)


FILTERS: dict[str, Callable[[FilterInputs, int, float], np.ndarray]] = {
    "none": _keep_all, "staleness": _staleness, "ops": _ops}


def check_filter(name: str, s_max: int, ops_threshold: float) -> None:
    if name not in FILTERS:
        raise ValueError(f"Unknown filter {name!r}; known filters: {list(FILTERS)}.")
    if name == "staleness" and s_max < 0:
        raise ValueError(f"staleness filter needs s_max >= 0, got {s_max}.")
    if name == "ops" and not ops_threshold > 0:
        raise ValueError(f"OPS filter needs a threshold > 0, got {ops_threshold}.")


@dataclasses.dataclass(frozen=True)
class FilterConfig:
    """The partial-rollout baselines' filter. name: none | staleness | ops; s_max: the staleness filter's bound;
    ops_threshold: the OPS filter's bound on train-time sequence OPS."""

    name: str = "none"
    s_max: int = 1
    ops_threshold: float = 0.1

    def __post_init__(self):
        check_filter(self.name, self.s_max, self.ops_threshold)


def apply_filter(cfg: FilterConfig, inputs: FilterInputs) -> np.ndarray:
    """bool[N] from the registered filter ``cfg.name``."""
    return np.asarray(FILTERS[cfg.name](inputs, cfg.s_max, cfg.ops_threshold), bool)
