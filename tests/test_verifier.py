"""Tests for rollverify_jax.verify.verifier: two-stage verification and cycle stats."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from jax.sharding import NamedSharding, PartitionSpec
from shared import reference_keep

from rollverify_jax.verify import token_ops, two_stage_verify, two_stage_verify_with_stats, verify_stats
from rollverify_jax.verify import verifier as verifier_mod

N, L = 8, 16  # fixed padded shape: every hypothesis example reuses one compilation


def _pad(rows, fill=0.0, dtype=np.float32):
    out = np.full((len(rows), max(len(r) for r in rows)), fill, dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def _verify_from_diffs(diffs, versions, lengths, ds=0.01, dt=2.0):
    """Build logps with log pi - log mu = diff (behaviour logp fixed at -1) and verify."""
    diffs = np.asarray(diffs, np.float32)
    behavior = np.full_like(diffs, -1.0)
    return np.asarray(
        two_stage_verify(
            behavior + diffs, behavior, np.asarray(versions, np.int32), np.asarray(lengths, np.int32), ds, dt
        )
    )


# --- hand cases --------------------------------------------------------------------------------------------


def test_keep_everything_when_on_policy():
    versions = np.array([[0, 0, 1, 1, 2, 2], [3, 3, 3, 3, 3, 3]])
    keep = _verify_from_diffs(np.zeros((2, 6)), versions, [6, 4])
    np.testing.assert_array_equal(keep, [6, 4])
    assert keep.dtype == np.int32


def test_cut_at_first_bad_segment():
    # Segments (by version): [0,1] v=0, [2,3,4] v=1, [5] v=2. Segment 1 has mean OPS ~0.05 >= 0.01.
    diffs = np.array([[0.0, 0.001, 0.05, 0.05, 0.05, 0.9]])
    versions = np.array([[0, 0, 1, 1, 1, 2]])
    np.testing.assert_array_equal(_verify_from_diffs(diffs, versions, [6]), [2])
    # A lower ds catches segment 0 (mean OPS ~5e-4); a huge ds keeps everything.
    np.testing.assert_array_equal(_verify_from_diffs(diffs, versions, [6], ds=1e-4), [0])
    np.testing.assert_array_equal(_verify_from_diffs(diffs, versions, [6], ds=10.0), [6])


def test_cut_at_segment_k_for_each_k():
    n_seg, seg_len = 4, 3
    versions = np.repeat(np.arange(n_seg), seg_len)[None, :]
    for k in range(n_seg):
        diffs = np.zeros((1, n_seg * seg_len))
        diffs[0, k * seg_len + 1] = 0.1  # one moderately shifted token -> segment mean ~0.035
        diffs[0, (k + 1) * seg_len :] = 0.5  # later segments are off too, but k comes first
        np.testing.assert_array_equal(_verify_from_diffs(diffs, versions, [n_seg * seg_len]), [k * seg_len])


def test_token_cut_inside_kept_prefix():
    # Segment means stay below ds because one single spike is diluted by a long on-policy segment,
    # but the spike's own OPS (e^2 - 1 ~ 6.4) exceeds dt = 2.
    diffs = np.zeros((1, 16))
    diffs[0, 9] = 2.0
    versions = np.zeros((1, 16), np.int32)
    np.testing.assert_array_equal(_verify_from_diffs(diffs, versions, [16], ds=1.0), [9])
    # With the default ds the segment stage cuts first (at the segment start, index 0).
    np.testing.assert_array_equal(_verify_from_diffs(diffs, versions, [16]), [0])


def test_token_stage_only_looks_before_keep1():
    # Segment 1 (indices 3..5) fails ds and has a big spike at 4; the spike must not matter (4 >= keep1 = 3).
    diffs = np.array([[0.0, 0.0, 0.0, 0.0, 3.0, 0.0]])
    versions = np.array([[0, 0, 0, 1, 1, 1]])
    np.testing.assert_array_equal(_verify_from_diffs(diffs, versions, [6]), [3])
    # A spike inside the first segment that alone pushes segment 0 over ds: keep1 = 0, so keep = 0.
    diffs = np.array([[0.0, 3.0, 0.0, 0.0, 0.0, 0.0]])
    np.testing.assert_array_equal(_verify_from_diffs(diffs, versions, [6]), [0])


def test_thresholds_are_inclusive():
    # Ties count as off-policy (`>=`): use the exact float32 OPS values as thresholds.
    diffs = np.array([[0.0, 0.0, 0.25, 0.0]], np.float32)
    spike = float(np.asarray(token_ops(diffs + 0.0, np.zeros_like(diffs)))[0, 2])
    one_segment = np.zeros((1, 4), np.int32)
    np.testing.assert_array_equal(_verify_from_diffs(diffs, one_segment, [4], ds=10.0, dt=spike), [2])
    single_token_segment = np.array([[0, 0, 1, 2]], np.int32)
    np.testing.assert_array_equal(_verify_from_diffs(diffs, single_token_segment, [4], ds=spike), [2])


def test_keep_zero_restart_from_prompt():
    diffs = np.full((2, 5), -3.0)  # the new policy finds every token far less likely
    keep = _verify_from_diffs(diffs, np.zeros((2, 5)), [5, 1])
    np.testing.assert_array_equal(keep, [0, 0])


def test_empty_rows_keep_zero():
    np.testing.assert_array_equal(_verify_from_diffs(np.full((2, 4), 5.0), np.zeros((2, 4)), [0, 0]), [0, 0])


def test_padding_values_ignored():
    rng = np.random.default_rng(1)
    diffs = np.zeros((3, 8), np.float32)
    versions = np.array([[0, 0, 0, 1, 1, 1, 1, 1]] * 3)
    lengths = np.array([3, 5, 8])
    base = _verify_from_diffs(diffs, versions, lengths)
    np.testing.assert_array_equal(base, [3, 5, 8])
    junk_diffs, junk_versions = diffs.copy(), versions.copy()
    for i, n in enumerate(lengths):
        junk_diffs[i, n:] = rng.choice([np.nan, np.inf, -np.inf, 30.0], size=8 - n)
        junk_versions[i, n:] = rng.integers(-5, 100, size=8 - n)
    np.testing.assert_array_equal(_verify_from_diffs(junk_diffs, junk_versions, lengths), base)
    # Version 0 continuing into padding must not merge the padding into the last segment either.
    new = np.full((1, 6), -1.0, np.float32)
    new[0, 3:] = 50.0
    keep = two_stage_verify(new, np.full((1, 6), -1.0, np.float32), np.zeros((1, 6), np.int32), np.array([3]))
    np.testing.assert_array_equal(np.asarray(keep), [3])


def test_nan_inside_response_is_cut():
    diffs = np.zeros((1, 6), np.float32)
    diffs[0, 4] = np.nan
    versions = np.array([[0, 0, 0, 1, 1, 1]])
    # The NaN token's segment gets infinite mean OPS, so even a huge ds cuts at that segment's start.
    for ds in (0.01, 100.0):
        np.testing.assert_array_equal(_verify_from_diffs(diffs, versions, [6], ds=ds), [3])


# --- validation ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ds, dt", [(-0.1, 2.0), (float("nan"), 2.0), (0.01, 0.0), (0.01, -1.0)])
def test_bad_thresholds_raise(ds, dt):
    z = np.zeros((1, 2), np.float32)
    with pytest.raises(ValueError, match="ds|dt"):
        two_stage_verify(z, z, z.astype(np.int32), np.array([2]), ds=ds, dt=dt)


def test_bad_shapes_and_lengths_raise():
    z = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="behavior_logp"):
        two_stage_verify(z, z[:, :2], z.astype(np.int32), np.array([1, 1]))
    with pytest.raises(ValueError, match="lengths has shape"):
        two_stage_verify(z, z, z.astype(np.int32), np.array([1, 1, 1]))
    with pytest.raises(ValueError, match=r"\[0, 3\]"):
        two_stage_verify(z, z, z.astype(np.int32), np.array([1, 4]))


# --- property test against the plain-Python reference -------------------------------------------------------

_DIFF = st.one_of(st.just(0.0), st.floats(-0.0625, 0.0625, width=32), st.floats(-3.0, 3.0, width=32))


@st.composite
def _batches(draw):
    lengths = draw(hnp.arrays(np.int32, (N,), elements=st.integers(0, L)))
    diffs = draw(hnp.arrays(np.float32, (N, L), elements=_DIFF))
    # A new version starts with probability ~1/6 per token, so segments are runs of a few tokens.
    new_version = draw(hnp.arrays(np.int8, (N, L), elements=st.integers(0, 5))) == 0
    versions = (np.cumsum(new_version, axis=1) + draw(st.integers(0, 5))).astype(np.int32)
    junk = draw(st.booleans())
    if junk:  # poison the padding: NaN logps and random versions must change nothing
        pad = np.arange(L)[None, :] >= lengths[:, None]
        diffs = np.where(pad, np.nan, diffs).astype(np.float32)
        versions = np.where(pad, draw(st.integers(-3, 50)), versions).astype(np.int32)
    # A large ds leaves work to the token stage.
    ds = draw(st.sampled_from([0.0, 0.003, 0.01, 0.05, 0.3, 1.0, 3.0]))
    dt = draw(st.sampled_from([0.05, 0.5, 2.0, 5.0]))
    return diffs, versions, lengths, ds, dt


@settings(max_examples=120, deadline=None)
@given(_batches())
def test_matches_reference(batch):
    diffs, versions, lengths, ds, dt = batch
    behavior = np.full((N, L), -2.0, np.float32)
    new = behavior + diffs
    got = np.asarray(two_stage_verify(new, behavior, versions, lengths, ds, dt))
    ops = np.asarray(token_ops(new, behavior))  # the same float32 OPS both sides see
    for i in range(N):
        n = int(lengths[i])
        want, means = reference_keep(ops[i, :n].tolist(), versions[i, :n].tolist(), n, ds, dt)
        # float32 vs float64 segment sums may disagree only on a near-exact tie with ds: skip those.
        assume(all(m == ds or abs(m - ds) > 1e-4 * max(ds, 1e-6) for m in means))
        assert got[i] == want, (i, n, got[i], want)
    assert np.all((got >= 0) & (got <= lengths))


def test_no_recompile_across_thresholds():
    z = np.zeros((N, L), np.float32)
    v, n = np.zeros((N, L), np.int32), np.full((N,), L, np.int32)
    two_stage_verify(z, z, v, n, 0.01, 2.0)
    before = verifier_mod._two_stage_verify._cache_size()
    for ds, dt in [(0.0, 0.5), (0.2, 3.0), (1.0, 1.0)]:
        two_stage_verify(z, z, v, n, ds, dt)
    assert verifier_mod._two_stage_verify._cache_size() == before


def test_under_outer_jit_with_traced_thresholds():
    diffs = np.array([[0.0, 0.0, 0.05, 0.05]], np.float32)
    versions = np.array([[0, 0, 1, 1]], np.int32)
    fn = jax.jit(lambda new, old, v, n, ds: two_stage_verify(new, old, v, n, ds, 2.0))
    keep = fn(diffs, np.zeros_like(diffs), versions, jnp.array([4]), jnp.float32(0.01))
    np.testing.assert_array_equal(np.asarray(keep), [2])


def test_sharded_inputs_match_unsharded():
    rng = np.random.default_rng(2)
    diffs = rng.normal(0, 0.05, size=(N, L)).astype(np.float32)
    versions = np.sort(rng.integers(0, 3, size=(N, L)), axis=1).astype(np.int32)
    lengths = rng.integers(0, L + 1, size=(N,)).astype(np.int32)
    behavior = np.full((N, L), -1.0, np.float32)
    want = np.asarray(two_stage_verify(behavior + diffs, behavior, versions, lengths))
    mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    rows, vec = NamedSharding(mesh, PartitionSpec("data", None)), NamedSharding(mesh, PartitionSpec("data"))
    put = lambda x, s: jax.device_put(x, s)
    got = two_stage_verify(
        put(behavior + diffs, rows), put(behavior, rows), put(versions, rows), put(lengths, vec)
    )
    np.testing.assert_array_equal(np.asarray(got), want)


# --- verify_stats -------------------------------------------------------------------------------------------


def test_verify_stats():
    stats = verify_stats(np.array([3, 0, 5, 0]), np.array([4, 2, 5, 0]))
    assert stats == {
        "tokens_kept": 8,
        "tokens_total": 11,
        "tokens_removed": 3,
        "acceptance": 8 / 11,
        "num_verified": 3,
        "num_cut": 2,
        "num_restarted": 1,
    }


def test_verify_stats_nothing_verified_is_full_acceptance():
    assert verify_stats(np.zeros(3, np.int32), np.zeros(3, np.int32))["acceptance"] == 1.0
    assert verify_stats(np.zeros(0, np.int32), np.zeros(0, np.int32))["acceptance"] == 1.0


def test_verify_stats_rejects_bad_input():
    with pytest.raises(ValueError, match=r"\[0, length\]"):
        verify_stats(np.array([3]), np.array([2]))
    with pytest.raises(ValueError, match="must both be"):
        verify_stats(np.array([1, 2]), np.array([2]))


# --- boundaries of the checks, per-row reductions, and clipping of device lengths ---------------------------


def test_shape_errors_name_the_argument():
    z = np.zeros((2, 3), np.float32)
    v = z.astype(np.int32)
    with pytest.raises(ValueError, match=r"^two_stage_verify: behavior_logp has shape \(2, 2\)"):
        two_stage_verify(z, z[:, :2], v, np.array([1, 1]))
    with pytest.raises(ValueError, match=r"^two_stage_verify: versions has shape \(2, 4\)"):
        two_stage_verify(z, z, np.zeros((2, 4), np.int32), np.array([1, 1]))
    with pytest.raises(ValueError, match=r"new_logp must be \[N, L\]"):
        two_stage_verify(z[0], z[0], v[0], np.array([1]))


def test_negative_host_lengths_raise():
    z = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match=r"\[0, 3\]"):
        two_stage_verify(z, z, z.astype(np.int32), np.array([-1, 2]))


def test_empty_batch():
    z = np.zeros((0, 4), np.float32)
    keep = two_stage_verify(z, z, z.astype(np.int32), np.zeros((0,), np.int32))
    assert keep.shape == (0,) and keep.dtype == jnp.int32


def test_device_lengths_are_clipped_to_the_padded_length():
    # Device lengths are not checked on the host; out-of-range values are clipped into [0, L].
    z = np.zeros((2, 4), np.float32)
    keep = two_stage_verify(z, z, z.astype(np.int32), jnp.array([-2, 9], jnp.int32))
    np.testing.assert_array_equal(np.asarray(keep), [0, 4])


def test_threshold_boundaries_are_accepted():
    # ds = 0 is allowed: every non-empty trajectory then restarts (a segment mean is always >= 0).
    diffs, versions = np.zeros((2, 4)), np.zeros((2, 4))
    np.testing.assert_array_equal(_verify_from_diffs(diffs, versions, [4, 0], ds=0.0), [0, 0])
    # Any positive dt is allowed, also below 1: OPS e^0.25 - 1 ~ 0.28 >= 0.25 cuts at that token.
    diffs[0, 2] = 0.25
    np.testing.assert_array_equal(_verify_from_diffs(diffs, versions, [4, 4], ds=10.0, dt=0.25), [2, 4])


def test_each_row_gets_its_own_cut():
    # Row 0: segment cut at 2 (segment [2, 5) has mean OPS e^1.5 - 1 >= ds = 1); its spike at 2 is not earlier.
    # Row 1: one segment with mean ~0.39 < ds, but token 4 has OPS e^1.2 - 1 ~ 2.3 >= dt = 2: token cut at 4.
    # Rows 2 and 3: nothing to cut, keep everything (6 and 3 tokens).
    diffs = np.array(
        [
            [0.0, 0.0, 1.5, 1.5, 1.5, 0.0],
            [0.0, 0.0, 0.0, 0.0, 1.2, 0.0],
            [0.0, 0.1, 0.0, 0.0, 0.1, 0.0],
            [0.0, 0.0, 0.0, 5.0, 5.0, 5.0],
        ]
    )
    versions = np.array([[0, 0, 1, 1, 1, 2], [0] * 6, [0, 0, 1, 1, 1, 1], [7] * 6])
    np.testing.assert_array_equal(_verify_from_diffs(diffs, versions, [6, 6, 6, 3], ds=1.0), [2, 4, 6, 3])


def test_thresholds_are_rounded_to_float32_like_the_ops_even_with_x64():
    # A threshold a hair above a float32 OPS value rounds to that value in float32, so it is a tie and cuts, in
    # x64 mode as in the default mode (the keep lengths must not depend on jax_enable_x64). A numpy float64
    # threshold is not weakly typed, so under x64 it would stay float64 if it were not cast.
    diffs = np.array([[0.0, 0.0, 0.25, 0.0]], np.float32)
    spike = np.float64(np.asarray(token_ops(diffs, np.zeros_like(diffs)))[0, 2])
    above = np.nextafter(spike, np.inf)
    assert np.float32(above) == spike and above > spike
    segments = np.array([[0, 0, 1, 2]], np.int32)
    for x64 in (False, True):
        with jax.enable_x64(x64):
            np.testing.assert_array_equal(_verify_from_diffs(diffs, segments, [4], ds=above), [2])
            np.testing.assert_array_equal(_verify_from_diffs(diffs, segments, [4], ds=10.0, dt=above), [2])


def test_verify_stats_single_token_rows():
    stats = verify_stats(np.array([0, 1, 0]), np.array([1, 1, 0]))
    assert stats == {
        "tokens_kept": 1,
        "tokens_total": 2,
        "tokens_removed": 1,
        "acceptance": 0.5,
        "num_verified": 2,
        "num_cut": 1,
        "num_restarted": 1,
    }
    assert verify_stats(np.array([0]), np.array([1]))["acceptance"] == 0.0
    assert verify_stats(jnp.array([2, 3], jnp.int32), np.array([2, 3]))["acceptance"] == 1.0


def test_verify_stats_rejects_negative_keep_and_2d_input():
    with pytest.raises(ValueError, match=r"\[0, length\]"):
        verify_stats(np.array([-1, 2]), np.array([2, 2]))
    with pytest.raises(ValueError, match="must both be"):
        verify_stats(np.array([[1, 2]]), np.array([[2, 2]]))


@settings(max_examples=60, deadline=None)
@given(_batches(), st.sampled_from([0.003, 0.01, 0.05]))
def test_token_stage_cannot_cut_segments_shorter_than_dt_over_ds(batch, ds):
    """A segment that passes the segment stage has OPS sum < ds * length, so no token in it reaches dt unless the
    segment is longer than dt / ds tokens (200 at the defaults): shorter responses (the tiny task's) get exactly
    the segment stage's cut whatever dt is."""
    diffs, versions, lengths, _, _ = batch
    behavior = np.full((N, L), -2.0, np.float32)
    dt = 1.01 * ds * L  # every segment (at most L tokens) is shorter than dt / ds
    two_stage = np.asarray(two_stage_verify(behavior + diffs, behavior, versions, lengths, ds, dt))
    segment_only = np.asarray(two_stage_verify(behavior + diffs, behavior, versions, lengths, ds, 1e30))
    np.testing.assert_array_equal(two_stage, segment_only)


def test_token_stage_cuts_inside_a_segment_longer_than_dt_over_ds():
    n = 300  # one segment of 300 > dt / ds = 200 tokens: its mean passes, one token's OPS does not
    diffs = np.zeros((1, n), np.float32)
    diffs[0, 150] = np.log(3.5)  # pi / mu = 3.5: OPS 2.5 >= dt; segment mean 2.5 / 300 < ds
    versions = np.zeros((1, n), np.int32)
    assert _verify_from_diffs(diffs, versions, [n], ds=0.01, dt=2.0).tolist() == [150]
    assert _verify_from_diffs(diffs, versions, [n], ds=0.01, dt=1e30).tolist() == [n]


# --- cut statistics (the logged data a cut model is fitted on) --------------------------------------------------


def _segmented(rows, ds=0.01, dt=2.0, current=5):
    """rows: per trajectory a list of (version, ops of each token). Returns (keep, CutStats)."""
    n, width = len(rows), max(sum(len(o) for _, o in r) for r in rows)
    behavior = np.zeros((n, width), np.float32)
    new = np.zeros((n, width), np.float32)
    versions = np.zeros((n, width), np.int32)
    lengths = np.zeros(n, np.int32)
    for i, r in enumerate(rows):
        t = 0
        for v, ops in r:
            for o in ops:
                new[i, t] = np.log1p(o)  # ratio 1 + o: token OPS o
                versions[i, t] = v
                t += 1
        lengths[i] = t
    return two_stage_verify_with_stats(new, behavior, versions, lengths, ds, dt, current)


def test_cut_stats_count_examined_and_failed_segments_by_age():
    keep, cuts = _segmented([
        [(2, [0.0, 0.0]), (3, [0.5, 0.5]), (4, [0.0])],  # ages 3 (passes), 2 (fails: cut at 2); age 1 censored
        [(4, [0.0, 0.0, 0.0])],  # one segment of age 1, passes
        [(3, [0.2, 0.2]), (4, [0.0])],  # age 2 fails at once: restart
    ])
    assert keep.tolist() == [2, 3, 0]
    assert dict(cuts.checked) == {3: 1, 2: 2, 1: 1}
    assert dict(cuts.failed) == {2: 2}
    m = cuts.metrics()
    assert m["verify/segments_failed/2"] == 2 and m["verify/segments_checked/1"] == 1
    assert m["verify/keep_fraction/2"] == pytest.approx((2 / 5 + 0 / 3) / 2)
    assert "verify/keep_fraction/3" not in m and m["verify/token_stage_cuts"] == 0


def test_cut_stats_token_stage_cut_inside_a_passing_segment():
    keep, cuts = _segmented([[(3, [0.0] * 300 + [2.5] + [0.0] * 99)]])  # mean 0.00625 < ds; one token >= dt
    assert keep.tolist() == [300]
    assert cuts.token_cuts == 1 and dict(cuts.failed) == {} and dict(cuts.checked) == {2: 1}


def test_cut_stats_merge_sums_counts():
    _, a = _segmented([[(4, [0.5])]])
    _, b = _segmented([[(4, [0.5]), (4, [0.0])], [(3, [0.0])]])
    a.merge(b)
    assert dict(a.checked) == {1: 2, 2: 1} and dict(a.failed) == {1: 2}


# --- policy shift at the checked tokens (verify/tv_estimate, verify/token_agreement) -----------------------------


def _shift_case():
    """Two rows (lengths 3 and 2, current version 3): per valid token pi/mu and the coupled match bit; the padding
    holds NaN log-probs and a true match bit, which must count for nothing."""
    behavior = np.array([[0.0, 0.0, 0.0], [-1.0, -1.0, -1.0]], np.float32)
    new = np.array([[np.log(0.25), np.log(3.0), np.nan], [-1.0 + np.log(0.5), -1.0 + np.log(0.9), np.nan]], np.float32)
    versions = np.array([[1, 1, 2], [2, 2, 0]], np.int32)  # ages [2, 2, 1] and [1, 1]
    match = np.array([[True, False, True], [False, True, True]])
    return new, behavior, versions, np.array([3, 2], np.int32), match


def test_tv_terms_are_one_minus_the_ratio_clipped_at_zero_and_nan_counts_as_one():
    new, behavior, *_ = _shift_case()
    np.testing.assert_allclose(verifier_mod.tv_terms(new, behavior), [[0.75, 0.0, 1.0], [0.5, 0.1, 1.0]], atol=1e-6)


def test_tv_estimate_is_unbiased_for_the_total_variation():
    """E_{x~mu}[(1 - pi(x)/mu(x))_+] = sum_x (mu(x) - pi(x))_+ = TV(mu, pi), on random distributions."""
    rng = np.random.default_rng(0)
    for _ in range(5):
        mu, pi = rng.dirichlet(np.ones(7)), rng.dirichlet(np.ones(7))
        expected = float(np.sum(mu * verifier_mod.tv_terms(np.log(pi), np.log(mu))))
        assert expected == pytest.approx(0.5 * np.abs(mu - pi).sum(), rel=1e-9)


def test_shift_stats_on_hand_made_arrays():
    new, behavior, versions, lengths, match = _shift_case()
    two_stage = verifier_mod.ShiftStats.of(new, behavior, versions, lengths, current_version=3).metrics()
    assert two_stage == pytest.approx({"verify/tv_estimate": (0.75 + 0 + 1 + 0.5 + 0.1) / 5,
                                       "verify/tv_estimate_age1": (1 + 0.5 + 0.1) / 3,
                                       "verify/tv_estimate_age2": 0.75 / 2})
    coupled = verifier_mod.ShiftStats.of(new, behavior, versions, lengths, 3, match)
    m = coupled.metrics()
    # every valid token counts (not only those before the first cut at row 0's second token); padding does not
    assert m["verify/token_agreement"] == pytest.approx(3 / 5)
    assert m["verify/token_agreement_age1"] == pytest.approx(2 / 3)
    assert m["verify/token_agreement_age2"] == pytest.approx(1 / 2)
    coupled.merge(verifier_mod.ShiftStats.of(new[:1], behavior[:1], versions[:1], lengths[:1], 3, match[:1]))
    assert dict(coupled.tokens) == {1: 4, 2: 4} and dict(coupled.agreed) == {1: 3, 2: 2}
    assert coupled.metrics()["verify/tv_estimate"] == pytest.approx((2.35 + 1.75) / 8)


def test_shift_stats_without_checked_tokens_log_nothing():
    new, behavior, versions, _, match = _shift_case()
    assert verifier_mod.ShiftStats.of(new, behavior, versions, np.zeros(2, np.int32), 3, match).metrics() == {}
