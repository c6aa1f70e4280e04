"""Tests for rollverify_jax.verify.ops: token/sequence OPS, segments, staleness."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rollverify_jax.verify import ops

N, L = 4, 12  # fixed shapes so hypothesis examples reuse one compilation


def _row_segments(versions_row, mask_row):
    """Plain-Python segments: list of (start, end_exclusive) over valid runs of equal versions."""
    segs, t = [], 0
    while t < len(versions_row):
        if not mask_row[t]:
            t += 1
            continue
        s = t
        while t < len(versions_row) and mask_row[t] and versions_row[t] == versions_row[s]:
            t += 1
        segs.append((s, t))
    return segs


_segment_mean_jit = jax.jit(ops.segment_mean_ops)
_segment_ids_jit = jax.jit(ops.segment_ids)


def test_token_ops_matches_formula_and_keeps_shape():
    rng = np.random.default_rng(0)
    new = rng.normal(-2.0, 3.0, size=(3, 5, 7)).astype(np.float32)
    old = rng.normal(-2.0, 3.0, size=(3, 5, 7)).astype(np.float32)
    got = np.asarray(ops.token_ops(new, old))
    want = np.abs(np.exp(np.clip(new.astype(np.float64) - old, -20, 20)) - 1)
    assert got.shape == new.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_token_ops_zero_on_policy_and_clipped_at_20():
    x = jnp.array([-3.0, 0.0, 100.0, -100.0, 5.0])
    got = np.asarray(ops.token_ops(x, jnp.array([-3.0, 0.0, 0.0, 0.0, 5.0])))
    assert got[0] == 0.0 and got[1] == 0.0 and got[4] == 0.0
    np.testing.assert_allclose(got[2], np.expm1(20.0), rtol=1e-6)
    np.testing.assert_allclose(got[3], -np.expm1(-20.0), rtol=1e-6)
    assert np.all(
        np.isfinite(np.asarray(ops.token_ops(jnp.array([jnp.inf, 0.0]), jnp.array([0.0, -jnp.inf]))))
    )


def test_log_ratio_clips():
    got = np.asarray(ops.log_ratio(jnp.array([50.0, -50.0, 1.0]), jnp.array([0.0, 0.0, 0.5])))
    np.testing.assert_allclose(got, [20.0, -20.0, 0.5])


@settings(max_examples=30, deadline=None)
@given(diff=hnp.arrays(np.float32, (8,), elements=st.floats(-30, 30, width=32)))
def test_token_ops_property(diff):
    got = np.asarray(ops.token_ops(diff, np.zeros_like(diff)))
    want = np.abs(np.expm1(np.clip(diff.astype(np.float64), -20, 20)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-30)


def test_sequence_ops_masked_mean_ignores_padding_nan():
    o = jnp.array([[1.0, 3.0, jnp.nan], [2.0, jnp.inf, 5.0], [jnp.nan, jnp.nan, jnp.nan]])
    mask = ops.response_mask(jnp.array([2, 1, 0]), 3)
    np.testing.assert_allclose(np.asarray(ops.sequence_ops(o, mask)), [2.0, 2.0, 0.0])


def test_response_mask():
    np.testing.assert_array_equal(
        np.asarray(ops.response_mask(jnp.array([0, 2, 3]), 3)),
        [[False, False, False], [True, True, False], [True, True, True]],
    )


def test_segment_ids_hand_case():
    versions = jnp.array([[3, 3, 4, 4, 4, 3, 9, 9], [1, 2, 2, 2, 7, 7, 7, 7]])
    mask = ops.response_mask(jnp.array([6, 4]), 8)
    got = np.asarray(ops.segment_ids(versions, mask))
    np.testing.assert_array_equal(got, [[0, 0, 1, 1, 1, 2, -1, -1], [0, 1, 1, 1, -1, -1, -1, -1]])


def test_segment_mask_hole_splits_segment():
    versions = jnp.array([[5, 5, 5, 5]])
    mask = jnp.array([[True, False, True, True]])
    np.testing.assert_array_equal(np.asarray(ops.segment_ids(versions, mask)), [[0, -1, 1, 1]])
    got = np.asarray(ops.segment_mean_ops(jnp.array([[1.0, 100.0, 2.0, 4.0]]), versions, mask))
    np.testing.assert_allclose(got, [[1.0, 0.0, 3.0, 3.0]])


def test_segment_mean_no_cancellation_after_huge_ops():
    # An e^20-sized OPS early on must not wipe out a later segment's small mean (cumsum differencing would).
    o = jnp.array([[np.expm1(20.0), np.expm1(20.0), 0.01, 0.03]], dtype=jnp.float32)
    versions = jnp.array([[0, 0, 1, 1]])
    got = np.asarray(ops.segment_mean_ops(o, versions, jnp.ones((1, 4), bool)))
    np.testing.assert_allclose(got[0, 2:], [0.02, 0.02], rtol=1e-6)


@settings(max_examples=40, deadline=None)
@given(
    o=hnp.arrays(np.float32, (N, L), elements=st.floats(0, 10, width=32)),
    versions=hnp.arrays(np.int32, (N, L), elements=st.integers(0, 2)),
    mask=hnp.arrays(np.bool_, (N, L)),
)
def test_segment_mean_and_ids_match_reference(o, versions, mask):
    got_mean = np.asarray(_segment_mean_jit(o, versions, mask))
    got_ids = np.asarray(_segment_ids_jit(versions, mask))
    want_mean = np.zeros((N, L))
    want_ids = np.full((N, L), -1)
    for i in range(N):
        for k, (s, e) in enumerate(_row_segments(versions[i].tolist(), mask[i].tolist())):
            want_mean[i, s:e] = np.mean(o[i, s:e].astype(np.float64))
            want_ids[i, s:e] = k
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_allclose(got_mean, want_mean, rtol=1e-5, atol=1e-6)


def test_staleness():
    versions = jnp.array([[4, 5, 6, 0], [6, 6, 6, 6], [0, 0, 0, 0], [2, 7, 1, 1]])
    mask = ops.response_mask(jnp.array([3, 4, 0, 2]), 4)
    got = ops.staleness(7, versions, mask)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), [3, 1, 0, 5])


def test_staleness_under_jit_with_traced_version():
    versions = jnp.array([[1, 2, 3]])
    mask = jnp.ones((1, 3), bool)
    got = jax.jit(ops.staleness)(jnp.int32(10), versions, mask)
    np.testing.assert_array_equal(np.asarray(got), [9])


@pytest.mark.parametrize("fn", [ops.sequence_ops, ops.segment_mean_ops])
def test_masked_functions_return_zero_on_padding(fn):
    o = jnp.full((2, 3), jnp.nan)
    mask = jnp.zeros((2, 3), bool)
    args = (o, mask) if fn is ops.sequence_ops else (o, jnp.zeros((2, 3), jnp.int32), mask)
    assert np.all(np.asarray(fn(*args)) == 0.0)


# --- segment boundaries, dtypes, and masks that are not bool ----------------------------------------------


def test_segment_starts_and_ends_hand_case():
    # Row 0: a hole at 3 splits the version-0 run; the last token (version 0, at L-1) ends its segment.
    # Row 1: response of 5 tokens, then padding that continues version 2 (padding is never a start or an end).
    versions = jnp.array([[0, 0, 1, 1, 1, 0, 0, 0], [2, 2, 2, 3, 2, 2, 2, 2]])
    mask = jnp.array([[1, 1, 1, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0, 0]], bool)
    starts = np.asarray(ops.segment_starts(versions, mask))
    ends = np.asarray(ops.segment_ends(versions, mask))
    assert starts.dtype == np.bool_ and ends.dtype == np.bool_
    np.testing.assert_array_equal(starts.astype(int), [[1, 0, 1, 0, 1, 1, 0, 0], [1, 0, 0, 1, 1, 0, 0, 0]])
    np.testing.assert_array_equal(ends.astype(int), [[0, 1, 1, 0, 1, 0, 0, 1], [0, 0, 1, 1, 1, 0, 0, 0]])
    ids = ops.segment_ids(versions, mask)
    assert ids.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(ids), [[0, 0, 1, -1, 2, 3, 3, 3], [0, 0, 0, 1, 2, -1, -1, -1]])


def test_integer_masks_behave_like_bool_masks():
    # Attention masks often arrive as 0/1 integers (or any nonzero value); the result must match the bool mask.
    o = jnp.array([[1.0, 2.0, 4.0, jnp.nan], [3.0, 5.0, 7.0, 9.0]])
    versions = jnp.array([[0, 0, 1, 1], [4, 4, 4, 4]])
    bool_mask = jnp.array([[True, True, True, False], [False, True, True, False]])
    for int_mask in (bool_mask.astype(jnp.int32), bool_mask.astype(jnp.int32) * 2):
        np.testing.assert_array_equal(np.asarray(ops.sequence_ops(o, int_mask)), np.float32([7.0 / 3.0, 6.0]))
        np.testing.assert_array_equal(
            np.asarray(_segment_mean_jit(o, versions, int_mask)), [[1.5, 1.5, 4.0, 0.0], [0.0, 6.0, 6.0, 0.0]]
        )
        np.testing.assert_array_equal(np.asarray(_segment_ids_jit(versions, int_mask)), [[0, 0, 1, -1], [-1, 0, 0, -1]])
        np.testing.assert_array_equal(np.asarray(ops.staleness(5, versions, int_mask)), [5, 1])
        for fn in (ops.segment_starts, ops.segment_ends):
            got = fn(versions, int_mask)
            assert got.dtype == jnp.bool_
            np.testing.assert_array_equal(np.asarray(got), np.asarray(fn(versions, bool_mask)))


def test_response_mask_truncates_float_lengths():
    # Lengths are token counts: a float array of lengths is cast to int32 (truncated), like everywhere else.
    np.testing.assert_array_equal(
        np.asarray(ops.response_mask(np.array([2.0, 3.7]), 4)), [[True, True, False, False], [True, True, True, False]]
    )


def test_output_dtypes_do_not_follow_64bit_or_bf16_inputs():
    # Under jax_enable_x64, float64/int64 inputs must still give float32 OPS and int32 ids/staleness (the
    # documented dtypes), with the same values as the float32 computation.
    new = np.array([[-1.0, -2.0, 30.0, -0.5]])
    old = np.array([[-1.5, -2.0, 0.0, -0.25]])
    versions = np.array([[3, 3, 5, 5]], np.int64)
    mask = np.array([[True, True, True, False]])
    want_ratio = np.clip(new.astype(np.float32) - old.astype(np.float32), -20, 20)
    with jax.enable_x64(True):
        ratio = ops.log_ratio(new, old)
        tok = ops.token_ops(new, old)
        seq = ops.sequence_ops(np.asarray(tok, np.float64), mask)
        seg = _segment_mean_jit(np.asarray(tok, np.float64), versions, mask)
        ids = _segment_ids_jit(versions, mask)
        stale = ops.staleness(np.int64(9), versions, mask)
    assert ratio.dtype == jnp.float32 and tok.dtype == jnp.float32
    assert seq.dtype == jnp.float32 and seg.dtype == jnp.float32
    assert ids.dtype == jnp.int32 and stale.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(ratio), want_ratio)
    np.testing.assert_array_equal(np.asarray(stale), [6])
    np.testing.assert_array_equal(np.asarray(ids), [[0, 0, 1, -1]])
    tok32 = np.asarray(tok)
    np.testing.assert_allclose(np.asarray(seq), [tok32[0, :3].mean()], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(seg)[0, 2], tok32[0, 2], rtol=1e-6)
    # bfloat16 OPS (a bf16 model's log-probs) are reduced in float32.
    o16 = jnp.array([[1.0, 2.0, 4.0, 8.0]], jnp.bfloat16)
    assert ops.sequence_ops(o16, mask).dtype == jnp.float32
    assert _segment_mean_jit(o16, versions, mask).dtype == jnp.float32
