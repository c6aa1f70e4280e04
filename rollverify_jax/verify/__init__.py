"""Verification of paused trajectories: OPS math, the two-stage verifier, and conditional switching.

Pure array math (METHOD.md sections 2-4); it knows nothing of models, rollout or losses.
"""

from rollverify_jax.verify.ops import (
    log_ratio,
    ops_of_log_ratio,
    response_mask,
    segment_ids,
    segment_mean_ops,
    sequence_ops,
    staleness,
    token_ops,
    trajectory_staleness,
)
from rollverify_jax.verify.switching import (
    SwitchConfig,
    SwitchState,
    init_switch_state,
    update_switch_state,
    window_mean,
)
from rollverify_jax.verify.verifier import (
    RULES,
    CutStats,
    ShiftStats,
    VerifyConfig,
    coupled_keep,
    coupled_verify_with_stats,
    tv_terms,
    two_stage_verify,
    two_stage_verify_with_stats,
    verify_stats,
)

__all__ = [
    "RULES",
    "CutStats",
    "SwitchConfig",
    "ShiftStats",
    "SwitchState",
    "VerifyConfig",
    "coupled_keep",
    "coupled_verify_with_stats",
    "init_switch_state",
    "log_ratio",
    "ops_of_log_ratio",
    "response_mask",
    "segment_ids",
    "segment_mean_ops",
    "sequence_ops",
    "staleness",
    "token_ops",
    "trajectory_staleness",
    "tv_terms",
    "two_stage_verify",
    "two_stage_verify_with_stats",
    "update_switch_state",
    "verify_stats",
    "window_mean",
]
