"""Off-policy shift (OPS) quantities over padded response arrays (METHOD.md section 2).

Everything here is pure `jnp` math on padded `[N, L]` arrays plus a boolean response mask, so it runs under
`jit`, on sharded arrays, and inside the fused resume prefill. Masked-out positions never influence a result,
whatever values (NaN included) they hold: masking uses `jnp.where`, never multiplication.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

LOG_RATIO_CLIP = 20.0  # |log pi - log mu| is clipped here so exp() stays finite in float32.


def log_ratio(new_logp: jax.Array, behavior_logp: jax.Array) -> jax.Array:
    """`clip(log pi - log mu, -20, 20)` in float32; any shape.

    The clip keeps `exp` finite: a token the new policy finds 1e9 times likelier is already maximally
    off-policy, so larger values carry no extra information.
    """
    diff = jnp.asarray(new_logp, jnp.float32) - jnp.asarray(behavior_logp, jnp.float32)
    return jnp.clip(diff, -LOG_RATIO_CLIP, LOG_RATIO_CLIP)


def ops_of_log_ratio(lr: jax.Array) -> jax.Array:
    """OPS `|r - 1| = |exp(lr) - 1|` of a (clipped, see `log_ratio`) log-ratio `lr`; any shape.

    The one home of the formula: `token_ops` and every other OPS of a log-ratio (the losses' train-time OPS
    included) use it. `expm1` keeps precision for tiny shifts, which is where the segment threshold
    (`ds = 0.01`) lives; `exp(lr) - 1` loses it to cancellation near 0.
    """
    return jnp.abs(jnp.expm1(lr))


def token_ops(new_logp: jax.Array, behavior_logp: jax.Array) -> jax.Array:
    """Token OPS `|r_t - 1|` with `r_t = exp(log_ratio)`; float32, same shape as the inputs.

    Zero means the token is exactly on-policy.
    """
    return ops_of_log_ratio(log_ratio(new_logp, behavior_logp))


def response_mask(lengths: jax.Array, max_len: int) -> jax.Array:
    """`mask: bool[N, max_len]`, True at `t < lengths[i]`: the valid prefix of each padded row."""
    lengths = jnp.asarray(lengths, jnp.int32)  # [N]
    return jnp.arange(max_len, dtype=jnp.int32)[None, :] < lengths[:, None]


def sequence_ops(ops: jax.Array, mask: jax.Array) -> jax.Array:
    """Masked mean of `ops: [N, L]` over response tokens -> `[N]`; 0 for a row without tokens.

    An empty row has nothing off-policy in it, so 0 (not NaN) keeps downstream means and filters finite.
    """
    valid = jnp.asarray(mask, bool)  # [N, L]
    total = jnp.sum(jnp.where(valid, jnp.asarray(ops, jnp.float32), 0.0), axis=-1)  # [N]
    count = jnp.sum(valid, axis=-1)  # [N]
    return jnp.where(count > 0, total / jnp.maximum(count, 1), 0.0)


def segment_starts(versions: jax.Array, mask: jax.Array) -> jax.Array:
    """`bool[N, L]`: True at the first token of each segment.

    A segment is a maximal run of consecutive response tokens with the same policy version `v_t`; a
    masked-out position ends a run, so holes in a mask split segments.
    """
    versions = jnp.asarray(versions, jnp.int32)  # [N, L]
    valid = jnp.asarray(mask, bool)  # [N, L]
    prev_valid = jnp.pad(valid[:, :-1], ((0, 0), (1, 0)), constant_values=False)
    prev_version = jnp.pad(versions[:, :-1], ((0, 0), (1, 0)))
    return valid & (~prev_valid | (versions != prev_version))


def segment_ends(versions: jax.Array, mask: jax.Array) -> jax.Array:
    """`bool[N, L]`: True at the last token of each segment (see `segment_starts`)."""
    versions = jnp.asarray(versions, jnp.int32)  # [N, L]
    valid = jnp.asarray(mask, bool)  # [N, L]
    next_valid = jnp.pad(valid[:, 1:], ((0, 0), (0, 1)), constant_values=False)
    next_version = jnp.pad(versions[:, 1:], ((0, 0), (0, 1)))
    return valid & (~next_valid | (versions != next_version))


def segment_ids(versions: jax.Array, mask: jax.Array) -> jax.Array:
    """`int32[N, L]`: index of each token's segment within its row (0, 1, ...); -1 at masked positions."""
    starts = segment_starts(versions, mask)
    ids = jnp.cumsum(starts.astype(jnp.int32), axis=-1) - 1
    return jnp.where(jnp.asarray(mask, bool), ids, -1)


def _segmented_cumsum(values: jax.Array, starts: jax.Array) -> jax.Array:
    """Running sum along axis 1 that restarts at every `starts` position; `values, starts: [N, L]`.

    Summing within a segment only (instead of differencing one row-wide cumsum) avoids catastrophic
    cancellation: one earlier token with OPS ~ e^20 would otherwise swamp a later segment's 0.01-scale mean.
    """

    def combine(left, right):
        left_start, left_sum = left
        right_start, right_sum = right
        return left_start | right_start, jnp.where(right_start, right_sum, left_sum + right_sum)

    _, sums = jax.lax.associative_scan(combine, (starts, values), axis=1)
    return sums


def segment_mean_ops(ops: jax.Array, versions: jax.Array, mask: jax.Array) -> jax.Array:
    """`float32[N, L]`: each valid token gets the mean OPS of its segment; masked positions get 0.

    Computed with cumulative ops only (segmented scan, cummin/cummax), so it is O(N·L) work and jit-friendly.
    """
    valid = jnp.asarray(mask, bool)  # [N, L]
    ops = jnp.where(valid, jnp.asarray(ops, jnp.float32), 0.0)  # [N, L]
    starts = segment_starts(versions, valid)  # [N, L]
    ends = segment_ends(versions, valid)  # [N, L]
    max_len = ops.shape[-1]
    positions = jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32), ops.shape)  # [N, L]
    # A valid token's segment runs from the nearest start at or before it to the nearest end at or after it.
    start_idx = jax.lax.cummax(jnp.where(starts, positions, 0), axis=1)  # [N, L]
    end_idx = jax.lax.cummin(jnp.where(ends, positions, max_len - 1), axis=1, reverse=True)  # [N, L]
    seg_sum = jnp.take_along_axis(_segmented_cumsum(ops, starts), end_idx, axis=1)  # [N, L]
    count = (end_idx - start_idx + 1).astype(jnp.float32)  # [N, L]
    return jnp.where(valid, seg_sum / jnp.maximum(count, 1.0), 0.0)


def staleness(current_version: jax.Array | int, versions: jax.Array, mask: jax.Array) -> jax.Array:
    """`int32[N]`: `current_version - min_t v_t` over valid tokens; 0 for a row without tokens.

    The oldest token bounds how far behind a trajectory is, which is what staleness filters threshold.
    """
    versions = jnp.asarray(versions, jnp.int32)  # [N, L]
    valid = jnp.asarray(mask, bool)  # [N, L]
    current = jnp.asarray(current_version, jnp.int32)
    oldest = jnp.min(jnp.where(valid, versions, current), axis=-1)  # [N]; empty rows -> current
    return current - oldest


def trajectory_staleness(current_version: int, versions: list[list[int]]) -> np.ndarray:
    """Host-side `staleness` of ragged trajectories: `int64[N]`, `current - min(v)`, 0 for one without tokens."""
    return np.asarray([current_version - min(v) if len(v) else 0 for v in versions], np.int64)
